#include "synthetic/synthetic_kv.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/rope.h"

namespace kvq {
namespace {

SyntheticKvConfig SmallConfig() {
  SyntheticKvConfig c;
  c.head_dim = 64;
  c.tokens = 1024;
  c.group_size = 3;
  c.rope.theta = 100000.0f;
  return c;
}

double SinkShare(const SyntheticKv& kv, int head, int sink_tokens) {
  const int d = kv.head_dim;
  const float* q = &kv.queries[static_cast<size_t>(head) * d];
  std::vector<double> s(kv.tokens);
  double mx = -INFINITY;
  for (int t = 0; t < kv.tokens; ++t) {
    double dot = 0.0;
    for (int c = 0; c < d; ++c)
      dot += static_cast<double>(q[c]) * kv.keys[static_cast<size_t>(t) * d + c];
    s[t] = dot / std::sqrt(static_cast<double>(d));
    mx = std::max(mx, s[t]);
  }
  double all = 0.0, sink = 0.0;
  for (int t = 0; t < kv.tokens; ++t) {
    const double w = std::exp(s[t] - mx);
    all += w;
    if (t < sink_tokens) sink += w;
  }
  return sink / all;
}

TEST(SyntheticKvTest, IsDeterministic) {
  absl::StatusOr<SyntheticKv> a = GenerateSyntheticKv(SmallConfig());
  absl::StatusOr<SyntheticKv> b = GenerateSyntheticKv(SmallConfig());
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->keys_pre_rope, b->keys_pre_rope);
  EXPECT_EQ(a->keys, b->keys);
  EXPECT_EQ(a->values, b->values);
  EXPECT_EQ(a->queries, b->queries);
  EXPECT_EQ(a->outlier_tokens, b->outlier_tokens);
}

TEST(SyntheticKvTest, ShapesAndFiniteness) {
  const SyntheticKvConfig c = SmallConfig();
  absl::StatusOr<SyntheticKv> kv = GenerateSyntheticKv(c);
  ASSERT_TRUE(kv.ok()) << kv.status();
  const size_t n = static_cast<size_t>(c.tokens) * c.head_dim;
  EXPECT_EQ(kv->keys_pre_rope.size(), n);
  EXPECT_EQ(kv->keys.size(), n);
  EXPECT_EQ(kv->values.size(), n);
  EXPECT_EQ(kv->queries.size(), static_cast<size_t>(c.group_size) * c.head_dim);
  EXPECT_EQ(kv->query_position, c.tokens - 1);
  EXPECT_EQ(kv->outlier_channels.size(), static_cast<size_t>(c.head_dim / 32));
  EXPECT_EQ(kv->retrieval_targets.size(),
            static_cast<size_t>(c.group_size * c.model.retrieval_targets));
  for (const auto* v : {&kv->keys_pre_rope, &kv->keys, &kv->values, &kv->queries}) {
    for (float x : *v) ASSERT_TRUE(std::isfinite(x) && std::fabs(x) < 65504.0f);
  }
}

TEST(SyntheticKvTest, PostRopeKeysAreRopeOfPreRopeKeys) {
  const SyntheticKvConfig c = SmallConfig();
  absl::StatusOr<SyntheticKv> kv = GenerateSyntheticKv(c);
  ASSERT_TRUE(kv.ok()) << kv.status();
  const Rope rope(c.rope, c.head_dim);
  for (int t : {0, 1, 5, 300, c.tokens - 1}) {
    std::vector<float> k(kv->keys_pre_rope.begin() + static_cast<size_t>(t) * c.head_dim,
                         kv->keys_pre_rope.begin() + static_cast<size_t>(t + 1) * c.head_dim);
    rope.Apply(k.data(), t);
    for (int i = 0; i < c.head_dim; ++i) {
      EXPECT_EQ(k[i], kv->keys[static_cast<size_t>(t) * c.head_dim + i]) << t << " " << i;
    }
  }
}

TEST(SyntheticKvTest, SinkHoldsItsShareOfAttention) {
  const SyntheticKvConfig c = SmallConfig();
  absl::StatusOr<SyntheticKv> kv = GenerateSyntheticKv(c);
  ASSERT_TRUE(kv.ok()) << kv.status();
  for (int h = 0; h < c.group_size; ++h) {
    EXPECT_NEAR(SinkShare(*kv, h, c.model.sink_tokens), c.model.sink_share, 1e-3) << h;
  }
}

TEST(SyntheticKvTest, OutlierChannelsCarryTheirBiasPreRope) {
  const SyntheticKvConfig c = SmallConfig();
  absl::StatusOr<SyntheticKv> kv = GenerateSyntheticKv(c);
  ASSERT_TRUE(kv.ok()) << kv.status();
  for (size_t i = 0; i < kv->outlier_channels.size(); ++i) {
    const int ch = kv->outlier_channels[i];
    double mean = 0.0;
    for (int t = c.model.sink_tokens; t < c.tokens; ++t) {
      mean += kv->keys_pre_rope[static_cast<size_t>(t) * c.head_dim + ch];
    }
    mean /= c.tokens - c.model.sink_tokens;
    EXPECT_GT(std::fabs(mean), 6.0) << "channel " << ch;
  }
}

TEST(SyntheticKvTest, SampleSeedChangesTheTextNotTheModel) {
  SyntheticKvConfig c = SmallConfig();
  absl::StatusOr<SyntheticKv> a = GenerateSyntheticKv(c);
  c.sample_seed = kSyntheticCalibrationSeed;
  absl::StatusOr<SyntheticKv> b = GenerateSyntheticKv(c);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->outlier_channels, b->outlier_channels);
  EXPECT_NE(a->values, b->values);
  c.kv_head = 1;
  absl::StatusOr<SyntheticKv> other_head = GenerateSyntheticKv(c);
  ASSERT_TRUE(other_head.ok());
  EXPECT_NE(other_head->values, b->values);
  // Outlier tokens are a property of the text: the same in every head.
  EXPECT_EQ(other_head->outlier_tokens, b->outlier_tokens);
}

TEST(SyntheticKvTest, RejectsBadConfigs) {
  SyntheticKvConfig c = SmallConfig();
  c.tokens = 4;
  EXPECT_EQ(GenerateSyntheticKv(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig();
  c.model.value_dof = 2.0;
  EXPECT_EQ(GenerateSyntheticKv(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig();
  c.head_dim = 15;
  EXPECT_EQ(GenerateSyntheticKv(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig();
  c.group_size = 0;
  EXPECT_EQ(GenerateSyntheticKv(c).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq
