// The KVQ_HD number formats (kernels/hd/numeric_hd.h, which
// kernels/numeric.h uses as its own) against independent, obviously right
// definitions written the long way here: libm's frexp/ldexp and rounding
// for fp8, and the IEEE value formulas for the 16-bit decoders. Every
// pattern of each narrow format and a sweep of floats.
#include "kernels/hd/numeric_hd.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace kvq {
namespace {

// OCP FP8 E4M3 by the value formula: frexp, a 3-bit mantissa rounded to
// nearest even, subnormals in units of 2^-9, saturation at 448.
uint8_t Fp8Reference(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return 0x7f;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  int exp;
  const float m = std::frexp(a, &exp);  // a = m * 2^exp, m in [0.5, 1).
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

float Fp8ValueReference(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf;
  const int mant = b & 0x7;
  if (exp == 15 && mant == 7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(1.0f + mant / 8.0f, exp - 7);
}

// binary16 and bfloat16 by the value formulas.
float HalfValueReference(uint16_t h) {
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 31) return mant ? std::nanf("") : sign * std::numeric_limits<float>::infinity();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -24);
  return sign * std::ldexp(1.0f + mant / 1024.0f, exp - 15);
}
float Bf16ValueReference(uint16_t b) {
  const float sign = (b & 0x8000) ? -1.0f : 1.0f;
  const int exp = (b >> 7) & 0xff;
  const int mant = b & 0x7f;
  if (exp == 255) return mant ? std::nanf("") : sign * std::numeric_limits<float>::infinity();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -133);
  return sign * std::ldexp(1.0f + mant / 128.0f, exp - 127);
}

// The nearest of the format's values to f (ties to the even pattern), by
// search over the decoded values: the encoders' contract, stated directly.
// Finite, non-overflowing inputs only.
uint16_t NearestHalfReference(float f) {
  uint16_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  for (uint32_t m = 0; m < 0x7c00; ++m) {
    const double d = std::fabs(static_cast<double>(std::fabs(f)) - HalfValueReference(m));
    if (d < best_d || (d == best_d && (m & 1) == 0)) {
      best_d = d;
      best = static_cast<uint16_t>(m);
    }
  }
  return sign | best;
}

// Equal bits, or both NaN (NaN payloads are not part of either contract).
bool SameFloat(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return hd::FloatBits(a) == hd::FloatBits(b);
}

std::vector<float> FloatSweep() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, 448.0f,
                          464.0f, 0.015625f, 0.0078125f, 5.96e-8f, 2.98e-8f, 1e-30f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::max()};
  // Every float whose high 16 bits take each value, with a few low halves:
  // covers every exponent and every rounding boundary of the narrow formats.
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0fffu, 0x1000u, 0x1001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      v.push_back(hd::BitsToFloat((hi << 16) | lo));
    }
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 100.0f);
  for (int i = 0; i < 100000; ++i) v.push_back(n(rng));
  return v;
}

TEST(NumericHdTest, HalfDecodesEveryPatternLikeTheHost) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    ASSERT_TRUE(SameFloat(hd::HalfToFloat(static_cast<uint16_t>(h)),
                          HalfValueReference(static_cast<uint16_t>(h))))
        << "half 0x" << std::hex << h;
  }
}

TEST(NumericHdTest, Bf16DecodesEveryPatternLikeTheHost) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    ASSERT_TRUE(SameFloat(hd::Bf16ToFloat(static_cast<uint16_t>(b)),
                          Bf16ValueReference(static_cast<uint16_t>(b))))
        << "bf16 0x" << std::hex << b;
  }
}

TEST(NumericHdTest, Fp8DecodesEveryPatternLikeTheHost) {
  for (uint32_t b = 0; b < 0x100; ++b) {
    ASSERT_TRUE(SameFloat(hd::Fp8E4m3ToFloat(static_cast<uint8_t>(b)),
                          Fp8ValueReference(static_cast<uint8_t>(b))))
        << "fp8 0x" << std::hex << b;
  }
}

TEST(NumericHdTest, Fp8EncoderRoundsEveryFloatLikeTheValueFormula) {
  for (float f : FloatSweep()) {
    ASSERT_EQ(hd::FloatToFp8E4m3(f), Fp8Reference(f)) << f << " bits 0x" << std::hex
                                                      << hd::FloatBits(f);
  }
}

// The 16-bit encoders against the nearest representable value, on a
// sample of the sweep (the search costs 31744 decodes per input).
TEST(NumericHdTest, HalfEncoderPicksTheNearestValue) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> mag(-20.0f, 16.0f);
  for (int i = 0; i < 3000; ++i) {
    const float f = std::ldexp(1.0f + i / 3000.0f, static_cast<int>(mag(rng))) * (i % 2 ? -1 : 1);
    if (std::fabs(f) >= 65504.0f) continue;
    ASSERT_EQ(hd::FloatToHalf(f), NearestHalfReference(f)) << f;
  }
  // Exact ties round to the even pattern: 1 + 2^-11 lies between 1 and the
  // next half up.
  EXPECT_EQ(hd::FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(hd::FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(hd::FloatToHalf(65520.0f), 0x7c00);  // Overflow to infinity.
}

TEST(NumericHdTest, Bf16EncoderRoundsToNearestEven) {
  for (float f : FloatSweep()) {
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(hd::Bf16ToFloat(hd::FloatToBf16(f))));
      continue;
    }
    const uint16_t b = hd::FloatToBf16(f);
    const float got = hd::Bf16ToFloat(b);
    if (std::isinf(f)) {
      ASSERT_EQ(got, f);
      continue;
    }
    if (std::isinf(got) && !std::isinf(f)) continue;  // Rounded past the largest finite.
    // No other bf16 value is nearer: the neighbours on both sides are not.
    const double err = std::fabs(static_cast<double>(got) - f);
    for (int step : {-1, 1}) {
      const float other = hd::Bf16ToFloat(static_cast<uint16_t>(b + step));
      if (std::isnan(other) || std::isinf(other)) continue;
      if (std::signbit(other) != std::signbit(got) && got != 0.0f) continue;
      const double other_err = std::fabs(static_cast<double>(other) - f);
      ASSERT_TRUE(err < other_err || (err == other_err && (b & 1) == 0))
          << f << " -> 0x" << std::hex << b;
    }
  }
}

}  // namespace
}  // namespace kvq
