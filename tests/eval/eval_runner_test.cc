// kvq-eval's measurements: the numerics (log-softmax, KL, argmax), the
// passkey prompt, and RunWindow's bookkeeping on the real model (the fp16
// reference against itself is exact; a 2-bit cache is not).
#include "bench/eval/eval_runner.h"

#include <cmath>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/eval/real_model.h"

namespace kvq::eval {
namespace {

TEST(EvalNumericsTest, LogSoftmaxNormalizes) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f, -1000.0f};
  std::vector<float> lp(4);
  LogSoftmax(logits.data(), 4, lp.data());
  double sum = 0.0;
  for (float x : lp) sum += std::exp(static_cast<double>(x));
  EXPECT_NEAR(sum, 1.0, 1e-6);
  // log(e^3 / (e + e^2 + e^3)).
  EXPECT_NEAR(lp[2], 3.0 - std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)), 1e-6);
  EXPECT_EQ(ArgMax(logits.data(), 4), 2);
}

TEST(EvalNumericsTest, KlDivergence) {
  const std::vector<float> p = {std::log(0.5f), std::log(0.5f)};
  const std::vector<float> q = {std::log(0.9f), std::log(0.1f)};
  EXPECT_DOUBLE_EQ(KlDivergence(p.data(), p.data(), 2), 0.0);
  EXPECT_NEAR(KlDivergence(p.data(), q.data(), 2),
              0.5 * std::log(0.5 / 0.9) + 0.5 * std::log(0.5 / 0.1), 1e-6);
}

class EvalRunnerTest : public RealModelTest {
 protected:
  static std::unique_ptr<AttentionCache> Kvq(const char* scheme) {
    auto cache = KvqAttentionCache::Create(model_->config().cache_shape(),
                                           *QuantSpec::Parse(scheme), nullptr, &CpuBackend());
    EXPECT_TRUE(cache.ok()) << cache.status();
    return std::move(*cache);
  }
  static std::vector<int32_t> Text() {
    return tokenizer_->Encode(
        "It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. However little known the feelings or views of such "
        "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
        "minds of the surrounding families, that he is considered the rightful property of some "
        "one or other of their daughters.");
  }

  // Prefill in 16-token chunks, then 8 generated tokens.
  static WindowOptions ShortWindow() {
    WindowOptions options;
    options.chunk = 16;
    options.gen_tokens = 8;
    return options;
  }
};

TEST_F(EvalRunnerTest, ReferenceAgainstItselfIsExact) {
  const std::vector<int32_t> window = Text();
  const int n = static_cast<int>(window.size());
  const WindowOptions options = ShortWindow();
  Reference reference;
  auto cache = Kvq("fp16");
  auto ref = RunWindow(*model_, window, cache.get(), options, nullptr, &reference);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->scored, n - 1);
  EXPECT_EQ(ref->generated, 8);
  EXPECT_EQ(reference.greedy.size(), 8u);
  EXPECT_EQ(ref->decode_seconds.size(), 7u);
  EXPECT_EQ(reference.logprobs.size(), static_cast<size_t>(n - 1) * model_->config().vocab);
  // A real text is far more predictable than chance (ln 49152 = 10.8).
  EXPECT_LT(ref->nll_sum / ref->scored, 5.0);

  auto again = Kvq("fp16");
  auto same = RunWindow(*model_, window, again.get(), options, &reference, nullptr);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->nll_sum, ref->nll_sum);  // Deterministic.
  EXPECT_EQ(same->kl_sum, 0.0);
  EXPECT_EQ(same->agree, 8);
  // fp16 KV of every stored token: 2 sides * 30 layers * 3 heads * 64 * 2 B.
  EXPECT_EQ(same->bytes.residual, 0u);
  EXPECT_EQ(same->bytes.sink, 0u);
  EXPECT_EQ(same->bytes.codes, static_cast<size_t>(n) * 2 * 30 * 3 * 64 * 2);

  auto kivi2 = Kvq("kivi2:g32:r32");
  auto lossy = RunWindow(*model_, window, kivi2.get(), options, &reference, nullptr);
  ASSERT_TRUE(lossy.ok()) << lossy.status();
  EXPECT_GT(lossy->kl_sum, 0.0);
  EXPECT_LT(lossy->bytes.total(), same->bytes.total());
}

