// Where kvq-eval and its tests find the real-model files that
// scripts/fetch_eval_data.sh downloads (they are too large to check in).
#ifndef KVQ_BENCH_EVAL_EVAL_DATA_H_
#define KVQ_BENCH_EVAL_EVAL_DATA_H_

#include <string>

namespace kvq::eval {

// File name of the model kvq-eval runs (SmolLM2-135M-Instruct, GGUF Q4_1).
inline constexpr char kEvalModelFileName[] = "SmolLM2-135M-Instruct.Q4_1.gguf";

// $KVQ_EVAL_DATA if set and non-empty, else $XDG_CACHE_HOME/kvq/eval, else
// $HOME/.cache/kvq/eval (".cache/kvq/eval" relative to the working directory
// when HOME is unset too).
std::string EvalDataDir();

// $KVQ_EVAL_MODEL if set and non-empty, else EvalDataDir() + "/" +
// kEvalModelFileName.
std::string EvalModelPath();

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_EVAL_DATA_H_
