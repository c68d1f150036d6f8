#include "bench/dot_rate.h"

#include "gtest/gtest.h"

namespace kvq {
namespace {

// llama's GQA group of 4 at head_dim 128: keys and values each take
// 2 bytes x 4 rows x 128 channels / 64 byte products per instruction.
TEST(DotRateTest, CountsTheKiviKernelsInstructionsPerToken) {
  EXPECT_DOUBLE_EQ(KiviDotsPerToken(4, 128), 32.0);
  EXPECT_DOUBLE_EQ(KiviDotsPerToken(4, 64), 16.0);
  EXPECT_DOUBLE_EQ(KiviDotsPerToken(1, 128), 8.0);
  EXPECT_DOUBLE_EQ(KiviDotsPerToken(8, 256), 128.0);
}

TEST(DotRateTest, MeasuresOnlyWhereTheCpuHasVnni) {
  const DotRate rate = MeasureDotRate(/*passes=*/2, /*threads=*/1);
  EXPECT_EQ(rate.threads, 1);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512vnni")) {
    ASSERT_EQ(rate.passes.size(), 2u);
    // Positive and finite, and not faster than a few instructions per
    // nanosecond: a folded loop would time nothing.
    EXPECT_GT(rate.seconds, 0.02e-9);
    EXPECT_LT(rate.seconds, 1e-6);
    return;
  }
#endif
  EXPECT_EQ(rate.seconds, 0.0);
  EXPECT_TRUE(rate.passes.empty());
}

}  // namespace
}  // namespace kvq
