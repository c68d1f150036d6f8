#include "kernels/codebook_learner.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/outliers.h"
#include "kernels/hadamard.h"
#include "kernels/page_layout.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

// A normalised value and the weight of its error: the squared range of its
// group, because the real (unnormalised) error is range * normalised error.
struct Sample {
  float u;
  float w;
  bool operator<(const Sample& o) const { return u < o.u; }
};

// Normalised samples per channel of one side.
std::vector<std::vector<Sample>> Normalise(const std::vector<float>& x, int n, int d,
                                          const PageLayout& L, const SideLayout& S) {
  std::vector<std::vector<Sample>> samples(d);
  const int g = L.block_tokens;
  for (int b = 0; b + g <= n; b += g) {
    const float* block = &x[static_cast<size_t>(b) * d];
    std::vector<uint8_t> skip(static_cast<size_t>(g) * d, 0);
    if (L.outliers_per_block > 0) {
      for (int i : SelectOutliers(block, g, d, S, L.outliers_per_block)) skip[i] = 1;
    }
    auto add_group = [&](auto&& for_each) {
      float mn = INFINITY, mx = -INFINITY;
      for_each([&](int i) {
        if (!skip[i]) mn = std::min(mn, block[i]), mx = std::max(mx, block[i]);
      });
      if (!(mx > mn)) return;
      for_each([&](int i) {
        if (!skip[i]) samples[i % d].push_back({(block[i] - mn) / (mx - mn), (mx - mn) * (mx - mn)});
      });
    };
    if (S.axis == ParamAxis::kChannelGroups) {
      for (int c = 0; c < d; ++c) {
        add_group([&](auto&& f) { for (int t = 0; t < g; ++t) f(t * d + c); });
      }
    } else {
      const int gc = S.group_channels;
      for (int t = 0; t < g; ++t) {
        for (int j = 0; j < d / gc; ++j) {
          add_group([&](auto&& f) { for (int c = j * gc; c < (j + 1) * gc; ++c) f(t * d + c); });
        }
      }
    }
  }
  return samples;
}

// Weighted error of quantizing sorted samples to the nearest of `levels`.
double QuantError(const std::vector<Sample>& s, const float* levels, int k) {
  double err = 0.0;
  int j = 0;
  for (const Sample& x : s) {
    while (j + 1 < k && std::fabs(levels[j + 1] - x.u) <= std::fabs(levels[j] - x.u)) ++j;
    const double e = x.u - levels[j];
    err += x.w * e * e;
  }
  return err;
}

// Weighted 1-D k-means (Lloyd) with the end levels pinned at 0 and 1. The
// result is kept only if it beats uniform levels on the calibration data
// itself: k-means finds a local optimum, and on symmetric tails uniform
// levels can be better.
void KMeans1D(std::vector<Sample>& s, int k, int iterations, float* levels) {
  for (int i = 0; i < k; ++i) levels[i] = static_cast<float>(i) / (k - 1);
  if (s.size() < static_cast<size_t>(4 * k)) return;  // Too little data: stay uniform.
  std::sort(s.begin(), s.end());
  const double uniform_error = QuantError(s, levels, k);
  std::vector<float> l(k);
  l[0] = 0.0f;
  l[k - 1] = 1.0f;
  for (int i = 1; i < k - 1; ++i) l[i] = s[s.size() * i / (k - 1)].u;
  std::vector<double> sum(k), weight(k);
  for (int it = 0; it < iterations; ++it) {
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(weight.begin(), weight.end(), 0.0);
    int j = 0;
    for (const Sample& x : s) {  // s is sorted: the nearest level only moves right.
      while (j + 1 < k && std::fabs(l[j + 1] - x.u) <= std::fabs(l[j] - x.u)) ++j;
      sum[j] += static_cast<double>(x.w) * x.u;
      weight[j] += x.w;
    }
    for (int i = 1; i < k - 1; ++i) {
      if (weight[i] > 0.0) l[i] = static_cast<float>(sum[i] / weight[i]);
    }
    std::sort(l.begin(), l.end());
  }
  if (QuantError(s, l.data(), k) < uniform_error) std::copy(l.begin(), l.end(), levels);
}

}  // namespace

absl::StatusOr<Codebook> LearnCodebook(const StreamConfig& config, ConstTensorView keys,
                                       ConstTensorView values, int iterations) {
  KVQ_RETURN_IF_ERROR(config.Validate());
  if (!config.spec.is_kivi()) {
    return absl::InvalidArgumentError("codebooks apply only to kivi schemes");
  }
  KVQ_ASSIGN_OR_RETURN(PageLayout L,
                       PageLayout::Make(config.spec, config.head_dim, config.page_tokens));
  const int d = config.head_dim;
  const int n = keys.rows;
  if (keys.cols != d || values.cols != d || values.rows != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration keys and values must both be [n, head_dim=", d, "]"));
  }
  if (n < L.block_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration needs at least one group of ", L.block_tokens, " rows, got ", n));
  }
  Codebook cb;
  cb.bits = config.spec.bits;
  cb.head_dim = d;
  const int k = cb.levels();
  cb.key_levels.resize(static_cast<size_t>(d) * k);
  cb.value_levels.resize(static_cast<size_t>(d) * k);
  std::optional<HadamardRotation> rotation;
  if (config.spec.rotate) rotation.emplace(d, config.rotation_seed);
  for (Side side : {Side::kKey, Side::kValue}) {
    const ConstTensorView& t = side == Side::kKey ? keys : values;
    std::vector<float> x(static_cast<size_t>(n) * d);
    for (int r = 0; r < n; ++r) {
      RowToFloat(t.row(r), t.dtype, d, &x[static_cast<size_t>(r) * d]);
      for (int c = 0; c < d; ++c) {
        if (!std::isfinite(x[static_cast<size_t>(r) * d + c])) {
          return absl::InvalidArgumentError(absl::StrCat(
              side == Side::kKey ? "keys" : "values", "[", r, "][", c, "] is not finite"));
        }
      }
      if (rotation) rotation->Forward(&x[static_cast<size_t>(r) * d]);
    }
    auto samples = Normalise(x, n, d, L, L.side(side));
    std::vector<float>& out = side == Side::kKey ? cb.key_levels : cb.value_levels;
    for (int c = 0; c < d; ++c) KMeans1D(samples[c], k, iterations, &out[static_cast<size_t>(c) * k]);
  }
  return cb;
}

}  // namespace kvq
