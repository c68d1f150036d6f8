// The number formats of kernels/numeric.h as KVQ_HD functions: the same
// bits from the same arithmetic, on the device and on the host. The host
// definitions stay the truth; tests/unit/numeric_hd_test.cc checks every
// fp16, bf16 and fp8 pattern and a sweep of floats against them.
#ifndef KVQ_KERNELS_HD_NUMERIC_HD_H_
#define KVQ_KERNELS_HD_NUMERIC_HD_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/hd/hd.h"

namespace kvq::hd {

KVQ_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVQ_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// IEEE binary16, round to nearest even, overflow to infinity.
KVQ_HD uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {
    const float sub = BitsToFloat(abs) + 0.5f;
    return static_cast<uint16_t>(sign | (FloatBits(sub) - 0x3f000000u));
  }
  const uint32_t mant_odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xc8000fffu + mant_odd;
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

KVQ_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsToFloat(FloatBits(v) | sign);
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

KVQ_HD float RoundToHalf(float f) { return HalfToFloat(FloatToHalf(f)); }

// bfloat16, round to nearest even.
KVQ_HD uint16_t FloatToBf16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}
KVQ_HD float Bf16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// OCP FP8 E4M3 (bias 7, no infinities, 0x7f/0xff NaN), round to nearest
// even, saturating at +-448. The same steps as kernels/numeric.cc, written
// with exponent bits instead of frexp so the device needs no libm call.
KVQ_HD uint8_t FloatToFp8E4m3(float f) {
  const uint32_t x = FloatBits(f);
  const uint8_t sign = (x >> 31) ? 0x80 : 0x00;
  const uint32_t abs_bits = x & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return 0x7f;  // NaN.
  const float a = BitsToFloat(abs_bits);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0.015625f) {
    const float q = rintf(a * 512.0f);  // Units of 2^-9, round to nearest even.
    return sign | static_cast<uint8_t>(q);
  }
  // a = (1 + m/2^23) * 2^e with e in [-6, 8]; 3 mantissa bits, RNE.
  int e = static_cast<int>(abs_bits >> 23) - 127;
  const float frac = BitsToFloat((abs_bits & 0x007fffffu) | 0x3f800000u) - 1.0f;  // [0, 1).
  float scaled = rintf(frac * 8.0f);
  if (scaled >= 8.0f) {
    scaled = 0.0f;
    ++e;
  }
  const int biased = e + 7;
  if (biased > 15 || (biased == 15 && scaled > 6.0f)) return sign | 0x7e;
  return sign | static_cast<uint8_t>((biased << 3) | static_cast<int>(scaled));
}

KVQ_HD float Fp8E4m3ToFloat(uint8_t b) {
  const int exp = (b >> 3) & 0xf;
  const int mant = b & 0x7;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  if (exp == 15 && mant == 7) return BitsToFloat(0x7fc00000u);
  if (exp == 0) {  // mant * 2^-9, exact.
    return BitsToFloat(FloatBits(static_cast<float>(mant) * 0.001953125f) | sign);
  }
  return BitsToFloat(sign | (static_cast<uint32_t>(exp + 120) << 23) |
                     (static_cast<uint32_t>(mant) << 20));
}

}  // namespace kvq::hd

#endif  // KVQ_KERNELS_HD_NUMERIC_HD_H_
