#include "bench/eval/calibration_stats.h"

#include <cmath>
#include <random>
#include <vector>

#include "bench/eval/attention_cache.h"
#include "gtest/gtest.h"
#include "kernels/calibration_file.h"
#include "tests/eval/real_model.h"

namespace kvq::eval {
namespace {

double GeometricMean(const std::vector<float>& s) {
  double log_sum = 0.0;
  for (float x : s) log_sum += std::log(x);
  return std::exp(log_sum / s.size());
}

// (sum_c q_c s_c^2) (sum_c k_c / s_c^2): the expected q.k error the scales
// minimize, up to a constant.
double Objective(const std::vector<double>& num, const std::vector<double>& den,
                 const std::vector<float>& s) {
  double a = 0.0, b = 0.0;
  for (size_t c = 0; c < s.size(); ++c) {
    a += den[c] * s[c] * s[c];
    b += num[c] / (s[c] * s[c]);
  }
  return a * b;
}

RopeConfig Rope(RopeConfig::Pairing pairing, int rotary_dim) {
  RopeConfig r;
  r.pairing = pairing;
  r.rotary_dim = rotary_dim;
  return r;
}

TEST(KeyScalesTest, OnePerRopePairFromThePairsMoments) {
  constexpr int d = 8;
  const std::vector<double> k = {1, 3, 4, 4, 0.5, 0.5, 16, 0};
  const std::vector<double> q = {2, 2, 1, 1, 8, 0, 1, 1};
  // Adjacent pairs (0,1) (2,3) (4,5) (6,7): K = 4, 8, 1, 16; Q = 4, 2, 8, 2.
  std::vector<float> s = KeyScales(k, q, Rope(RopeConfig::Pairing::kAdjacent, 0), d);
  ASSERT_EQ(s.size(), d);
  const double raw[4] = {std::pow(4.0 / 4, 0.25), std::pow(8.0 / 2, 0.25),
                         std::pow(1.0 / 8, 0.25), std::pow(16.0 / 2, 0.25)};
  const double g = std::pow(raw[0] * raw[1] * raw[2] * raw[3], 0.25);
  for (int p = 0; p < 4; ++p) {
    EXPECT_NEAR(s[2 * p], raw[p] / g, 1e-6) << "pair " << p;
    EXPECT_EQ(s[2 * p], s[2 * p + 1]) << "pair " << p;
  }
  EXPECT_NEAR(GeometricMean(s), 1.0, 1e-6);
  // Half-split pairs (i, i + 4) of the same moments.
  s = KeyScales(k, q, Rope(RopeConfig::Pairing::kHalfSplit, 0), d);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s[i], s[i + 4]) << "pair " << i;
    EXPECT_GT(s[i], 0.0f);
  }
  // Partial rotary: channels 4..7 do not rotate and are scaled alone.
  s = KeyScales(k, q, Rope(RopeConfig::Pairing::kAdjacent, 4), d);
  EXPECT_EQ(s[0], s[1]);
  EXPECT_EQ(s[2], s[3]);
  EXPECT_NEAR(s[4] / s[6], std::pow((0.5 / 8) / (16.0 / 1), 0.25), 1e-5);
  EXPECT_TRUE(std::isfinite(s[5]) && s[5] > 0) << "a zero moment still gets a finite scale";
  EXPECT_TRUE(std::isfinite(s[7]) && s[7] > 0);
}

TEST(KeyScalesTest, MinimizeTheExpectedScoreErrorOverPairTiedScales) {
  constexpr int d = 16;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.01, 10.0);
  std::vector<double> k(d), q(d);
  for (int c = 0; c < d; ++c) {
    k[c] = u(rng);
    q[c] = u(rng);
  }
  const RopeConfig rope = Rope(RopeConfig::Pairing::kHalfSplit, 0);
  const std::vector<float> best = KeyScales(k, q, rope, d);
  const double at_best = Objective(k, q, best);
  std::normal_distribution<double> n(0.0, 0.2);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> other = best;
    for (int i = 0; i < d / 2; ++i) {
      const float f = static_cast<float>(std::exp(n(rng)));
      other[i] *= f;
      other[i + d / 2] *= f;
    }
    EXPECT_GE(Objective(k, q, other), at_best * (1 - 1e-6)) << "trial " << trial;
  }
  // Unit scales are no better.
  EXPECT_GE(Objective(k, q, std::vector<float>(d, 1.0f)), at_best * (1 - 1e-6));
}

TEST(ValueScalesTest, PerChannelFromVarianceAndOutputColumns) {
  const std::vector<double> var = {1, 16, 4, 0.25};
  const std::vector<double> w = {1, 1, 4, 0.25};
  const std::vector<float> s = ValueScales(var, w);
  const double raw[4] = {1.0, 2.0, 1.0, 1.0};
  const double g = std::pow(2.0, 0.25);
  for (int c = 0; c < 4; ++c) EXPECT_NEAR(s[c], raw[c] / g, 1e-6) << c;
}

