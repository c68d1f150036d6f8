// Kernel-only timing of the CUDA backend's launches, for `kvq-bench device`:
// every input is on the device before the timed region starts, and the
// launches are timed with CUDA events recorded on the stream they run on,
// so host staging and copies are not counted. The host enqueues ahead of
// the device, so for launches longer than their enqueue (milliseconds, at
// the bench's sizes) the events measure the kernels alone.
#ifndef KVQ_KERNELS_CUDA_KERNEL_TIMING_H_
#define KVQ_KERNELS_CUDA_KERNEL_TIMING_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"

namespace kvq {

// Milliseconds of each of `reps` decode-attention launches over all of
// `tasks` (streams of the cuda backend, one head_dim and one kernel kind:
// one launch), after `warmup` untimed launches. The last launch's outputs
// are written to the tasks' out and lse, as Attend() writes them.
// INVALID_ARGUMENT for tasks Attend() would refuse, for tasks that need
// more than one launch, or for reps < 1 or warmup < 0.
absl::StatusOr<std::vector<double>> TimeDeviceAttention(absl::Span<const AttentionTask> tasks,
                                                        const AttentionOptions& options,
                                                        int warmup, int reps);

// Milliseconds of each of `reps` quantize (append) launches, after `warmup`
// untimed ones: `copies` separate copies of `tokens` fp16 rows of N(0, 1)
// values, staged on the device first, quantized on side `side` in the
// scheme and page layout of `like` into scratch pages of their own (the
// stream is not written). tokens: a positive multiple of the layout's
// page_tokens. The input bytes per launch are copies * tokens *
// head_dim * 2.
absl::StatusOr<std::vector<double>> TimeDeviceQuantize(const KvStream& like, Side side,
                                                       int tokens, int copies, int warmup,
                                                       int reps);

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_KERNEL_TIMING_H_
