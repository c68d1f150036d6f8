// The `fit` option's range search: the [lo, hi] of a uniform group chosen to
// minimise the group's squared rounding error instead of spanning min..max.
//
// With min/max a single far element widens the step of all the others; at 2
// and 3 bits (3 and 7 steps) that costs more than clipping it. The search is
// llama.cpp's k-quant idea (make_qkx2_quants), unweighted: for a sweep of
// candidate steps around (max - min) / top, assign codes, solve the least
// squares line x ~ zero + scale * code for those codes, and keep the
// candidate whose re-quantized error is lowest; min/max itself is a
// candidate, so the fit is never worse by that measure. Elements outside the
// returned range clip to the first or last code.
//
// Only key groups are fitted. Keys are grouped per channel over tokens,
// where the far element is a rare token; values per token over channels,
// where it is an outlier channel that every token shares, and clipping it
// biases every output: on SmolLM2-135M fitting the values raised perplexity
// at 3 bits (docs/QUALITY.md), fitting the keys cut the 2-bit loss by
// about 40%.
//
// Float arithmetic in a fixed order (elements in group order, no fused
// multiply-add), so the SIMD append's version, which fits a vector of
// channels of a key block at once (one per lane, op for op), writes the
// reference's bytes.
#ifndef KVQ_KERNELS_CPU_RANGE_FIT_H_
#define KVQ_KERNELS_CPU_RANGE_FIT_H_

#include "kernels/page_layout.h"
#include "kernels/quant_spec.h"

namespace kvq {

// Whether the groups of `side` get fitted ranges under `spec`.
inline bool FitsRanges(const QuantSpec& spec, Side side) {
  return spec.fit && side == Side::kKey;
}

struct FittedRange {
  float lo = 0.0f;
  float hi = 0.0f;
};

// The candidate steps: top / (max - min) times FitStepFactor(i) for i in
// [-kFitSteps, kFitSteps], from codes stretched an eighth beyond either end
// (clipping) to codes shrunk by as much (the least squares then widens the
// range).
inline constexpr int kFitSteps = 10;
inline float FitStepFactor(int i) {
  return static_cast<float>(1.0 + 0.125 * i / kFitSteps);
}

// x: the group's n elements (sparse outliers already left out), n >= 1;
// min / max: their extremes; bits: 2, 3 or 4. Returns the range whose
// uniform codes (2^bits - 1 steps from lo to hi) give the lowest sum of
// squared errors among the candidates, min/max first; a candidate reaching
// beyond the fp16 range (where the parameters are stored) is skipped.
FittedRange FitUniformRange(const float* x, int n, int bits, float min, float max);

// Sum of squared errors of quantizing x[0..n) to 2^bits levels over
// [lo, hi] with round-to-nearest and clipping (as UniformCode).
float UniformSquaredError(const float* x, int n, int bits, float lo, float hi);

}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_RANGE_FIT_H_
