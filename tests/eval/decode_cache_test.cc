// The decode-faithful metric. DecodeFaithfulCache's per-(query, key) mask
// over one pass of a window gives:
//  - the attention of the kvq kernel run step by step on KvStreams appended
//    one token at a time (random K/V/Q, no model);
//  - the log-probabilities of a literal token-by-token decode of the model
//    (one token per forward step: the stream appended one token at a time,
//    attention per step over what it holds then);
// and not those of another residual window or of a chunked prefill. Plus
// the bootstrap's pooling.
//
// The model-level comparison reads the stream back for the per-step
// attention rather than calling the kernel: the kernel's attention differs
// from a float dot product by ~1e-4, and at 2 bits such differences in K/V
// flip codes of later tokens, so two runs whose states agree still drift
// apart by a KL of ~1e-2 over a window (as two runs of the kernel with
// different summation orders would).
#include "bench/eval/decode_cache.h"

#include <cmath>
#include <map>
#include <random>
#include <memory>
#include <string>
#include <vector>

#include "bench/eval/bootstrap.h"
#include "bench/eval/decode_metric.h"
#include "bench/eval/eval_runner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/eval/real_model.h"

namespace kvq::eval {
namespace {

// 140 tokens: with sink=4 and r64 the tail flushes at 68 and 132, so the
// window has queries before, across and after two flushes.
constexpr int kTokens = 140;
// Forward steps of the mask run: several, not aligned with the flushes.
constexpr int kChunk = 48;
// The mask run and the literal decode differ only in float summation
// order (matrix products of a chunk against one row).
constexpr double kMaxLogprobDiff = 2e-3;
constexpr double kMaxMeanKl = 1e-6;

// [positions][vocab] next-token log-probabilities of a window.
using Logprobs = std::vector<std::vector<float>>;

class DecodeFaithfulTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RealModel* real = SharedRealModel();
    ASSERT_NE(real, nullptr);
    model_ = real->model.get();
    tokenizer_ = real->tokenizer.get();
  }

  static std::vector<int32_t> Window() {
    std::vector<int32_t> tokens;
    while (static_cast<int>(tokens.size()) < kTokens) {
      const std::vector<int32_t> t = tokenizer_->Encode(
          " It is a truth universally acknowledged, that a single man in possession of a good "
          "fortune, must be in want of a wife. However little known the feelings or views of "
          "such a man may be on his first entering a neighbourhood, this truth is so well fixed "
          "in the minds of the surrounding families, that he is considered the rightful property "
          "of some one or other of their daughters.");
      tokens.insert(tokens.end(), t.begin(), t.end());
    }
    tokens.resize(kTokens);
    return tokens;
  }

  static Logprobs Rows(const std::vector<float>& logits, int rows) {
    const int V = model_->config().vocab;
    Logprobs out(rows, std::vector<float>(V));
    for (int i = 0; i < rows; ++i) LogSoftmax(&logits[static_cast<size_t>(i) * V], V, out[i].data());
    return out;
  }

  // Token by token: one Forward per token, each attending over what the
  // streams hold after that token's append.
  static Logprobs LiteralDecode(const std::string& scheme) {
    static std::map<std::string, Logprobs> done;
    if (done.count(scheme)) return done[scheme];
    auto cache = DecodeFaithfulCache::Create(model_->config().cache_shape(),
                                             *QuantSpec::Parse(scheme), nullptr, &CpuBackend());
    EXPECT_TRUE(cache.ok()) << cache.status();
    const std::vector<int32_t> window = Window();
    Logprobs out;
    std::vector<float> logits;
    for (int p = 0; p < kTokens; ++p) {
      EXPECT_TRUE(model_->Forward(absl::MakeConstSpan(&window[p], 1), cache->get(), false, &logits)
                      .ok());
      out.push_back(Rows(logits, 1)[0]);
    }
    return done[scheme] = out;
  }

  // Chunks of `chunk` tokens through `cache`, every position's logits.
  static Logprobs Chunked(AttentionCache* cache, int chunk) {
    const std::vector<int32_t> window = Window();
    Logprobs out;
    std::vector<float> logits;
    for (int p = 0; p < kTokens; p += chunk) {
      const int n = std::min(chunk, kTokens - p);
      EXPECT_TRUE(
          model_->Forward(absl::MakeConstSpan(window).subspan(p, n), cache, true, &logits).ok());
      for (auto& row : Rows(logits, n)) out.push_back(std::move(row));
    }
    return out;
  }

  static Logprobs Mask(const std::string& scheme) {
    auto cache = DecodeFaithfulCache::Create(model_->config().cache_shape(),
                                             *QuantSpec::Parse(scheme), nullptr, &CpuBackend());
    EXPECT_TRUE(cache.ok()) << cache.status();
    return Chunked(cache->get(), kChunk);
  }

