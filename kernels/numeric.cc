#include "kernels/numeric.h"

#include <cmath>

namespace kvq {

uint8_t FloatToFp8E4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return 0x7f;
  float a = std::fabs(f);
  if (a >= kFp8E4m3Max) return sign | 0x7e;  // Saturate to 448.
  // Smallest normal is 2^-6; subnormals step by 2^-9.
  if (a < 0.015625f) {
    const float q = std::nearbyint(a * 512.0f);  // Units of 2^-9, RNE.
    return sign | static_cast<uint8_t>(q);        // q == 8 is the smallest normal.
  }
  int exp;
  const float m = std::frexp(a, &exp);  // a = m * 2^exp, m in [0.5, 1).
  // Mantissa with 3 explicit bits: a = (1 + k/8) * 2^(exp-1).
  float scaled = std::nearbyint((m * 2.0f - 1.0f) * 8.0f);
  int e = exp - 1;
  if (scaled >= 8.0f) {
    scaled = 0.0f;
    ++e;
  }
  const int biased = e + 7;
  if (biased > 15 || (biased == 15 && scaled > 6.0f)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((biased << 3) | static_cast<int>(scaled));
}

float Fp8E4m3ToFloat(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf;
  const int mant = b & 0x7;
  if (exp == 15 && mant == 7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(1.0f + mant / 8.0f, exp - 7);
}

}  // namespace kvq