TEST_F(EvalRunnerTest, WithoutGenerationTheScoresAreThoseOfAGeneratingRun) {
  const std::vector<int32_t> window = Text();
  const WindowOptions options = ShortWindow();
  WindowOptions quiet = options;
  quiet.generate = false;
  Reference generated_ref, quiet_ref;
  auto a = Kvq("fp16"), b = Kvq("fp16");
  auto ref = RunWindow(*model_, window, a.get(), options, nullptr, &generated_ref);
  auto ref_quiet = RunWindow(*model_, window, b.get(), quiet, nullptr, &quiet_ref);
  ASSERT_TRUE(ref.ok() && ref_quiet.ok());
  EXPECT_EQ(ref_quiet->generated, 0);
  EXPECT_TRUE(quiet_ref.greedy.empty());
  EXPECT_EQ(quiet_ref.gen_tokens, 8);
  EXPECT_EQ(ref_quiet->nll_sum, ref->nll_sum);
  EXPECT_EQ(quiet_ref.logprobs, generated_ref.logprobs);

  // A lossy scheme against either reference: the same perplexity and KL,
  // and no generation against the one that did not generate.
  auto c = Kvq("kivi2:g32:r32"), d = Kvq("kivi2:g32:r32");
  auto lossy = RunWindow(*model_, window, c.get(), options, &generated_ref, nullptr);
  auto lossy_quiet = RunWindow(*model_, window, d.get(), options, &quiet_ref, nullptr);
  ASSERT_TRUE(lossy.ok() && lossy_quiet.ok());
  EXPECT_EQ(lossy->generated, 8);
  EXPECT_EQ(lossy_quiet->generated, 0);
  EXPECT_EQ(lossy_quiet->nll_sum, lossy->nll_sum);
  EXPECT_EQ(lossy_quiet->kl_sum, lossy->kl_sum);
  EXPECT_GT(lossy_quiet->kl_sum, 0.0);
  EXPECT_EQ(lossy_quiet->bytes.total(), lossy->bytes.total());
}

TEST_F(EvalRunnerTest, RejectsAReferenceOfAnotherWindow) {
  Reference reference;
  reference.greedy = {1, 2};
  reference.logprobs.assign(10, 0.0f);
  auto cache = Kvq("fp16");
  auto r = RunWindow(*model_, Text(), cache.get(), WindowOptions{}, &reference, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("reference"));
}

TEST_F(EvalRunnerTest, PasskeyPromptHidesTheKeyAtTheDepth) {
  for (double depth : {0.0, 0.5, 1.0}) {
    const PasskeyPrompt p = MakePasskeyPrompt(*tokenizer_, 512, depth, 7);
    EXPECT_LE(p.tokens.size(), 512u);
    EXPECT_GT(p.tokens.size(), 450u);
    EXPECT_EQ(p.key.size(), 5u);
    const std::string text = tokenizer_->Decode(p.tokens);
    const size_t at = text.find("The pass key is " + p.key);
    ASSERT_NE(at, std::string::npos);
    EXPECT_NEAR(static_cast<double>(at) / text.size(), depth, 0.12);
    EXPECT_TRUE(text.ends_with("What is the pass key? The pass key is"));
  }
  // Same seed, same key; another seed, (here) another key.
  EXPECT_EQ(MakePasskeyPrompt(*tokenizer_, 256, 0.5, 7).key,
            MakePasskeyPrompt(*tokenizer_, 256, 0.5, 7).key);
  EXPECT_NE(MakePasskeyPrompt(*tokenizer_, 256, 0.5, 7).key,
            MakePasskeyPrompt(*tokenizer_, 256, 0.5, 8).key);
}

