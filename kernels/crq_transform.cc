#include "kernels/crq_transform.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/lloyd_max.h"
#include "kernels/numeric.h"
#include "kernels/status_macros.h"

namespace kvq {

const hd::CrqCodebooks& CrqCodebooks() {
  static const hd::CrqCodebooks* tables = [] {
    auto* t = new hd::CrqCodebooks();
    for (int bits = 2; bits <= 4; ++bits) {
      const LloydMaxCodebook& cb = LloydMax(bits);
      float* levels = t->levels + (1 << bits) - 4;
      float* thresholds = t->thresholds + (1 << bits) - bits - 2;
      for (size_t i = 0; i < cb.levels.size(); ++i) levels[i] = cb.levels[i];
      for (size_t i = 0; i < cb.thresholds.size(); ++i) thresholds[i] = cb.thresholds[i];
    }
    return t;
  }();
  return *tables;
}

absl::StatusOr<HeadCalibration> MomentCalibration(const StreamConfig& config,
                                                  ConstTensorView keys, ConstTensorView values) {
  const int d = config.head_dim;
  if (keys.cols != d || values.cols != d || keys.rows != values.rows || keys.rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moment calibration needs keys and values of [n >= 1, ", d, "], got [", keys.rows, ", ",
        keys.cols, "] and [", values.rows, ", ", values.cols, "]"));
  }
  const int n = keys.rows;
  auto moments = [&](ConstTensorView x, std::vector<float>* mean, std::vector<double>* var) {
    std::vector<double> sum(d, 0.0), sq(d, 0.0);
    std::vector<float> row(d);
    for (int t = 0; t < n; ++t) {
      RowToFloat(x.row(t), x.dtype, d, row.data());
      for (int c = 0; c < d; ++c) {
        sum[c] += row[c];
        sq[c] += static_cast<double>(row[c]) * row[c];
      }
    }
    mean->resize(d);
    var->resize(d);
    for (int c = 0; c < d; ++c) {
      const double m = sum[c] / n;
      (*mean)[c] = static_cast<float>(m);
      (*var)[c] = std::max(sq[c] / n - m * m, 0.0);
    }
  };
  HeadCalibration cal;
  std::vector<double> kvar, vvar;
  moments(keys, &cal.key_mean, &kvar);
  moments(values, &cal.value_mean, &vvar);
  const Rope rope(config.rope, d);
  for (int j = 0; j < rope.rotary_dim() / 2; ++j) {
    const int f = rope.First(j), s = rope.Second(j);
    kvar[f] = kvar[s] = 0.5 * (kvar[f] + kvar[s]);
  }
  // A floor keeps a constant channel's scale > 0 (Validate's rule).
  for (int c = 0; c < d; ++c) {
    cal.key_scale.push_back(static_cast<float>(std::sqrt(kvar[c]) + 1e-3));
    cal.value_scale.push_back(static_cast<float>(std::sqrt(vvar[c]) + 1e-3));
  }
  return cal;
}

CrqTransform::CrqTransform(const StreamConfig& config, const HeadCalibration& calibration)
    : calibration_(calibration),
      rotation_(config.head_dim, config.rotation_seed),
      rope_(config.rope, config.head_dim) {
  for (float s : calibration_.key_scale) inv_key_scale_.push_back(1.0f / s);
  for (float s : calibration_.value_scale) inv_value_scale_.push_back(1.0f / s);
}

absl::StatusOr<CrqTransform> CrqTransform::Make(const StreamConfig& config,
                                                const HeadCalibration& calibration) {
  KVQ_RETURN_IF_ERROR(calibration.Validate(config.head_dim));
  KVQ_RETURN_IF_ERROR(config.rope.Validate(config.head_dim));
  const Rope rope(config.rope, config.head_dim);
  for (int j = 0; j < rope.rotary_dim() / 2; ++j) {
    const int f = rope.First(j), s = rope.Second(j);
    if (calibration.key_scale[f] != calibration.key_scale[s]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "calibration key_scale must be equal within each RoPE pair (scaling must commute "
          "with RoPE): channels ", f, " and ", s, " have ", calibration.key_scale[f], " and ",
          calibration.key_scale[s]));
    }
  }
  return CrqTransform(config, calibration);
}

void CrqTransform::Forward(Side side, float* rows, int n, int first) const {
  const int d = rotation_.dim();
  const bool key = side == Side::kKey;
  const std::vector<float>& mean = key ? calibration_.key_mean : calibration_.value_mean;
  const std::vector<float>& inv = key ? inv_key_scale_ : inv_value_scale_;
  for (int r = 0; r < n; ++r) {
    float* x = rows + static_cast<size_t>(r) * d;
    for (int c = 0; c < d; ++c) x[c] -= mean[c];
    if (key) rope_.Apply(x, first + r);
    for (int c = 0; c < d; ++c) x[c] *= inv[c];
    rotation_.Forward(x);
  }
}

void CrqTransform::AttentionQuery(const float* query, float scale, float* q, float* qr) const {
  const int d = rotation_.dim();
  for (int c = 0; c < d; ++c) q[c] = query[c] * scale;
  for (int c = 0; c < d; ++c) qr[c] = q[c] * calibration_.key_scale[c];
  rotation_.Forward(qr);
}

void CrqTransform::Inverse(Side side, float* rows, int n, int first) const {
  const int d = rotation_.dim();
  const bool key = side == Side::kKey;
  const std::vector<float>& mean = key ? calibration_.key_mean : calibration_.value_mean;
  const std::vector<float>& scale = key ? calibration_.key_scale : calibration_.value_scale;
  for (int r = 0; r < n; ++r) {
    float* x = rows + static_cast<size_t>(r) * d;
    rotation_.Inverse(x);
    for (int c = 0; c < d; ++c) x[c] *= scale[c];
    if (key) rope_.Apply(x, first + r, -1);
    for (int c = 0; c < d; ++c) x[c] += mean[c];
  }
}

}  // namespace kvq
