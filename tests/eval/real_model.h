// The evaluation model for the tests of tests/eval: opened from
// EvalModelPath() (scripts/fetch_eval_data.sh fills it). A missing model
// fails the test with that instruction; it never passes silently as a skip.
#ifndef KVQ_TESTS_EVAL_REAL_MODEL_H_
#define KVQ_TESTS_EVAL_REAL_MODEL_H_

#include <memory>

#include "bench/eval/bpe_tokenizer.h"
#include "bench/eval/gguf_file.h"
#include "bench/eval/llama_model.h"
#include "gtest/gtest.h"

namespace kvq::eval {

// The GGUF file, or nullptr after ADD_FAILURE.
std::unique_ptr<GgufFile> OpenEvalModel();

struct RealModel {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<BpeTokenizer> tokenizer;
};

// Loaded once per test binary (the fp32 weights take half a GiB); nullptr
// after ADD_FAILURE.
RealModel* SharedRealModel();

// A fixture whose tests run the shared model: SetUp fails the test when it
// did not load.
class RealModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RealModel* real = SharedRealModel();
    ASSERT_NE(real, nullptr);
    model_ = real->model.get();
    tokenizer_ = real->tokenizer.get();
  }

  static inline LlamaModel* model_ = nullptr;
  static inline BpeTokenizer* tokenizer_ = nullptr;
};

}  // namespace kvq::eval

#endif  // KVQ_TESTS_EVAL_REAL_MODEL_H_
