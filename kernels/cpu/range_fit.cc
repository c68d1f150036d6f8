#include "kernels/cpu/range_fit.h"

#include <algorithm>
#include <cmath>

#include "kernels/numeric.h"

namespace kvq {

float UniformSquaredError(const float* x, int n, int bits, float lo, float hi) {
  const float top = static_cast<float>((1 << bits) - 1);
  const float scale = (hi - lo) / top;
  // The codes by a multiply (the search's estimate; the stored codes divide).
  const float inv_scale = scale > 0.0f ? 1.0f / scale : 0.0f;
  float sse = 0.0f;
  for (int i = 0; i < n; ++i) {
    float q = std::nearbyint((x[i] - lo) * inv_scale);
    q = std::min(std::max(q, 0.0f), top);
    const float e = (lo + scale * q) - x[i];
    sse = sse + e * e;
  }
  return sse;
}

FittedRange FitUniformRange(const float* x, int n, int bits, float min, float max) {
  FittedRange best{min, max};
  if (!(max > min) || n < 2) return best;
  const float top = static_cast<float>((1 << bits) - 1);
  const float count = static_cast<float>(n);
  const float range = max - min;
  float best_sse = UniformSquaredError(x, n, bits, min, max);
  float sx = 0.0f;
  for (int j = 0; j < n; ++j) sx = sx + x[j];
  for (int i = -kFitSteps; i <= kFitSteps; ++i) {
    const float inv_step = (top * FitStepFactor(i)) / range;
    // Codes for this step, then the least-squares line through them. The
    // code sums are integers below 2^24, so sl, sl2 and det are exact.
    float sl = 0.0f, sl2 = 0.0f, slx = 0.0f;
    for (int j = 0; j < n; ++j) {
      const float l = std::min(std::max(std::nearbyint((x[j] - min) * inv_step), 0.0f), top);
      sl = sl + l;
      sl2 = sl2 + l * l;
      slx = slx + l * x[j];
    }
    const float det = count * sl2 - sl * sl;
    if (!(det > 0.0f)) continue;
    const float scale = (count * slx - sl * sx) / det;
    const float zero = (sl2 * sx - sl * slx) / det;
    if (!(scale > 0.0f)) continue;
    const float hi = zero + scale * top;
    // The least squares may widen the range; it must stay storable in fp16.
    if (!(zero >= -kFp16Max && hi <= kFp16Max)) continue;
    const float sse = UniformSquaredError(x, n, bits, zero, hi);
    if (sse < best_sse) {
      best_sse = sse;
      best = {zero, hi};
    }
  }
  return best;
}

}  // namespace kvq
