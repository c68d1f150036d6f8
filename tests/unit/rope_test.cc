#include "kernels/rope.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using Pairing = RopeConfig::Pairing;
using Scaling = RopeConfig::Scaling;

using testutil::MakeRope;

// head_dim 4, theta 10000, position 1: pair 0 turns by 1 rad, pair 1 by
// 10000^(-2/4) = 0.01 rad. Expected values worked out by hand from
// cos 1 = 0.5403023, sin 1 = 0.8414710, cos 0.01 = 0.99995, sin 0.01 = 0.0099998.
TEST(RopeTest, AdjacentPairsExplicit) {
  const Rope rope(MakeRope(Pairing::kAdjacent), 4);
  float x[4] = {1, 2, 3, 4};
  rope.Apply(x, 1);
  // Pairs (0, 1) and (2, 3).
  EXPECT_NEAR(x[0], 1 * 0.5403023 - 2 * 0.8414710, 1e-6);  // -1.1426397
  EXPECT_NEAR(x[1], 1 * 0.8414710 + 2 * 0.5403023, 1e-6);  //  1.9220756
  EXPECT_NEAR(x[2], 3 * 0.9999500 - 4 * 0.0099998, 1e-6);  //  2.9598507
  EXPECT_NEAR(x[3], 3 * 0.0099998 + 4 * 0.9999500, 1e-6);  //  4.0297995
  EXPECT_EQ(rope.First(1), 2);
  EXPECT_EQ(rope.Second(1), 3);
}

TEST(RopeTest, HalfSplitPairsExplicit) {
  const Rope rope(MakeRope(Pairing::kHalfSplit), 4);
  float x[4] = {1, 2, 3, 4};
  rope.Apply(x, 1);
  // Pairs (0, 2) and (1, 3).
  EXPECT_NEAR(x[0], 1 * 0.5403023 - 3 * 0.8414710, 1e-6);  // -1.9841107
  EXPECT_NEAR(x[2], 1 * 0.8414710 + 3 * 0.5403023, 1e-6);  //  2.4623779
  EXPECT_NEAR(x[1], 2 * 0.9999500 - 4 * 0.0099998, 1e-6);  //  1.9599007
  EXPECT_NEAR(x[3], 2 * 0.0099998 + 4 * 0.9999500, 1e-6);  //  4.0197997
  EXPECT_EQ(rope.First(1), 1);
  EXPECT_EQ(rope.Second(1), 3);
}

TEST(RopeTest, PartialRotaryDimLeavesTheRestAlone) {
  for (Pairing pairing : {Pairing::kAdjacent, Pairing::kHalfSplit}) {
    const Rope partial(MakeRope(pairing, 4), 8);
    const Rope full4(MakeRope(pairing), 4);
    EXPECT_EQ(partial.rotary_dim(), 4);
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    float y[4] = {1, 2, 3, 4};
    partial.Apply(x, 3);
    full4.Apply(y, 3);
    for (int c = 0; c < 4; ++c) EXPECT_EQ(x[c], y[c]) << "rotated channel " << c;
    for (int c = 4; c < 8; ++c) EXPECT_EQ(x[c], c + 1.0f) << "channel " << c << " must not rotate";
  }
}

TEST(RopeTest, InverseRestoresTheVector) {
  for (Pairing pairing : {Pairing::kAdjacent, Pairing::kHalfSplit}) {
    const Rope rope(MakeRope(pairing, 96, Scaling::kNtk, 2.0f), 128);
    const std::vector<float> x = testutil::MakeGaussian(128, 5);
    for (double position : {0.0, 1.0, 77.0, 4095.0, 100000.0}) {
      std::vector<float> y = x;
      rope.Apply(y.data(), position);
      rope.Apply(y.data(), position, -1);
      for (int c = 0; c < 128; ++c) {
        EXPECT_NEAR(y[c], x[c], 1e-5 * (1 + std::fabs(x[c]))) << "position " << position << " channel " << c;
      }
    }
  }
}

