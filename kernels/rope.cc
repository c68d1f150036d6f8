#include "kernels/rope.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvq {

absl::Status RopeConfig::Validate(int head_dim) const {
  const int rot = rotary_dim == 0 ? head_dim : rotary_dim;
  if (rot <= 0 || rot > head_dim || rot % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope.rotary_dim must be even and in [2, head_dim=", head_dim, "], got ", rotary_dim));
  }
  if (!(theta > 1.0f) || !std::isfinite(theta)) {
    return absl::InvalidArgumentError(absl::StrCat("rope.theta must be > 1, got ", theta));
  }
  if (!(factor >= 1.0f) || !std::isfinite(factor)) {
    return absl::InvalidArgumentError(absl::StrCat("rope.factor must be >= 1, got ", factor));
  }
  return absl::OkStatus();
}

Rope::Rope(const RopeConfig& config, int head_dim)
    : config_(config),
      head_dim_(head_dim),
      rotary_dim_(config.rotary_dim == 0 ? head_dim : config.rotary_dim) {
  double base = config.theta;
  if (config.scaling == RopeConfig::Scaling::kNtk) {
    base *= std::pow(static_cast<double>(config.factor),
                     static_cast<double>(rotary_dim_) / (rotary_dim_ - 2));
  }
  inv_freq_.resize(rotary_dim_ / 2);
  for (int i = 0; i < rotary_dim_ / 2; ++i) {
    inv_freq_[i] = std::pow(base, -2.0 * i / rotary_dim_);
  }
}

double Rope::Angle(int pair, double position) const {
  if (config_.scaling == RopeConfig::Scaling::kLinear) position /= config_.factor;
  return position * inv_freq_[pair];
}

int Rope::First(int pair) const {
  return config_.pairing == RopeConfig::Pairing::kAdjacent ? 2 * pair : pair;
}

int Rope::Second(int pair) const {
  return config_.pairing == RopeConfig::Pairing::kAdjacent ? 2 * pair + 1
                                                            : pair + rotary_dim_ / 2;
}

void Rope::Apply(float* x, double position, int sign) const {
  for (int i = 0; i < rotary_dim_ / 2; ++i) {
    const double a = Angle(i, position);
    const float c = static_cast<float>(std::cos(a));
    const float s = static_cast<float>(sign * std::sin(a));
    float& x0 = x[First(i)];
    float& x1 = x[Second(i)];
    const float r0 = x0 * c - x1 * s;
    const float r1 = x0 * s + x1 * c;
    x0 = r0;
    x1 = r1;
  }
}

}  // namespace kvq