  static Logprobs Prefill(const std::string& scheme, int chunk) {
    auto cache = KvqAttentionCache::Create(model_->config().cache_shape(),
                                           *QuantSpec::Parse(scheme), nullptr, &CpuBackend());
    EXPECT_TRUE(cache.ok()) << cache.status();
    return Chunked(cache->get(), chunk);
  }

  struct Diff {
    double max_target = 0.0;  // Largest |difference| of the next token's log-prob.
    double mean_kl = 0.0;     // Mean KL(a || b) over positions.
  };
  static Diff Compare(const Logprobs& a, const Logprobs& b) {
    const std::vector<int32_t> window = Window();
    const int V = model_->config().vocab;
    Diff d;
    EXPECT_EQ(a.size(), b.size());
    for (int p = 0; p + 1 < kTokens; ++p) {
      const int next = window[p + 1];
      d.max_target = std::max(d.max_target, std::abs(double{a[p][next]} - b[p][next]));
      d.mean_kl += KlDivergence(a[p].data(), b[p].data(), V) / (kTokens - 1);
    }
    return d;
  }

  static inline LlamaModel* model_ = nullptr;
  static inline BpeTokenizer* tokenizer_ = nullptr;
};

TEST_F(DecodeFaithfulTest, MaskEqualsTokenByTokenDecode) {
  for (const std::string scheme :
       {"kivi4:g64:r64:p8:pre_rope:sink=4", "kivi2:g64:r64:fit:p8:pre_rope:sink=4",
        "kivi2:g32:r0:sink=4"}) {
    const Diff d = Compare(LiteralDecode(scheme), Mask(scheme));
    EXPECT_LT(d.max_target, kMaxLogprobDiff) << scheme;
    EXPECT_LT(d.mean_kl, kMaxMeanKl) << scheme;
  }
}

TEST_F(DecodeFaithfulTest, MaskSeesTheResidualWindow) {
  // A mask that put the wrong tokens in fp16 would land on another state:
  // r64's mask run is far from r0's decode (at g32, r0 flushes every 32
  // tokens, r64 every 64), and from r64's chunked prefill (64-token chunks
  // fill the tail and flush it before their queries attend).
  const std::string r64 = "kivi2:g32:r64:sink=4";
  const std::string r0 = "kivi2:g32:r0:sink=4";
  const Logprobs mask = Mask(r64);
  const Diff to_r0 = Compare(LiteralDecode(r0), mask);
  EXPECT_GT(to_r0.mean_kl, 100 * kMaxMeanKl);
  EXPECT_GT(to_r0.max_target, 5 * kMaxLogprobDiff);
  const Diff to_prefill = Compare(Prefill(r64, 64), mask);
  EXPECT_GT(to_prefill.mean_kl, 100 * kMaxMeanKl);
  // And the residual window helps: r64 decodes closer to fp16 than r0.
  const Logprobs fp16 = Prefill("fp16", kTokens);
  EXPECT_LT(Compare(fp16, mask).mean_kl, Compare(fp16, LiteralDecode(r0)).mean_kl);
}

TEST_F(DecodeFaithfulTest, ScoredWindowAgainstItsReference) {
  const std::vector<int32_t> window = Window();
  const CacheShape shape = model_->config().cache_shape();
  Reference reference;
  auto fp16 = DecodeFaithfulCache::Create(shape, *QuantSpec::Parse("fp16"), nullptr, &CpuBackend());
  ASSERT_TRUE(fp16.ok()) << fp16.status();
  auto ref = RunScoredWindow(*model_, window, fp16->get(), kChunk, nullptr, &reference);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->scored, kTokens - 1);
  EXPECT_EQ(reference.logprobs.size(), static_cast<size_t>(kTokens - 1) * model_->config().vocab);
  EXPECT_LT(ref->nll_sum / ref->scored, 5.0);
  auto kivi = DecodeFaithfulCache::Create(shape, *QuantSpec::Parse("kivi2:g32:r64"), nullptr,
                                          &CpuBackend());
  ASSERT_TRUE(kivi.ok()) << kivi.status();
  auto lossy = RunScoredWindow(*model_, window, kivi->get(), kChunk, &reference, nullptr);
  ASSERT_TRUE(lossy.ok()) << lossy.status();
  EXPECT_GT(lossy->kl_sum, 0.0);
  EXPECT_LT(lossy->bytes.total(), ref->bytes.total());
  EXPECT_EQ(fp16->get()->Fork().status().code(), absl::StatusCode::kUnimplemented);
}