TEST(CalibrationStatsTest, MeansAndScalesOfWhatWasAdded) {
  CacheShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = 1;
  shape.num_q_heads = 2;
  shape.head_dim = 4;
  shape.rope = Rope(RopeConfig::Pairing::kAdjacent, 0);
  CalibrationStats stats(shape);
  // Two tokens: k, v [2][4]; q [2][2 heads x 4].
  const float k[] = {1, 2, 3, 4, 3, 2, 1, 0};
  const float v[] = {0, 0, 2, 2, 2, 4, 2, 2};
  const float q[] = {1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 0, 0, 3, 3, 0, 0};
  stats.Add(0, 2, k, v, q);
  // W_o columns of head 0 channels 0..3, head 1 channels 0..3.
  const std::vector<std::vector<double>> out_sq = {{1, 1, 1, 1, 1, 1, 1, 1}};
  absl::StatusOr<ModelCalibration> c = stats.Finish("t", out_sq);
  ASSERT_TRUE(c.ok()) << c.status();
  const HeadCalibration& h = c->Head(0, 0);
  EXPECT_EQ(h.key_mean, std::vector<float>({2, 2, 2, 2}));
  EXPECT_EQ(h.value_mean, std::vector<float>({1, 2, 2, 2}));
  // Key variances 1, 0, 1, 4: pairs K = 1, 5. Query squares pooled over
  // two heads and two tokens: channel 0, 1: (1 + 1 + 9 + 9) / 4 = 5;
  // channels 2, 3: (1 + 1 + 0 + 0) / 4 = 0.5; pairs Q = 10, 1.
  const double s0 = std::pow(1.0 / 10, 0.25), s1 = std::pow(5.0 / 1, 0.25);
  const double g = std::sqrt(s0 * s1);
  EXPECT_NEAR(h.key_scale[0], s0 / g, 1e-6);
  EXPECT_NEAR(h.key_scale[2], s1 / g, 1e-6);
  EXPECT_EQ(h.key_scale[0], h.key_scale[1]);
  // Value variances 1, 4, 0, 0 over w^2 = 2 each (two heads' columns).
  EXPECT_NEAR(h.value_scale[0] / h.value_scale[1], std::pow(1.0 / 4, 0.25), 1e-6);
  // A layer that saw nothing.
  CalibrationStats empty(shape);
  EXPECT_EQ(empty.Finish("t", out_sq).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ComputeCalibrationTest, RealModelMeansMatchTheKeysTheModelProduces) {
  RealModel* real = SharedRealModel();
  ASSERT_NE(real, nullptr);
  LlamaModel& model = *real->model;
  const std::vector<int32_t> tokens = real->tokenizer->Encode(
      "It is a truth universally acknowledged, that a single man in possession of a good "
      "fortune, must be in want of a wife. However little known the feelings or views of such "
      "a man may be on his first entering a neighbourhood, this truth is so well fixed.");
  absl::StatusOr<ModelCalibration> c = ComputeCalibration(model, tokens, 16, "smollm2");
  ASSERT_TRUE(c.ok()) << c.status();
  const CacheShape shape = model.config().cache_shape();
  EXPECT_EQ(c->num_layers, shape.num_layers);
  EXPECT_EQ(c->num_kv_heads, shape.num_kv_heads);
  EXPECT_EQ(c->head_dim, shape.head_dim);
  EXPECT_TRUE(c->Validate().ok());
  // Layer 0's keys depend on the embeddings only: the exact fp32 cache
  // records the same rows whatever the cache.
  ExactAttentionCache exact(shape, /*keys_before_rope=*/true);
  std::vector<float> logits;
  ASSERT_TRUE(model.Forward(tokens, &exact, false, &logits).ok());
  const int d = shape.head_dim, row = shape.num_kv_heads * d;
  const std::vector<float>& keys = exact.keys(0);
  const std::vector<float>& values = exact.values(0);
  const int n = static_cast<int>(tokens.size());
  for (int h = 0; h < shape.num_kv_heads; ++h) {
    for (int ch = 0; ch < d; ++ch) {
      double mk = 0, mv = 0;
      for (int t = 0; t < n; ++t) {
        mk += keys[static_cast<size_t>(t) * row + h * d + ch];
        mv += values[static_cast<size_t>(t) * row + h * d + ch];
      }
      EXPECT_NEAR(c->Head(0, h).key_mean[ch], mk / n, 1e-4) << "head " << h << " ch " << ch;
      EXPECT_NEAR(c->Head(0, h).value_mean[ch], mv / n, 1e-4) << "head " << h << " ch " << ch;
    }
    // Scales in the model's (adjacent) RoPE pairing, geometric mean 1.
    for (int p = 0; p < d / 2; ++p) {
      EXPECT_EQ(c->Head(0, h).key_scale[2 * p], c->Head(0, h).key_scale[2 * p + 1]);
    }
    EXPECT_NEAR(GeometricMean(c->Head(0, h).key_scale), 1.0, 1e-4);
    EXPECT_NEAR(GeometricMean(c->Head(0, h).value_scale), 1.0, 1e-4);
  }
  // It round-trips through its file.
  absl::StatusOr<std::string> bytes =
      SerializeCalibration(*c, ModelFingerprint("SmolLM2.gguf", model.config()));
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<CalibrationFile> back = ParseCalibration(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->calibration, *c);
  EXPECT_EQ(back->model, "SmolLM2.gguf layers=30 kv_heads=3 q_heads=9 head_dim=64 "
                         "rope=adjacent/64/100000");
}

}  // namespace
}  // namespace kvq::eval
