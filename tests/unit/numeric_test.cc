#include "kernels/numeric.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/tensor.h"

namespace kvq {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// --- fp16 ---

TEST(NumericTest, HalfKnownBitPatterns) {
  struct Case {
    float f;
    uint16_t h;
  };
  for (const Case& c : {
           Case{0.0f, 0x0000}, Case{-0.0f, 0x8000}, Case{1.0f, 0x3c00}, Case{-2.0f, 0xc000},
           Case{0.5f, 0x3800}, Case{65504.0f, 0x7bff}, Case{-65504.0f, 0xfbff},
           Case{0.099975586f, 0x2e66},           // fp16(0.1) exactly.
           Case{6.103515625e-05f, 0x0400},       // Smallest normal 2^-14.
           Case{5.9604644775390625e-08f, 0x0001},  // Smallest subnormal 2^-24.
           Case{6.0975551605224609e-05f, 0x03ff},  // Largest subnormal 1023 * 2^-24.
           Case{kInf, 0x7c00}, Case{-kInf, 0xfc00},
       }) {
    EXPECT_EQ(FloatToHalf(c.f), c.h) << "FloatToHalf(" << c.f << ")";
    EXPECT_EQ(FloatBits(HalfToFloat(c.h)), FloatBits(c.f)) << "HalfToFloat(0x" << std::hex << c.h << ")";
  }
  EXPECT_EQ(FloatToHalf(0.1f), 0x2e66) << "0.1 rounds to 0x2e66";
}

TEST(NumericTest, HalfRoundsToNearestEven) {
  // Halfway between 1 and 1 + 2^-10: ties to the even mantissa (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // Halfway between 1 + 2^-10 (odd) and 1 + 2^-9 (even): rounds up.
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Just above the halfway point rounds up.
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // 65519 rounds down to 65504; 65520 (halfway to 65536) rounds to even: infinity.
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00) << "overflow to infinity";
  EXPECT_EQ(FloatToHalf(-1e6f), 0xfc00) << "overflow to -infinity";
  // Subnormal ties: 2^-25 is halfway between 0 and 2^-24 -> 0 (even).
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)), 0x0002) << "1.5 units -> 2 (even)";
  EXPECT_EQ(FloatToHalf(5 * std::ldexp(1.0f, -25)), 0x0002) << "2.5 units -> 2 (even)";
  EXPECT_EQ(FloatToHalf(-3 * std::ldexp(1.0f, -25)), 0x8002);
  // Below half the smallest subnormal flushes to a signed zero.
  EXPECT_EQ(FloatToHalf(1e-10f), 0x0000);
  EXPECT_EQ(FloatToHalf(-1e-10f), 0x8000);
  // The largest subnormal rounds up into the smallest normal.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)), 0x0400);
}

TEST(NumericTest, HalfNaN) {
  const uint16_t h = FloatToHalf(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(h & 0x7c00, 0x7c00) << "NaN keeps an all-ones exponent";
  EXPECT_NE(h & 0x03ff, 0) << "NaN keeps a non-zero mantissa (not infinity)";
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0xfc01)));
  // A signalling NaN whose payload lives only in the low float bits stays NaN.
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(BitsToFloat(0x7f800001u)))));
}

TEST(NumericTest, EveryHalfRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), h) << "half 0x" << std::hex << h << " -> " << f;
  }
}

#if defined(__FLT16_MAX__)
// The compiler's _Float16 conversion is an independent IEEE implementation.
TEST(NumericTest, HalfMatchesCompilerConversionOnRandomFloats) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2'000'000; ++i) {
    uint32_t bits = rng();
    // Concentrate on the fp16 range (exponents 2^-26 .. 2^17) half of the time.
    if (i & 1) bits = (bits & 0x807fffffu) | ((101u + rng() % 44u) << 23);
    const float f = BitsToFloat(bits);
    if (std::isnan(f)) continue;
    const uint16_t expected = std::bit_cast<uint16_t>(static_cast<_Float16>(f));
    ASSERT_EQ(FloatToHalf(f), expected) << "float bits 0x" << std::hex << bits;
  }
}
#endif

// --- bf16 ---

TEST(NumericTest, Bf16KnownBitPatternsAndRounding) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(kInf), 0x7f80);
  EXPECT_EQ(FloatToBf16(3.0e38f), 0x7f62);
  // Ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(FloatToBf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  // Rounding past the largest finite bf16 overflows to infinity.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatBits(kBf16Max), 0x7f7f0000u) << "kBf16Max is the largest finite bf16";
  EXPECT_EQ(FloatToBf16(kBf16Max), 0x7f7f);
  // Subnormal floats keep their top bits.
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x00010000u)), 0x0001);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0x4049), 3.140625f);
}

TEST(NumericTest, Bf16NaNStaysNaN) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload is only in the low 16 bits must not become infinity.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(BitsToFloat(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(BitsToFloat(0xffff0001u)))));
}

TEST(NumericTest, EveryBf16RoundTrips) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), b) << "bf16 0x" << std::hex << b;
  }
}

// --- fp8 e4m3 ---