// The attention alone, on random K/V/Q: one AppendAttend of a whole chunk
// against a KvqAttentionCache fed one token per step.
TEST(DecodeFaithfulAttentionTest, ChunkEqualsStepByStep) {
  CacheShape shape;
  shape.num_layers = 1;
  shape.num_kv_heads = 1;
  shape.num_q_heads = 2;
  shape.head_dim = 64;
  shape.rope.rotary_dim = 64;
  constexpr int n = 150;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> k(n * 64), v(n * 64), q(n * 128);
  for (auto* x : {&k, &v, &q}) for (float& e : *x) e = normal(rng);
  for (const std::string scheme : {"fp16", "kivi2:g32:r64", "kivi4:g32:r0:pre_rope:sink=4"}) {
    const QuantSpec spec = *QuantSpec::Parse(scheme);
    auto steps = KvqAttentionCache::Create(shape, spec, nullptr, &CpuBackend());
    auto mask = DecodeFaithfulCache::Create(shape, spec, nullptr, &CpuBackend());
    ASSERT_TRUE(steps.ok() && mask.ok());
    std::vector<float> want(n * 128), got(n * 128);
    for (int t = 0; t < n; ++t) {
      ASSERT_TRUE((*steps)->AppendAttend(0, 1, &k[t * 64], &v[t * 64], &q[t * 128],
                                         &want[t * 128]).ok());
    }
    ASSERT_TRUE((*mask)->AppendAttend(0, n, k.data(), v.data(), q.data(), got.data()).ok());
    double max_err = 0.0;
    int worst = 0;
    for (int i = 0; i < n * 128; ++i) {
      if (std::abs(want[i] - got[i]) > max_err) max_err = std::abs(want[i] - got[i]), worst = i;
    }
    // The kernel's attention rounds differently from float products (~1e-4).
    EXPECT_LT(max_err, 1e-3) << scheme << " worst at token " << worst / 128;
  }
  // The mask tells residual windows apart: r64's one pass is far from the
  // kernel's steps on an r0 stream.
  auto r0 = KvqAttentionCache::Create(shape, *QuantSpec::Parse("kivi2:g32:r0"), nullptr,
                                      &CpuBackend());
  auto r64 = DecodeFaithfulCache::Create(shape, *QuantSpec::Parse("kivi2:g32:r64"), nullptr,
                                         &CpuBackend());
  ASSERT_TRUE(r0.ok() && r64.ok());
  std::vector<float> want(n * 128), got(n * 128);
  for (int t = 0; t < n; ++t) {
    ASSERT_TRUE(
        (*r0)->AppendAttend(0, 1, &k[t * 64], &v[t * 64], &q[t * 128], &want[t * 128]).ok());
  }
  ASSERT_TRUE((*r64)->AppendAttend(0, n, k.data(), v.data(), q.data(), got.data()).ok());
  double max_err = 0.0;
  for (int i = 0; i < n * 128; ++i) max_err = std::max<double>(max_err, std::abs(want[i] - got[i]));
  EXPECT_GT(max_err, 0.05);
}

TEST(BootstrapTest, PoolsAndBracketsThePooledValue) {
  // Two windows, scheme worse by 0.01 and 0.03 nats per token.
  std::vector<WindowScore> w = {{110.0, 100.0, 2.0, 1000}, {330.0, 300.0, 6.0, 1000}};
  PooledScore one = Pool({w[0]}, 1000, 1);
  EXPECT_NEAR(one.delta_ppl_pct, 100.0 * std::expm1(0.01), 1e-12);
  EXPECT_NEAR(one.kl_mean, 0.002, 1e-15);
  EXPECT_FALSE(one.has_interval) << "one window has no spread to resample";
  PooledScore both = Pool(w, 1000, 1);
  EXPECT_NEAR(both.delta_ppl_pct, 100.0 * std::expm1(0.02), 1e-12);
  EXPECT_NEAR(both.kl_mean, 0.004, 1e-15);
  ASSERT_TRUE(both.has_interval);
  // Resamples are {a,a}, {a,b}, {b,b}: the 95% interval spans the extremes.
  EXPECT_NEAR(both.delta_ppl_pct_ci.lo, 100.0 * std::expm1(0.01), 1e-9);
  EXPECT_NEAR(both.delta_ppl_pct_ci.hi, 100.0 * std::expm1(0.03), 1e-9);
  EXPECT_NEAR(both.kl_mean_ci.lo, 0.002, 1e-12);
  EXPECT_NEAR(both.kl_mean_ci.hi, 0.006, 1e-12);
  // Seeded: the same seed gives the same interval.
  std::vector<WindowScore> many;
  for (int i = 0; i < 7; ++i) many.push_back({100.0 + i * i, 100.0, 0.1 * i, 500});
  const PooledScore a = Pool(many, 500, 42), b = Pool(many, 500, 42);
  EXPECT_EQ(a.delta_ppl_pct_ci.lo, b.delta_ppl_pct_ci.lo);
  EXPECT_EQ(a.kl_mean_ci.hi, b.kl_mean_ci.hi);
  EXPECT_LE(a.delta_ppl_pct_ci.lo, a.delta_ppl_pct);
  EXPECT_GE(a.delta_ppl_pct_ci.hi, a.delta_ppl_pct);
}

}  // namespace
}  // namespace kvq::eval
