// Learning nuq codebooks (KVQuant's non-uniform levels) from calibration KV.
#ifndef KVQ_KERNELS_CODEBOOK_LEARNER_H_
#define KVQ_KERNELS_CODEBOOK_LEARNER_H_

#include "absl/status/statusor.h"
#include "kernels/stream_config.h"
#include "kernels/tensor.h"

namespace kvq {

// Learns per-channel levels for `config` from calibration rows of one
// (layer, KV head): keys and values [n, head_dim] with n >= the group size,
// in the basis the client appends (pre-RoPE keys for pre_rope schemes).
//
// Each value is normalised exactly as the quantizer will see it (rotated if
// the scheme rotates, outliers excluded, mapped to [0, 1] by its group's
// min and range), then a 1-D k-means (Lloyd, `iterations` rounds, started
// from quantiles) per channel places 2^bits levels, with the end levels
// pinned at 0 and 1 because every group's min and max land there.
absl::StatusOr<Codebook> LearnCodebook(const StreamConfig& config, ConstTensorView keys,
                                       ConstTensorView values, int iterations = 25);

}  // namespace kvq

#endif  // KVQ_KERNELS_CODEBOOK_LEARNER_H_
