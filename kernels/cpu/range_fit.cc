#include "kernels/cpu/range_fit.h"

#include <algorithm>
#include <cmath>

namespace kvq {
namespace {

// Candidate steps: top / (max - min) times (1 + kSpread * i / kSteps) for
// i in [-kSteps, kSteps], i.e. codes stretched up to a step beyond either
// end (clipping) or shrunk (the least squares then widens the range).
constexpr int kSteps = 10;
constexpr double kSpread = 0.125;

}  // namespace

double UniformSquaredError(const float* x, int n, int bits, double lo, double hi) {
  const double top = (1 << bits) - 1;
  const double scale = (hi - lo) / top;
  double sse = 0.0;
  for (int i = 0; i < n; ++i) {
    double q = scale > 0.0 ? std::nearbyint((x[i] - lo) / scale) : 0.0;
    q = std::clamp(q, 0.0, top);
    const double e = lo + scale * q - x[i];
    sse += e * e;
  }
  return sse;
}

FittedRange FitUniformRange(const float* x, int n, int bits, float min, float max) {
  FittedRange best{min, max};
  if (!(max > min) || n < 2) return best;
  const double top = (1 << bits) - 1;
  double best_sse = UniformSquaredError(x, n, bits, min, max);
  const double range = static_cast<double>(max) - min;
  for (int i = -kSteps; i <= kSteps; ++i) {
    const double inv_step = top * (1.0 + kSpread * i / kSteps) / range;
    // Codes for this step, then the least-squares line through them.
    double sl = 0.0, sl2 = 0.0, sx = 0.0, slx = 0.0;
    for (int j = 0; j < n; ++j) {
      const double l = std::clamp(std::nearbyint((x[j] - min) * inv_step), 0.0, top);
      sl += l;
      sl2 += l * l;
      sx += x[j];
      slx += l * x[j];
    }
    const double det = n * sl2 - sl * sl;
    if (!(det > 0.0)) continue;
    const double scale = (n * slx - sl * sx) / det;
    const double zero = (sl2 * sx - sl * slx) / det;
    if (!(scale > 0.0)) continue;
    const double lo = zero;
    const double hi = zero + scale * top;
    const double sse = UniformSquaredError(x, n, bits, lo, hi);
    if (sse < best_sse) {
      best_sse = sse;
      best = {static_cast<float>(lo), static_cast<float>(hi)};
    }
  }
  return best;
}

}  // namespace kvq
