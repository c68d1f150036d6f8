// The decode-faithful perplexity of one window: every next-token
// prediction scored with the cache state token-by-token decoding gives it
// (DecodeFaithfulCache), teacher-forced on the window's own tokens. It is
// kvq-eval's headline metric; RunWindow's chunked-prefill figure is the
// second (docs/QUALITY.md).
#ifndef KVQ_BENCH_EVAL_DECODE_METRIC_H_
#define KVQ_BENCH_EVAL_DECODE_METRIC_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "bench/eval/attention_cache.h"
#include "bench/eval/eval_runner.h"
#include "bench/eval/llama_model.h"

namespace kvq::eval {

// Runs `window` through `model` on `cache` (empty on entry; a
// DecodeFaithfulCache for the decode metric) in forward steps of `chunk`
// tokens and scores every position: nll_sum, scored, kl_sum (against
// `reference`'s log-probabilities when given), bytes, tokens and
// prefill_seconds (the whole pass). With `reference` null the run is the
// reference and fills reference_out->logprobs.
absl::StatusOr<WindowResult> RunScoredWindow(LlamaModel& model, absl::Span<const int32_t> window,
                                             AttentionCache* cache, int chunk,
                                             const Reference* reference, Reference* reference_out);

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_DECODE_METRIC_H_