TEST(RopeTest, PreservesNormAndDependsOnlyOnRelativePosition) {
  const Rope rope(MakeRope(Pairing::kHalfSplit), 64);
  const std::vector<float> q = testutil::MakeGaussian(64, 6), k = testutil::MakeGaussian(64, 7);
  auto dot = [](const std::vector<float>& a, const std::vector<float>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += double{a[i]} * b[i];
    return s;
  };
  auto rotated = [&](std::vector<float> x, double p) {
    rope.Apply(x.data(), p);
    return x;
  };
  EXPECT_NEAR(dot(rotated(q, 300), rotated(q, 300)), dot(q, q), 1e-4 * dot(q, q));
  const double d1 = dot(rotated(q, 40), rotated(k, 10));
  const double d2 = dot(rotated(q, 1030), rotated(k, 1000));
  EXPECT_NEAR(d1, d2, 1e-3) << "q.k after RoPE depends on m - n only";
}

TEST(RopeTest, LinearScalingDividesThePosition) {
  for (Pairing pairing : {Pairing::kAdjacent, Pairing::kHalfSplit}) {
    const Rope scaled(MakeRope(pairing, 0, Scaling::kLinear, 4.0f), 64);
    const Rope plain(MakeRope(pairing), 64);
    std::vector<float> a = testutil::MakeGaussian(64, 8), b = a;
    scaled.Apply(a.data(), 1000);
    plain.Apply(b.data(), 250);
    EXPECT_EQ(a, b) << "position 1000 at factor 4 is position 250";
    EXPECT_DOUBLE_EQ(scaled.Angle(5, 1000), plain.Angle(5, 250));
  }
}

TEST(RopeTest, NtkScalingRaisesTheBase) {
  const int rot = 64;
  const Rope ntk(MakeRope(Pairing::kHalfSplit, 0, Scaling::kNtk, 8.0f), rot);
  const Rope plain(MakeRope(Pairing::kHalfSplit), rot);
  const double base = 10000.0 * std::pow(8.0, static_cast<double>(rot) / (rot - 2));
  for (int i : {0, 1, 10, 31}) {
    const double want = 123.0 * std::pow(base, -2.0 * i / rot);
    EXPECT_NEAR(ntk.Angle(i, 123.0), want, 1e-12 * std::fabs(want) + 1e-300) << "pair " << i;
  }
  EXPECT_EQ(ntk.Angle(0, 123.0), plain.Angle(0, 123.0)) << "the fastest pair is unchanged";
  EXPECT_LT(ntk.Angle(31, 123.0), plain.Angle(31, 123.0) / 7.9) << "the slowest pair slows ~factor";
}

TEST(RopeTest, ThetaSetsTheFrequencies) {
  RopeConfig c = MakeRope(Pairing::kAdjacent);
  c.theta = 500000.0f;
  const Rope rope(c, 128);
  EXPECT_NEAR(rope.Angle(32, 10.0), 10.0 * std::pow(500000.0, -64.0 / 128), 1e-15);
}

TEST(RopeTest, ValidateNamesTheField) {
  RopeConfig c;
  c.rotary_dim = 66;
  EXPECT_EQ(c.Validate(64).message(), "rope.rotary_dim must be even and in [2, head_dim=64], got 66");
  c.rotary_dim = 5;
  EXPECT_EQ(c.Validate(64).message(), "rope.rotary_dim must be even and in [2, head_dim=64], got 5");
  c.rotary_dim = -2;
  EXPECT_EQ(c.Validate(64).code(), absl::StatusCode::kInvalidArgument);
  c = RopeConfig{};
  c.theta = 1.0f;
  EXPECT_EQ(c.Validate(64).message(), "rope.theta must be > 1, got 1");
  c = RopeConfig{};
  c.factor = 0.5f;
  EXPECT_EQ(c.Validate(64).message(), "rope.factor must be >= 1, got 0.5");
  EXPECT_TRUE(RopeConfig{}.Validate(64).ok());
}

}  // namespace
}  // namespace kvq
