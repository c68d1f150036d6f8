// Scalar conversions between float and the narrow storage types kvq uses.
// These are the reference definitions: SIMD paths must round the same way
// (round to nearest even) so that the typed tests can compare bit for bit.
#ifndef KVQ_KERNELS_NUMERIC_H_
#define KVQ_KERNELS_NUMERIC_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvq {

// Largest finite IEEE half: inputs beyond it cannot be stored in fp16 pages.
inline constexpr float kFp16Max = 65504.0f;
// Largest finite bfloat16 (0x7f7f); floats beyond it round to infinity.
inline constexpr float kBf16Max = 3.38953139e38f;
// Largest finite OCP FP8 E4M3 ("fn") value.
inline constexpr float kFp8E4m3Max = 448.0f;

// Element i of a 16-bit row that need not be 2-byte aligned: a tensor
// inside a serialized message starts wherever its header ends. memcpy is
// the defined access (a plain load or store once optimized); indexing a
// misaligned uint16_t* is undefined behaviour, and the sanitizer build
// stops on it.
inline uint16_t Load16(const void* row, size_t i) {
  uint16_t x;
  std::memcpy(&x, static_cast<const unsigned char*>(row) + 2 * i, 2);
  return x;
}
inline void Store16(void* row, size_t i, uint16_t x) {
  std::memcpy(static_cast<unsigned char*>(row) + 2 * i, &x, 2);
}

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// IEEE binary16, round to nearest even, overflow to infinity.
inline uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // Inf or NaN.
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // Overflow.
  if (abs < 0x38800000u) {  // Subnormal half or zero.
    // Add 0.5 (as float) so the FPU does the rounding of the shifted mantissa.
    const float sub = BitsToFloat(abs) + 0.5f;
    return static_cast<uint16_t>(sign | (FloatBits(sub) - 0x3f000000u));
  }
  const uint32_t mant_odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xc8000fffu + mant_odd;  // Rebias and round.
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // Zero or subnormal: mant * 2^-24.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return BitsToFloat(FloatBits(v) | sign);
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// bfloat16, round to nearest even.
inline uint16_t FloatToBf16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}
inline float Bf16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// OCP FP8 E4M3 (bias 7, no infinities, 0x7f/0xff are NaN), round to nearest
// even, saturating at +-448.
uint8_t FloatToFp8E4m3(float f);
float Fp8E4m3ToFloat(uint8_t b);

// Rounds through fp16 and back: the value a half-precision field holds.
inline float RoundToHalf(float f) { return HalfToFloat(FloatToHalf(f)); }

}  // namespace kvq

#endif  // KVQ_KERNELS_NUMERIC_H_
