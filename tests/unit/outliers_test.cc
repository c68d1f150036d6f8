// SelectOutliers (SIMD sorting networks + selection) against
// SelectOutliersRef (scalar nth_element + partial_sort): the same indices in
// the same order, for both group axes, every group size the networks take
// and sizes they do not, with heavy-tailed values, duplicates and ties.
#include "kernels/cpu/outliers.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/simd_outliers.h"

namespace kvq {
namespace {

SideLayout Side(bool per_channel, int group_channels) {
  SideLayout s;
  s.format = CodeFormat::kPacked;
  s.axis = per_channel ? ParamAxis::kChannelGroups : ParamAxis::kTokenGroups;
  s.group_channels = per_channel ? 0 : group_channels;
  return s;
}

// Student-t-like values with outlier channels and tokens; `levels` > 0 rounds
// them onto a few values so that medians, deviations and scores tie.
std::vector<float> Block(int rows, int d, uint32_t seed, int levels) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.1f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows) * d);
  for (int t = 0; t < rows; ++t) {
    for (int c = 0; c < d; ++c) {
      float v = normal(rng) / std::sqrt(unit(rng));
      if (c % 16 == 3) v = 8.0f + 0.5f * v;  // A stable outlier channel.
      if (t == rows / 3) v *= 20.0f;          // An outlier token.
      if (levels > 0) v = std::round(v * levels) / levels;
      x[static_cast<size_t>(t) * d + c] = v;
    }
  }
  return x;
}

TEST(OutliersTest, SimdSelectionMatchesTheReference) {
  int compared = 0;
  for (bool per_channel : {true, false}) {
    for (int rows : {16, 32, 64, 128, 24}) {
      for (int d : {64, 128}) {
        for (int gc : {16, 32, 64, 24}) {
          if (per_channel && gc != 32) continue;  // Not used by per-channel sides.
          if (!per_channel && d % gc != 0) continue;
          for (int levels : {0, 2}) {
            const std::vector<float> x = Block(rows, d, 1000 * rows + d + gc + levels, levels);
            const SideLayout side = Side(per_channel, gc);
            for (int k : {1, rows * d / 100, 37, rows * d - 3}) {
              SCOPED_TRACE(absl::StrCat(per_channel ? "per-channel" : "per-token", " rows ", rows,
                                        " d ", d, " gc ", gc, " levels ", levels, " k ", k));
              EXPECT_EQ(SelectOutliers(x.data(), rows, d, side, k),
                        SelectOutliersRef(x.data(), rows, d, side, k));
              ++compared;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(compared, 100);
}

// The SIMD scorer takes power-of-two groups of 2..256 values and declines
// the rest (the scalar scorer then runs).
TEST(OutliersTest, SimdScorerTakesPowerOfTwoGroups) {
  const std::vector<float> x = Block(32, 64, 7, 0);
  std::vector<float> scores(x.size());
  EXPECT_TRUE(cpu::ScoreOutliersSimd(x.data(), 32, 64, Side(true, 0), scores.data()));
  EXPECT_TRUE(cpu::ScoreOutliersSimd(x.data(), 32, 64, Side(false, 16), scores.data()));
  EXPECT_FALSE(cpu::ScoreOutliersSimd(x.data(), 24, 64, Side(true, 0), scores.data()));
  EXPECT_FALSE(cpu::ScoreOutliersSimd(x.data(), 32, 48, Side(false, 24), scores.data()));
}

}  // namespace
}  // namespace kvq
