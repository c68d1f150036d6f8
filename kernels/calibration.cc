#include "kernels/calibration.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvq {
namespace {

absl::Status CheckVector(const std::vector<float>& v, const char* name, int head_dim,
                         bool positive) {
  if (static_cast<int>(v.size()) != head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("calibration ", name, " has ", v.size(),
                                                   " channels, head_dim is ", head_dim));
  }
  for (int c = 0; c < head_dim; ++c) {
    if (!std::isfinite(v[c]) || (positive && !(v[c] > 0.0f))) {
      return absl::InvalidArgumentError(absl::StrCat("calibration ", name, " channel ", c,
                                                     positive ? " must be finite and > 0"
                                                              : " must be finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HeadCalibration::Validate(int head_dim) const {
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration needs an even head_dim, got ", head_dim));
  }
  if (absl::Status s = CheckVector(key_mean, "key_mean", head_dim, false); !s.ok()) return s;
  if (absl::Status s = CheckVector(key_scale, "key_scale", head_dim, true); !s.ok()) return s;
  if (absl::Status s = CheckVector(value_mean, "value_mean", head_dim, false); !s.ok()) return s;
  if (absl::Status s = CheckVector(value_scale, "value_scale", head_dim, true); !s.ok()) return s;
  return absl::OkStatus();
}

HeadCalibration HeadCalibration::Identity(int head_dim) {
  HeadCalibration h;
  h.key_mean.assign(head_dim, 0.0f);
  h.key_scale.assign(head_dim, 1.0f);
  h.value_mean.assign(head_dim, 0.0f);
  h.value_scale.assign(head_dim, 1.0f);
  return h;
}

absl::Status ModelCalibration::Validate() const {
  if (num_layers <= 0 || num_kv_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("calibration shape ", num_layers, " layers x ",
                                                   num_kv_heads, " KV heads must be positive"));
  }
  const size_t want = static_cast<size_t>(num_layers) * num_kv_heads;
  if (heads.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("calibration holds ", heads.size(),
                                                   " heads, its shape needs ", want));
  }
  for (size_t i = 0; i < heads.size(); ++i) {
    if (absl::Status s = heads[i].Validate(head_dim); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("layer ", i / num_kv_heads, " KV head ",
                                                 i % num_kv_heads, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvq
