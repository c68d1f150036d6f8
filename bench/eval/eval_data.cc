#include "bench/eval/eval_data.h"

#include <cstdlib>

namespace kvq::eval {
namespace {

// Unset and empty both mean "not configured", as the XDG spec asks.
const char* NonEmptyEnv(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

}  // namespace

std::string EvalDataDir() {
  if (const char* dir = NonEmptyEnv("KVQ_EVAL_DATA")) return dir;
  if (const char* cache = NonEmptyEnv("XDG_CACHE_HOME")) return std::string(cache) + "/kvq/eval";
  if (const char* home = NonEmptyEnv("HOME")) return std::string(home) + "/.cache/kvq/eval";
  return ".cache/kvq/eval";
}

std::string EvalModelPath() {
  if (const char* model = NonEmptyEnv("KVQ_EVAL_MODEL")) return model;
  return EvalDataDir() + "/" + kEvalModelFileName;
}

}  // namespace kvq::eval
