// The host-side pieces of crq (docs/KERNELS.md, "crq"): its codebook
// tables and the map between a stream's original basis and the coordinates
// it codes.
//
// Coded coordinates of token p (RoPE position p):
//   keys    y = H (R_p (k_pre - mu_k) / s_k)
//   values  y = H ((v - mu_v) / s_v)
// with H the stream's randomized normalized Hadamard transform
// (config.rotation_seed) and R_p RoPE at p. A key scale is equal on both
// channels of a RoPE pair, so dividing by it commutes with R_p: a query
// then meets the keys as q . k_post = q . R_p mu_k + (H (s_k q)) . y.
#ifndef KVQ_KERNELS_CRQ_TRANSFORM_H_
#define KVQ_KERNELS_CRQ_TRANSFORM_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kernels/calibration.h"
#include "kernels/hadamard.h"
#include "kernels/hd/crq_hd.h"
#include "kernels/page_layout.h"
#include "kernels/rope.h"
#include "kernels/stream_config.h"
#include "kernels/tensor.h"

namespace kvq {

// The Lloyd-Max levels of 2, 3 and 4 bits (kernels/lloyd_max.h) as the hd
// kernels take them.
const hd::CrqCodebooks& CrqCodebooks();

// A calibration from the moments of sample K/V alone ([n, head_dim] each,
// keys before RoPE): channel means, value scales the channels' RMS about
// their mean, key scales the RMS over each RoPE pair (equal within it).
// Unlike kvq-eval's calibration it knows no queries or output projection:
// for benchmarks and tests. INVALID_ARGUMENT on a shape mismatch or no rows.
absl::StatusOr<HeadCalibration> MomentCalibration(const StreamConfig& config,
                                                  ConstTensorView keys, ConstTensorView values);

class CrqTransform {
 public:
  // INVALID_ARGUMENT when `calibration` does not fit `config` (size, values,
  // a key scale that differs within a RoPE pair: the message names the two
  // channels).
  static absl::StatusOr<CrqTransform> Make(const StreamConfig& config,
                                           const HeadCalibration& calibration);

  // Rows [n][d] of one side at positions first, first + 1, ... (in place):
  // original basis (keys pre-RoPE) to coded coordinates.
  void Forward(Side side, float* rows, int n, int first) const;
  // Coded coordinates back to the original basis (keys pre-RoPE).
  void Inverse(Side side, float* rows, int n, int first) const;

  // A query row (post-RoPE basis, [head_dim]) as crq attention meets the
  // keys, computed once per step: q = scale * query (scores a key as
  // q . R_t mu_k plus, for a coded key, its gain times qr . levels) and
  // qr = H (s_k q). The cuda_host and cuda backends share it.
  void AttentionQuery(const float* query, float scale, float* q, float* qr) const;

  const HeadCalibration& calibration() const { return calibration_; }
  const HadamardRotation& rotation() const { return rotation_; }
  const Rope& rope() const { return rope_; }

 private:
  CrqTransform(const StreamConfig& config, const HeadCalibration& calibration);

  HeadCalibration calibration_;
  HadamardRotation rotation_;
  Rope rope_;
  std::vector<float> inv_key_scale_, inv_value_scale_;
};

}  // namespace kvq

#endif  // KVQ_KERNELS_CRQ_TRANSFORM_H_
