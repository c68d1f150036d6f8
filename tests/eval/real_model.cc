#include "tests/eval/real_model.h"

#include <string>

#include "bench/eval/eval_data.h"
#include "gtest/gtest.h"

namespace kvq::eval {

std::unique_ptr<GgufFile> OpenEvalModel() {
  const std::string path = EvalModelPath();
  auto file = GgufFile::Open(path);
  if (!file.ok()) {
    ADD_FAILURE() << "cannot open the eval model " << path << ": " << file.status()
                  << "\nRun scripts/fetch_eval_data.sh to download it (or set KVQ_EVAL_MODEL).";
    return nullptr;
  }
  return *std::move(file);
}

RealModel* SharedRealModel() {
  static RealModel* loaded = [] () -> RealModel* {
    auto m = std::make_unique<RealModel>();
    m->file = OpenEvalModel();
    if (m->file == nullptr) return nullptr;
    auto model = LlamaModel::Load(*m->file);
    auto tokenizer = BpeTokenizer::FromGguf(*m->file);
    if (!model.ok() || !tokenizer.ok()) {
      ADD_FAILURE() << "loading the eval model: "
                    << (model.ok() ? tokenizer.status() : model.status());
      return nullptr;
    }
    m->model = std::move(*model);
    m->tokenizer = std::make_unique<BpeTokenizer>(std::move(*tokenizer));
    return m.release();
  }();
  if (loaded == nullptr) ADD_FAILURE() << "the eval model did not load (see above)";
  return loaded;
}

}  // namespace kvq::eval
