#include "kernels/hadamard.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

double Dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double{a[i]} * b[i];
  return s;
}

TEST(HadamardTest, WalshHadamardExplicit) {
  float x[4] = {1, 2, 3, 4};
  WalshHadamard(x, 4);
  // Rows of the natural-order 4x4 Hadamard matrix times (1, 2, 3, 4).
  EXPECT_EQ(x[0], 10.0f);
  EXPECT_EQ(x[1], -2.0f);
  EXPECT_EQ(x[2], -4.0f);
  EXPECT_EQ(x[3], 0.0f);
}

TEST(HadamardTest, MatrixIsSignedScaledHadamard) {
  const int d = 8;
  const HadamardRotation h(d, 99);
  std::vector<std::vector<float>> cols(d, std::vector<float>(d, 0.0f));
  for (int j = 0; j < d; ++j) {
    cols[j][j] = 1.0f;
    h.Forward(cols[j].data());
  }
  for (int j = 0; j < d; ++j) {
    // Column j = sign_j * W[:, j] / sqrt(d), W[i][j] = (-1)^popcount(i & j).
    const float sign = cols[j][0] > 0 ? 1.0f : -1.0f;
    for (int i = 0; i < d; ++i) {
      const float w = (__builtin_popcount(i & j) % 2) ? -1.0f : 1.0f;
      EXPECT_NEAR(cols[j][i], sign * w / std::sqrt(8.0f), 1e-7) << "H[" << i << "][" << j << "]";
    }
    for (int k = 0; k < d; ++k) {
      EXPECT_NEAR(Dot(cols[j], cols[k]), j == k ? 1.0 : 0.0, 1e-6) << "columns " << j << ", " << k;
    }
  }
}

TEST(HadamardTest, OrthonormalInverseAndDotProducts) {
  for (int d : {16, 64, 128, 256}) {
    const HadamardRotation h(d, 0x6b7671u);
    for (uint64_t seed = 1; seed <= 5; ++seed) {
      const std::vector<float> x = testutil::MakeGaussian(d, seed);
      const std::vector<float> y = testutil::MakeGaussian(d, seed + 100);
      std::vector<float> hx = x, hy = y;
      h.Forward(hx.data());
      h.Forward(hy.data());
      EXPECT_NEAR(Dot(hx, hx), Dot(x, x), 1e-6 * Dot(x, x)) << "norm, d=" << d;
      EXPECT_NEAR(Dot(hx, hy), Dot(x, y), 1e-6 * std::sqrt(Dot(x, x) * Dot(y, y)))
          << "q.k, d=" << d;
      std::vector<float> back = hx;
      h.Inverse(back.data());
      for (int i = 0; i < d; ++i) {
        EXPECT_NEAR(back[i], x[i], 1e-6 * (1 + std::fabs(x[i]))) << "Inverse(Forward(x)) d=" << d;
      }
      std::vector<float> fwd = x;
      h.Inverse(fwd.data());
      h.Forward(fwd.data());
      for (int i = 0; i < d; ++i) {
        EXPECT_NEAR(fwd[i], x[i], 1e-6 * (1 + std::fabs(x[i]))) << "Forward(Inverse(x)) d=" << d;
      }
    }
  }
}

TEST(HadamardTest, SpreadsAnOutlierChannel) {
  const int d = 64;
  const HadamardRotation h(d, 7);
  std::vector<float> x(d, 0.0f);
  x[13] = 8.0f;
  h.Forward(x.data());
  for (int i = 0; i < d; ++i) EXPECT_NEAR(std::fabs(x[i]), 1.0f, 1e-6) << "8 / sqrt(64) everywhere";
}

TEST(HadamardTest, SeedFixesTheSigns) {
  const int d = 64;
  const std::vector<float> x = testutil::MakeGaussian(d, 3);
  std::vector<float> a = x, b = x, c = x;
  HadamardRotation(d, 1).Forward(a.data());
  HadamardRotation(d, 1).Forward(b.data());
  HadamardRotation(d, 2).Forward(c.data());
  EXPECT_EQ(a, b) << "same seed, same rotation";
  EXPECT_NE(a, c) << "another seed, another rotation";
}

}  // namespace
}  // namespace kvq
