// Calibration: the per-(layer, KV head) statistics a calibrated scheme
// centers and scales K/V with before it rotates and codes them.
//
// They are learned offline from a calibration text (kvq-eval writes them),
// never from the KV being stored: a decode worker names a calibration the
// server has loaded instead of shipping statistics with its KV. Keys are
// described before RoPE (their channel means are position-free there); a key
// scale is equal on both channels of a RoPE pair so that scaling commutes
// with RoPE.
#ifndef KVQ_KERNELS_CALIBRATION_H_
#define KVQ_KERNELS_CALIBRATION_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvq {

struct HeadCalibration {
  std::vector<float> key_mean;     // [head_dim], pre-RoPE channel means.
  std::vector<float> key_scale;    // [head_dim], > 0, equal within a RoPE
                                   // pair (the stream checks, knowing its
                                   // RopeConfig's pairing).
  std::vector<float> value_mean;   // [head_dim]
  std::vector<float> value_scale;  // [head_dim], > 0

  int head_dim() const { return static_cast<int>(key_mean.size()); }
  // INVALID_ARGUMENT naming the vector and the channel when a size differs
  // from `head_dim`, a value is not finite or a scale is not > 0.
  absl::Status Validate(int head_dim) const;
  // Zero means and unit scales: the scheme then only rotates and codes.
  static HeadCalibration Identity(int head_dim);

  friend bool operator==(const HeadCalibration&, const HeadCalibration&) = default;
};

// The calibration of one model: a HeadCalibration per (layer, KV head).
struct ModelCalibration {
  std::string name;  // What CreateSequence names it by.
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  std::vector<HeadCalibration> heads;  // [layer][kv_head], layer-major.

  const HeadCalibration& Head(int layer, int kv_head) const {
    return heads[static_cast<size_t>(layer) * num_kv_heads + kv_head];
  }
  // Shape and every head's Validate().
  absl::Status Validate() const;

  friend bool operator==(const ModelCalibration&, const ModelCalibration&) = default;
};

}  // namespace kvq

#endif  // KVQ_KERNELS_CALIBRATION_H_