TEST_F(EvalRunnerTest, LayerRangeQuantizesOnlyThoseLayers) {
  const CacheShape shape = model_->config().cache_shape();
  const std::vector<int32_t> window = Text();
  const int n = static_cast<int>(window.size());
  const WindowOptions options = ShortWindow();
  Reference reference;
  auto fp16 = Kvq("fp16");
  auto ref = RunWindow(*model_, window, fp16.get(), options, nullptr, &reference);
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto run = [&](const std::string& name) {
    auto scheme = ParseEvalScheme(name, shape.num_layers);
    EXPECT_TRUE(scheme.ok()) << scheme.status();
    auto cache = KvqAttentionCache::Create(shape, scheme->spec, nullptr, &CpuBackend(),
                                           scheme->layers);
    EXPECT_TRUE(cache.ok()) << cache.status();
    auto r = RunWindow(*model_, window, cache->get(), options, &reference, nullptr);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  };
  // A pre_rope scheme whose window holds every token in fp16, quantizing
  // layer 0 only: every layer is fp16, the others after RoPE as the fp16
  // scheme stores them, so the model's output barely moves (a missing
  // rotation of the fp16 layers' keys would wreck it).
  const WindowResult exact = run("kivi2:g32:r1024:pre_rope@0");
  EXPECT_LT(exact.kl_sum / exact.scored, 1e-4);
  EXPECT_EQ(exact.agree, 8);

  // Bytes: one layer at the scheme, 29 at fp16.
  const WindowResult all = run("kivi2:g32:r32:pre_rope:sink=4");
  const WindowResult one = run("kivi2:g32:r32:pre_rope:sink=4@7");
  const WindowResult same = run("kivi2:g32:r32:pre_rope:sink=4@0-29");
  EXPECT_EQ(same.nll_sum, all.nll_sum) << "the whole range is the plain scheme";
  EXPECT_EQ(same.bytes.total(), all.bytes.total());
  EXPECT_EQ(one.bytes.total(), ref->bytes.total() / 30 * 29 + all.bytes.total() / 30);
  EXPECT_EQ(one.bytes.codes, static_cast<size_t>(n) * 2 * 3 * 64 * 2 * 29 + all.bytes.codes / 30)
      << "fp16 codes of every token in 29 layers, the scheme's in one";
  EXPECT_GT(one.kl_sum, 0.0);
  EXPECT_LT(one.kl_sum, all.kl_sum);
}

TEST(EvalSchemeTest, ParsesLayerRanges) {
  auto plain = ParseEvalScheme("kivi3:pre_rope", 30);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->spec.pre_rope);
  EXPECT_EQ(plain->layers.first, 0);
  EXPECT_EQ(plain->layers.last, -1);
  EXPECT_TRUE(plain->layers.Contains(29));
  auto range = ParseEvalScheme("kivi3@5-9", 30);
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->layers.first, 5);
  EXPECT_EQ(range->layers.last, 9);
  EXPECT_FALSE(range->layers.Contains(4));
  EXPECT_TRUE(range->layers.Contains(9));
  EXPECT_FALSE(range->layers.Contains(10));
  auto one = ParseEvalScheme("kivi3@29", 30);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->layers.first, 29);
  EXPECT_EQ(one->layers.last, 29);
  for (const char* bad : {"kivi3@30", "kivi3@5-4", "kivi3@", "kivi3@-1", "kivi3@a-b"}) {
    auto r = ParseEvalScheme(bad, 30);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(r.status().message()),
                ::testing::HasSubstr("the layer range after '@' must be A-B or A with 0 <= A <= "
                                     "B <= 29"))
        << bad;
  }
  EXPECT_EQ(ParseEvalScheme("kivi9@0", 30).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(EvalRunnerTest, CodebooksPerLayerAndHead) {
  auto spec = QuantSpec::Parse("kivi2:g32:r32:nuq");
  ASSERT_TRUE(spec.ok());
  auto codebooks = LearnCodebooks(*model_, Text(), *spec, 32);
  ASSERT_TRUE(codebooks.ok()) << codebooks.status();
  ASSERT_EQ(codebooks->size(), 90u);
  const StreamConfig config = MakeStreamConfig(model_->config().cache_shape(), *spec);
  for (const Codebook& cb : *codebooks) EXPECT_TRUE(cb.Validate(config).ok());
  auto cache = KvqAttentionCache::Create(model_->config().cache_shape(), *spec, &*codebooks,
                                         &CpuBackend());
  EXPECT_TRUE(cache.ok()) << cache.status();
  auto missing = KvqAttentionCache::Create(model_->config().cache_shape(), *spec, nullptr,
                                           &CpuBackend());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq::eval
