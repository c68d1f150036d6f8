// Scalar quantization math shared by the reference kernels, the codebook
// learner and the SIMD kernels' parameter setup. One definition of how a
// group's scale, zero point and codes are chosen.
#ifndef KVQ_KERNELS_CPU_QUANT_MATH_H_
#define KVQ_KERNELS_CPU_QUANT_MATH_H_

#include <cmath>
#include <cstdint>

#include "kernels/numeric.h"

namespace kvq {

// Scale and zero point of an asymmetric group, as stored (fp16-rounded).
// Uniform: x ~ zero + scale * code.  nuq: x ~ zero + scale * level[code],
// levels in [0, 1], so scale is the whole range.
struct GroupParams {
  float scale = 0.0f;
  float zero = 0.0f;
};

inline GroupParams MakeGroupParams(float min, float max, int bits, bool nuq) {
  const float range = max - min;
  const float scale = nuq ? range : range / static_cast<float>((1 << bits) - 1);
  return {RoundToHalf(scale), RoundToHalf(min)};
}

// Uniform code of x: round((x - zero) * (1 / scale)), to nearest even,
// clamped to [0, 2^bits - 1]. The reciprocal is rounded once, then the
// product: that is how every quantizer forms the quotient (a division per
// element bounded the SIMD append), and with the same two roundings here
// their codes equal these bit for bit. It differs from a rounded division
// only for quotients within about 2^-20 of a half-integer.
inline uint8_t UniformCode(float x, const GroupParams& p, int bits) {
  if (p.scale == 0.0f) return 0;
  const float inv = 1.0f / p.scale;
  const float q = std::nearbyint((x - p.zero) * inv);
  const float top = static_cast<float>((1 << bits) - 1);
  return static_cast<uint8_t>(q < 0.0f ? 0.0f : (q > top ? top : q));
}

// Nearest of `n` sorted levels to the normalised x (ties to the lower).
inline uint8_t NearestLevel(float x, const GroupParams& p, const float* levels, int n) {
  const float u = p.scale == 0.0f ? 0.0f : (x - p.zero) / p.scale;
  int best = 0;
  float best_d = std::fabs(u - levels[0]);
  for (int i = 1; i < n; ++i) {
    const float d = std::fabs(u - levels[i]);
    if (d < best_d) {
      best_d = d;
      best = i;
    }
  }
  return static_cast<uint8_t>(best);
}

}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_QUANT_MATH_H_
