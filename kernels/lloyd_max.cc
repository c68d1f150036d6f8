#include "kernels/lloyd_max.h"

#include <cmath>
#include <cstdlib>
#include <limits>

namespace kvq {
namespace {

constexpr int kIterations = 2000;

double Density(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI); }
double Cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

LloydMaxCodebook Compute(int bits) {
  const int n = 1 << bits;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> c(n), b(n + 1);
  for (int i = 0; i < n; ++i) c[i] = -3.0 + 6.0 * (i + 0.5) / n;
  auto boundaries = [&] {
    b[0] = -inf;
    b[n] = inf;
    for (int i = 1; i < n; ++i) b[i] = 0.5 * (c[i - 1] + c[i]);
  };
  for (int it = 0; it < kIterations; ++it) {
    boundaries();
    // Each level moves to the mean of N(0, 1) over its cell:
    // (phi(lo) - phi(hi)) / (Phi(hi) - Phi(lo)).
    for (int i = 0; i < n; ++i) {
      c[i] = (Density(b[i]) - Density(b[i + 1])) / (Cdf(b[i + 1]) - Cdf(b[i]));
    }
  }
  boundaries();
  LloydMaxCodebook cb;
  cb.bits = bits;
  // With levels at their cells' means, MSE = 1 - sum p_i c_i^2.
  double kept = 0.0;
  for (int i = 0; i < n; ++i) {
    kept += (Cdf(b[i + 1]) - Cdf(b[i])) * c[i] * c[i];
  }
  cb.mse = 1.0 - kept;
  // Symmetrize exactly (the iteration is symmetric up to rounding).
  for (int i = 0; i < n; ++i) {
    cb.levels.push_back(static_cast<float>(0.5 * (c[i] - c[n - 1 - i])));
  }
  for (int i = 1; i < n; ++i) {
    cb.thresholds.push_back(0.5f * (cb.levels[i - 1] + cb.levels[i]));
  }
  return cb;
}

}  // namespace

const LloydMaxCodebook& LloydMax(int bits) {
  if (bits < 1 || bits > 4) std::abort();  // A caller's bug: widths are validated specs.
  static const LloydMaxCodebook* books = [] {
    auto* b = new LloydMaxCodebook[4];
    for (int i = 0; i < 4; ++i) b[i] = Compute(i + 1);
    return b;
  }();
  return books[bits - 1];
}

}  // namespace kvq
