#include "bench/eval/decode_metric.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace kvq::eval {

absl::StatusOr<WindowResult> RunScoredWindow(LlamaModel& model, absl::Span<const int32_t> window,
                                             AttentionCache* cache, int chunk,
                                             const Reference* reference,
                                             Reference* reference_out) {
  const int C = static_cast<int>(window.size());
  const int V = model.config().vocab;
  if (C < 2 || chunk < 1) {
    return absl::InvalidArgumentError(absl::StrCat("window: ", C, " tokens is too short"));
  }
  const size_t reference_size = static_cast<size_t>(C - 1) * V;
  if (reference && reference->logprobs.size() != reference_size) {
    return absl::InvalidArgumentError("reference: computed for a different window");
  }
  if (reference == nullptr && reference_out == nullptr) {
    return absl::InvalidArgumentError("RunScoredWindow: neither a reference nor its output");
  }
  if (reference_out) reference_out->logprobs.assign(reference_size, 0.0f);
  WindowResult r;
  r.tokens = C;
  std::vector<float> logits, lp;
  const auto t0 = std::chrono::steady_clock::now();
  for (int pos = 0; pos < C; pos += chunk) {
    const int n = std::min(chunk, C - pos);
    KVQ_RETURN_IF_ERROR(model.Forward(window.subspan(pos, n), cache, true, &logits));
    ScorePositions(window, pos, n, V, logits, reference, reference_out, &lp, &r);
  }
  r.prefill_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  KVQ_ASSIGN_OR_RETURN(r.bytes, cache->Bytes());
  return r;
}

}  // namespace kvq::eval