TEST(NumericTest, Fp8KnownBitPatterns) {
  struct Case {
    float f;
    uint8_t b;
  };
  for (const Case& c : {Case{0.0f, 0x00}, Case{-0.0f, 0x80}, Case{1.0f, 0x38}, Case{-1.0f, 0xb8},
                        Case{2.0f, 0x40}, Case{1.125f, 0x39}, Case{448.0f, 0x7e},
                        Case{-448.0f, 0xfe}, Case{0.015625f, 0x08},   // Smallest normal 2^-6.
                        Case{0.001953125f, 0x01},                      // Smallest subnormal 2^-9.
                        Case{0.013671875f, 0x07},                      // Largest subnormal 7 * 2^-9.
                        Case{240.0f, 0x77}, Case{256.0f, 0x78}}) {
    EXPECT_EQ(FloatToFp8E4m3(c.f), c.b) << "FloatToFp8E4m3(" << c.f << ")";
    EXPECT_EQ(FloatBits(Fp8E4m3ToFloat(c.b)), FloatBits(c.f))
        << "Fp8E4m3ToFloat(0x" << std::hex << int{c.b} << ")";
  }
}

TEST(NumericTest, Fp8SaturatesAtPlusMinus448) {
  for (float f : {449.0f, 464.0f, 480.0f, 500.0f, 1e6f, 65504.0f, kInf}) {
    EXPECT_EQ(FloatToFp8E4m3(f), 0x7e) << f << " saturates to 448";
    EXPECT_EQ(FloatToFp8E4m3(-f), 0xfe) << -f << " saturates to -448";
  }
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(FloatToFp8E4m3(432.0f), 0x7e) << "432 is halfway 416..448, ties to even (448)";
  EXPECT_EQ(FloatToFp8E4m3(420.0f), 0x7d) << "420 rounds to 416";
}

TEST(NumericTest, Fp8RoundsToNearestEven) {
  EXPECT_EQ(FloatToFp8E4m3(1.0625f), 0x38) << "1 + 1/16: tie between 1 and 1.125 -> 1";
  EXPECT_EQ(FloatToFp8E4m3(1.1875f), 0x3a) << "1 + 3/16: tie between 1.125 and 1.25 -> 1.25";
  EXPECT_EQ(FloatToFp8E4m3(1.07f), 0x39) << "just above a tie rounds up";
  EXPECT_EQ(FloatToFp8E4m3(1.9375f), 0x40) << "1 + 15/16 rounds to even 2.0 (exponent carry)";
  // Subnormals: steps of 2^-9, ties to even.
  EXPECT_EQ(FloatToFp8E4m3(std::ldexp(1.0f, -10)), 0x00) << "half a step -> 0";
  EXPECT_EQ(FloatToFp8E4m3(3 * std::ldexp(1.0f, -10)), 0x02) << "1.5 steps -> 2";
  EXPECT_EQ(FloatToFp8E4m3(-5 * std::ldexp(1.0f, -10)), 0x82) << "-2.5 steps -> -2";
  EXPECT_EQ(FloatToFp8E4m3(15 * std::ldexp(1.0f, -10)), 0x08)
      << "7.5 steps rounds into the smallest normal";
}

TEST(NumericTest, Fp8NaN) {
  EXPECT_EQ(FloatToFp8E4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0xff)));
}

// Every finite fp8 value round trips, and random floats go to the nearest
// fp8 value (ties to the even code) by exhaustive search.
TEST(NumericTest, Fp8MatchesExhaustiveNearest) {
  std::vector<float> values;
  std::vector<uint8_t> codes;
  for (int b = 0; b < 256; ++b) {
    const float f = Fp8E4m3ToFloat(static_cast<uint8_t>(b));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToFp8E4m3(f), b) << "fp8 0x" << std::hex << b << " round trip";
    if ((b & 0x80) == 0) {
      values.push_back(f);
      codes.push_back(static_cast<uint8_t>(b));
    }
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> exponent(-12.0f, 9.5f);
  for (int i = 0; i < 200'000; ++i) {
    const float a = std::exp2(exponent(rng));
    int best = 0;
    for (size_t j = 1; j < values.size(); ++j) {
      const float dj = std::fabs(values[j] - a), db = std::fabs(values[best] - a);
      if (dj < db || (dj == db && (codes[j] & 1) == 0)) best = static_cast<int>(j);
    }
    ASSERT_EQ(FloatToFp8E4m3(a), codes[best]) << "a = " << a;
    ASSERT_EQ(FloatToFp8E4m3(-a), codes[best] | 0x80) << "a = " << -a;
  }
}

// --- Row conversions ---

TEST(NumericTest, RowConversionsRoundTrip) {
  const std::vector<float> src = {1.0f, -0.1f, 65504.0f, 3.0e-6f, 0.0f, 1.0f + std::ldexp(1.0f, -11)};
  std::vector<uint16_t> h(src.size()), b(src.size());
  FloatToRow(src.data(), static_cast<int>(src.size()), DType::kFloat16, h.data());
  FloatToRow(src.data(), static_cast<int>(src.size()), DType::kBFloat16, b.data());
  std::vector<float> back_h(src.size()), back_b(src.size());
  RowToFloat(h.data(), DType::kFloat16, static_cast<int>(src.size()), back_h.data());
  RowToFloat(b.data(), DType::kBFloat16, static_cast<int>(src.size()), back_b.data());
  for (size_t i = 0; i < src.size(); ++i) {
    EXPECT_EQ(h[i], FloatToHalf(src[i])) << i;
    EXPECT_EQ(b[i], FloatToBf16(src[i])) << i;
    EXPECT_EQ(back_h[i], RoundToHalf(src[i])) << i;
    EXPECT_EQ(back_b[i], Bf16ToFloat(FloatToBf16(src[i]))) << i;
  }
}

TEST(NumericTest, DTypeNames) {
  EXPECT_EQ(DTypeName(DType::kFloat32), "fp32");
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("fp16"), DType::kFloat16);
  const absl::StatusOr<DType> bad = ParseDType("fp64");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "dtype \"fp64\" is not one of fp32, fp16, bf16");
}

}  // namespace
}  // namespace kvq
