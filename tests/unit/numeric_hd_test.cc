// The KVQ_HD number formats (kernels/cuda/numeric_hd.h) give the bits of
// kernels/numeric.h for every pattern and a sweep of floats.
#include "kernels/cuda/numeric_hd.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

// Equal bits, or both NaN (NaN payloads are not part of either contract).
bool SameFloat(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return FloatBits(a) == FloatBits(b);
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
      v.push_back(BitsToFloat((hi << 16) | lo));
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
                          HalfToFloat(static_cast<uint16_t>(h))))
        << "half 0x" << std::hex << h;
  }
}

TEST(NumericHdTest, Bf16DecodesEveryPatternLikeTheHost) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    ASSERT_TRUE(SameFloat(hd::Bf16ToFloat(static_cast<uint16_t>(b)),
                          Bf16ToFloat(static_cast<uint16_t>(b))))
        << "bf16 0x" << std::hex << b;
  }
}

TEST(NumericHdTest, Fp8DecodesEveryPatternLikeTheHost) {
  for (uint32_t b = 0; b < 0x100; ++b) {
    ASSERT_TRUE(SameFloat(hd::Fp8E4m3ToFloat(static_cast<uint8_t>(b)),
                          Fp8E4m3ToFloat(static_cast<uint8_t>(b))))
        << "fp8 0x" << std::hex << b;
  }
}

TEST(NumericHdTest, EncodersRoundEveryFloatLikeTheHost) {
  for (float f : FloatSweep()) {
    ASSERT_EQ(hd::FloatToHalf(f), FloatToHalf(f)) << f;
    ASSERT_EQ(hd::FloatToBf16(f), FloatToBf16(f)) << f;
    ASSERT_EQ(hd::FloatToFp8E4m3(f), FloatToFp8E4m3(f)) << f << " bits 0x" << std::hex
                                                         << FloatBits(f);
  }
}

}  // namespace
}  // namespace kvq
