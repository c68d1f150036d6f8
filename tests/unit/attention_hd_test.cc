// The attention math the CUDA kernels and cuda_host share
// (kernels/hd/attention_hd.h) against the host truth: Rope::Apply,
// HadamardRotation, MergeAttention (bit for bit on the host) and a
// double-precision softmax.
#include "kernels/hd/attention_hd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/hadamard.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"
#include "kernels/rope.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

hd::RopeParams ParamsOf(const Rope& rope) {
  const RopeConfig& c = rope.config();
  const bool linear = c.scaling == RopeConfig::Scaling::kLinear;
  return hd::MakeRopeParams(c.theta, rope.rotary_dim(), c.pairing == RopeConfig::Pairing::kAdjacent,
                            c.scaling == RopeConfig::Scaling::kNtk, linear ? c.factor : 1.0f,
                            c.factor);
}

TEST(AttentionHdTest, RopeEqualsRopeApplyForEveryPairingRotaryDimAndScaling) {
  struct Case {
    int head_dim, rotary_dim;
    RopeConfig::Pairing pairing;
    RopeConfig::Scaling scaling;
    float factor, theta;
  };
  const Case cases[] = {
      {128, 0, RopeConfig::Pairing::kHalfSplit, RopeConfig::Scaling::kNone, 1.0f, 10000.0f},
      {128, 0, RopeConfig::Pairing::kAdjacent, RopeConfig::Scaling::kNone, 1.0f, 500000.0f},
      {128, 96, RopeConfig::Pairing::kHalfSplit, RopeConfig::Scaling::kLinear, 4.0f, 10000.0f},
      {64, 32, RopeConfig::Pairing::kAdjacent, RopeConfig::Scaling::kNtk, 8.0f, 10000.0f},
      {64, 0, RopeConfig::Pairing::kHalfSplit, RopeConfig::Scaling::kNtk, 2.0f, 1000000.0f},
  };
  for (const Case& c : cases) {
    RopeConfig config;
    config.rotary_dim = c.rotary_dim;
    config.pairing = c.pairing;
    config.scaling = c.scaling;
    config.factor = c.factor;
    config.theta = c.theta;
    ASSERT_TRUE(config.Validate(c.head_dim).ok());
    const Rope rope(config, c.head_dim);
    const hd::RopeParams params = ParamsOf(rope);
    for (int position : {0, 1, 7, 255, 4097, 32767, 131071}) {
      const std::vector<float> x = testutil::MakeGaussian(c.head_dim, 10 + position);
      std::vector<float> want = x, got = x;
      rope.Apply(want.data(), position);
      hd::ApplyRope(params, got.data(), position);
      for (int i = 0; i < c.head_dim; ++i) {
        // The same double angles and float products: the same bits.
        ASSERT_EQ(got[i], want[i]) << "head_dim " << c.head_dim << " rotary " << c.rotary_dim
                                   << " position " << position << " channel " << i;
      }
    }
  }
}

// The device reduces the angle in double, then takes float sincos: at long
// positions this stays within a few float ulps of the double result, where
// a float angle alone would not.
TEST(AttentionHdTest, AngleReducedInDoubleKeepsSinCosAccurateAtLongPositions) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  double worst_reduced = 0.0, worst_float_angle = 0.0;
  for (int position : {1000, 32767, 131071}) {
    for (int i = 0; i < 64; i += 7) {
      const double a = position * std::pow(10000.0, -2.0 * i / 128);
      const double r = a - std::rint(a * (1.0 / kTwoPi)) * kTwoPi;
      worst_reduced = std::max(worst_reduced, std::fabs(std::sin(static_cast<float>(r)) - std::sin(a)));
      worst_float_angle = std::max(
          worst_float_angle, std::fabs(std::sin(static_cast<float>(position) * static_cast<float>(std::pow(10000.0, -2.0 * i / 128))) - std::sin(a)));
    }
  }
  EXPECT_LE(worst_reduced, 4e-7);
  EXPECT_GT(worst_float_angle, 1e-4) << "float angles alone would have been accurate enough";
}

TEST(AttentionHdTest, HadamardEqualsHadamardRotation) {
  for (int d : {32, 64, 128, 256}) {
    const HadamardRotation rotation(d, 0x6b7671u + d);
    std::vector<float> x = testutil::MakeGaussian(d, d), want = x, got = x;
    rotation.Forward(want.data());
    hd::HadamardForward(rotation.signs().data(), d, got.data());
    for (int i = 0; i < d; ++i) ASSERT_EQ(got[i], want[i]) << "forward, d " << d << " channel " << i;
    rotation.Inverse(want.data());
    hd::HadamardInverse(rotation.signs().data(), d, got.data());
    for (int i = 0; i < d; ++i) ASSERT_EQ(got[i], want[i]) << "inverse, d " << d << " channel " << i;
    for (int i = 0; i < d; ++i) EXPECT_NEAR(got[i], x[i], 1e-5) << "round trip, d " << d;
  }
}

// hd::MergePartials against kvq::MergeAttention: the same bits, including
// empty partials and lse gaps that underflow one weight.
TEST(AttentionHdTest, MergeEqualsMergeAttentionBitForBit) {
  constexpr int d = 16;
  const std::vector<float> a = testutil::MakeGaussian(d, 1), b = testutil::MakeGaussian(d, 2);
  const std::pair<float, float> lses[] = {
      {0.5f, 1.25f}, {-3.0f, 40.0f}, {1000.0f, 1000.0f}, {0.0f, 200.0f}, {200.0f, 0.0f},
      {-200.0f, 5.0f}, {87.0f, -87.0f}, {-kInf, 2.0f}, {3.0f, -kInf}, {-kInf, -kInf},
      {1e30f, 1e30f}, {-1e30f, 1e30f}};
  for (auto [la, lb] : lses) {
    std::vector<float> want(d), got(d);
    float want_lse = 0.0f, got_lse = 0.0f;
    MergeAttention(a.data(), la, b.data(), lb, d, want.data(), &want_lse);
    hd::MergePartials(a.data(), la, b.data(), lb, d, got.data(), &got_lse);
    EXPECT_EQ(std::memcmp(&got_lse, &want_lse, sizeof(float)), 0)
        << "lse " << la << ", " << lb << ": " << got_lse << " vs " << want_lse;
    for (int c = 0; c < d; ++c) {
      ASSERT_EQ(got[c], want[c]) << "lse " << la << ", " << lb << " channel " << c;
    }
    // In place, as the kernels merge into their running partial.
    std::vector<float> running = a;
    float running_lse = 0.0f;
    hd::MergePartials(running.data(), la, b.data(), lb, d, running.data(), &running_lse);
    for (int c = 0; c < d; ++c) ASSERT_EQ(running[c], want[c]) << "in place, channel " << c;
  }
}

TEST(AttentionHdTest, MergeEdgeCases) {
  constexpr int d = 4;
  const float a[d] = {1, 2, 3, 4}, b[d] = {-1, 0, 5, 9};
  float out[d], lse;
  hd::MergePartials(a, -kInf, b, -kInf, d, out, &lse);
  EXPECT_EQ(lse, -kInf) << "both empty";
  for (float x : out) EXPECT_EQ(x, 0.0f);
  hd::MergePartials(a, -kInf, b, 1.5f, d, out, &lse);
  EXPECT_EQ(lse, 1.5f) << "a empty";
  for (int c = 0; c < d; ++c) EXPECT_EQ(out[c], b[c]);
  hd::MergePartials(a, 1.5f, b, -kInf, d, out, &lse);
  EXPECT_EQ(lse, 1.5f) << "b empty";
  for (int c = 0; c < d; ++c) EXPECT_EQ(out[c], a[c]);
  hd::MergePartials(a, 0.0f, b, 300.0f, d, out, &lse);  // exp(-300) underflows float.
  EXPECT_EQ(lse, 300.0f) << "huge gap";
  for (int c = 0; c < d; ++c) EXPECT_EQ(out[c], b[c]);
}

struct Softmax64 {
  std::vector<double> out;
  double lse;
};
Softmax64 DoubleSoftmax(const std::vector<float>& scores, const std::vector<float>& values, int d) {
  double mx = -std::numeric_limits<double>::infinity();
  for (float s : scores) mx = std::max(mx, static_cast<double>(s));
  Softmax64 r{std::vector<double>(d, 0.0), -std::numeric_limits<double>::infinity()};
  if (mx == -std::numeric_limits<double>::infinity()) return r;
  double sum = 0.0;
  for (size_t t = 0; t < scores.size(); ++t) {
    const double p = std::exp(scores[t] - mx);
    sum += p;
    for (int c = 0; c < d; ++c) r.out[c] += p * values[t * d + c];
  }
  for (double& x : r.out) x /= sum;
  r.lse = mx + std::log(sum);
  return r;
}

// Scores drawn to move the running max often (a rising trend with noise),
// some masked to -inf; one score at a time and a tile at a time.
TEST(AttentionHdTest, OnlineSoftmaxMatchesDoubleSoftmax) {
  constexpr int d = 8, n = 300, tile = 32;
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0.0f, 3.0f);
  std::vector<float> scores(n);
  for (int t = 0; t < n; ++t) scores[t] = (t % 17 == 3) ? -kInf : 0.05f * t + noise(rng);
  const std::vector<float> values = testutil::MakeGaussian(static_cast<size_t>(n) * d, 6);
  const Softmax64 want = DoubleSoftmax(scores, values, d);

  hd::SoftmaxState one;
  std::vector<float> acc(d, 0.0f);
  for (int t = 0; t < n; ++t) {
    const hd::SoftmaxStep step = hd::SoftmaxPush(&one, scores[t]);
    for (int c = 0; c < d; ++c) acc[c] = acc[c] * step.rescale + step.weight * values[t * d + c];
  }
  EXPECT_NEAR(hd::SoftmaxLse(one), want.lse, 1e-5 * std::fabs(want.lse));
  for (int c = 0; c < d; ++c) EXPECT_NEAR(acc[c] * hd::SoftmaxOutScale(one), want.out[c], 1e-5);

  hd::SoftmaxState tiled;
  std::fill(acc.begin(), acc.end(), 0.0f);
  std::vector<float> weights(tile);
  for (int t0 = 0; t0 < n; t0 += tile) {
    const int m = std::min(tile, n - t0);
    const float rescale = hd::SoftmaxPushTile(&tiled, &scores[t0], m, weights.data());
    for (int c = 0; c < d; ++c) {
      float a = acc[c] * rescale;
      for (int j = 0; j < m; ++j) a += weights[j] * values[(t0 + j) * d + c];
      acc[c] = a;
    }
  }
  EXPECT_NEAR(hd::SoftmaxLse(tiled), want.lse, 1e-5 * std::fabs(want.lse));
  for (int c = 0; c < d; ++c) EXPECT_NEAR(acc[c] * hd::SoftmaxOutScale(tiled), want.out[c], 1e-5);
}

TEST(AttentionHdTest, SoftmaxOfNothingIsEmptyAndOverflowIsNotFinite) {
  hd::SoftmaxState state;
  EXPECT_EQ(hd::SoftmaxLse(state), -kInf) << "no scores";
  EXPECT_EQ(hd::SoftmaxOutScale(state), 0.0f);
  const hd::SoftmaxStep masked = hd::SoftmaxPush(&state, -kInf);
  EXPECT_EQ(masked.weight, 0.0f);
  EXPECT_EQ(masked.rescale, 1.0f);
  EXPECT_EQ(hd::SoftmaxLse(state), -kInf) << "only masked scores";
  float weights[2];
  EXPECT_EQ(hd::SoftmaxPushTile(&state, std::vector<float>{-kInf, -kInf}.data(), 2, weights), 1.0f);
  EXPECT_EQ(weights[0], 0.0f);
  EXPECT_EQ(hd::SoftmaxLse(state), -kInf);
  // A score that overflowed to +inf poisons the row (CheckAttentionResults
  // then fails the call) instead of giving a finite answer.
  hd::SoftmaxPush(&state, 1.0f);
  hd::SoftmaxPush(&state, kInf);
  EXPECT_FALSE(std::isfinite(hd::SoftmaxLse(state)));
}

// The tensor-core kernel's dequantization of 2- and 4-bit codes: the quads
// cover every channel once, a quad's code bytes are hd::CodeAt's codes,
// 0x6400 | code is 1024 + code exactly, its parameter offsets hold
// hd::ParamsAt's scale and zero, and scale * code + zero rounded once to
// fp16 (what HFMA2 gives) is DequantElement's value within fp16 rounding.
// The tensor-core kernel's fp16 operands stay finite: a query row past
// fp16's range is scaled by the smallest power of two that brings it under
// kHalfQueryLimit (so its fp16 copy is finite and the scale is exact), and
// keys and values are clamped to +-65504.
// The merge kernel's one-step merge of n partials equals folding them
// pairwise (MergePartials, MergeAttention's arithmetic) up to rounding,
// empty partials included; all empty gives zeros and -inf.
TEST(AttentionHdTest, MergeSplitsEqualsPairwiseMerge) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  constexpr int d = 16;
  for (int n : {1, 2, 5, 128}) {
    SCOPED_TRACE(n);
    std::vector<float> outs(static_cast<size_t>(n) * d), lses(n);
    for (float& x : outs) x = normal(rng);
    for (int s = 0; s < n; ++s) lses[s] = s % 3 == 1 ? -kInf : normal(rng);
    std::vector<float> fold(d, 0.0f), got(d);
    float fold_lse = -kInf, got_lse = 0.0f;
    for (int s = 0; s < n; ++s) {
      hd::MergePartials(fold.data(), fold_lse, &outs[static_cast<size_t>(s) * d], lses[s], d,
                        fold.data(), &fold_lse);
    }
    hd::MergeSplits(outs.data(), lses.data(), n, d, got.data(), &got_lse);
    EXPECT_NEAR(got_lse, fold_lse, 1e-5f);
    for (int c = 0; c < d; ++c) EXPECT_NEAR(got[c], fold[c], 1e-5f * (1.0f + std::fabs(fold[c])));
  }
  std::vector<float> outs(3 * d, 1.0f), lses(3, -kInf), got(d, 7.0f);
  float lse = 0.0f;
  hd::MergeSplits(outs.data(), lses.data(), 3, d, got.data(), &lse);
  EXPECT_EQ(lse, -kInf);
  EXPECT_EQ(got, std::vector<float>(d, 0.0f));
}

// Split boundaries fall on page starts (origin at or before key_begin,
// less than a page before it), every split is non-empty and the splits
// tile [key_begin, key_end) exactly.
TEST(AttentionHdTest, SplitsTileTheKeysOnPageBoundaries) {
  for (int page_tokens : {16, 32, 128}) {
    for (int page_base : {0, 4}) {
      for (int key_begin : {0, 3, page_base, page_base + 5, page_base + page_tokens, 1000}) {
        for (int key_end : {key_begin + 1, key_begin + 700, 40000}) {
          const int st = hd::SplitTokensAtLeast(256, page_tokens);
          ASSERT_EQ(st % page_tokens, 0);
          ASSERT_GE(st, 256);
          const int origin = hd::SplitOrigin(key_begin, page_base, page_tokens);
          ASSERT_LE(origin, key_begin);
          ASSERT_GT(origin + page_tokens, key_begin);
          ASSERT_EQ(((origin - page_base) % page_tokens + page_tokens) % page_tokens, 0);
          const int n = hd::SplitCount(origin, key_begin, key_end, st);
          int next = key_begin;
          for (int s = 0; s < n; ++s) {
            const int b = hd::SplitBegin(origin, key_begin, s, st);
            const int e = hd::SplitEnd(origin, key_end, s, st);
            ASSERT_EQ(b, next);
            ASSERT_LT(b, e) << "split " << s << " of " << n;
            if (s > 0) ASSERT_EQ(((b - page_base) % page_tokens + page_tokens) % page_tokens, 0);
            next = e;
          }
          ASSERT_EQ(next, key_end);
        }
      }
    }
  }
  EXPECT_EQ(hd::SplitCount(0, 5, 5, 256), 0);
}

TEST(AttentionHdTest, HalfOperandsOfLargeValuesStayFinite) {
  for (float max_abs : {0.0f, 1.0f, 32768.0f, 32769.0f, 65504.0f, 65520.0f, 1.0e6f, 1.0e30f,
                        std::numeric_limits<float>::max()}) {
    SCOPED_TRACE(max_abs);
    const float s = hd::HalfQueryScale(max_abs);
    int e = 0;
    EXPECT_EQ(std::frexp(s, &e), 0.5f) << "a power of two";
    EXPECT_LE(max_abs * s, hd::kHalfQueryLimit);
    if (max_abs <= hd::kHalfQueryLimit) {
      EXPECT_EQ(s, 1.0f) << "queries in range are left alone";
    } else {
      EXPECT_GT(max_abs * s * 2.0f, hd::kHalfQueryLimit) << "the smallest power that fits";
    }
    EXPECT_TRUE(std::isfinite(hd::HalfToFloat(hd::FloatToHalf(max_abs * s))));
    // The scores undo the scale in fp32, exactly: a power of two.
    EXPECT_EQ(hd::HalfQueryUnscale(s) * s, 1.0f);
    EXPECT_EQ((max_abs * s) * hd::HalfQueryUnscale(s), max_abs);
  }
  EXPECT_EQ(hd::HalfQueryScale(kInf), 0.0f) << "ends instead of looping";
  for (float x : {70000.0f, 65520.0f, 1.0e30f, kInf}) {
    EXPECT_EQ(hd::ClampToHalfRange(x), 65504.0f);
    EXPECT_EQ(hd::ClampToHalfRange(-x), -65504.0f);
    EXPECT_TRUE(std::isfinite(hd::HalfToFloat(hd::FloatToHalf(hd::ClampToHalfRange(x)))));
  }
  EXPECT_EQ(hd::ClampToHalfRange(-1.5f), -1.5f);
  EXPECT_EQ(hd::ClampToHalfRange(65504.0f), 65504.0f);
}

TEST(AttentionHdTest, QuadDequantMatchesDequantElement) {
  const testutil::SchemeCase cases[] = {
      {"kivi4", 128, {}, ""}, {"kivi2", 64, {}, ""}, {"kivi4:g64", 64, {}, ""},
      {"kivi2:ktok", 64, {}, ""}, {"kivi2:v4:outliers=1", 64, {}, ""}, {"kivi4:g16:r16", 128, {}, ""}};
  for (const testutil::SchemeCase& sc : cases) {
    SCOPED_TRACE(sc.spec);
    std::unique_ptr<KvStream> s = testutil::MakeStream({"ref", sc});
    ASSERT_NE(s, nullptr);
    const int d = sc.head_dim;
    const int n = s->spec().sink + 2 * s->layout().page_tokens + s->spec().flush_tokens();
    ASSERT_TRUE(testutil::AppendRows(*s, testutil::MakeKeys(n, d, 70), testutil::MakeValues(n, d, 70), 0, n).ok());
    ASSERT_GE(s->num_pages(), 1);
    const PageLayout& L = s->layout();
    int sides_taken = 0;
    for (Side side : {Side::kKey, Side::kValue}) {
      const SideLayout& S = L.side(side);
      const hd::SideExtras extras;
      if (!hd::QuadDequantTakes(L, S, extras)) continue;
      ++sides_taken;
      const uint8_t* page = s->page(0);
      for (int row = 0; row < L.page_tokens; ++row) {
        std::vector<int> seen(d, 0);
        for (int qi = 0; qi < d / 4; ++qi) {
          int m, quad;
          hd::QuadOf(d, S.bits, qi, &m, &quad);
          const int c = hd::QuadChannel(d, S.bits, m, quad);
          ASSERT_TRUE(c >= 0 && c + 3 < d && c % 4 == 0) << "quad " << qi << " channel " << c;
          const uint32_t codes = hd::QuadCodes(PageLayout::CodeRow(page, S, row), S.bits, m, quad);
          const hd::QuadParams at = hd::QuadParamsAt(L, S, row, c);
          for (int k = 0; k < 4; ++k) {
            ++seen[c + k];
            const int code = (codes >> (8 * k)) & 0xff;
            ASSERT_EQ(code, hd::CodeAt(PageLayout::CodeRow(page, S, row), d, S.bits, c + k))
                << "row " << row << " channel " << c + k;
            ASSERT_EQ(HalfToFloat(static_cast<uint16_t>(hd::kHalfMagic1024 | code)) - 1024.0f, code);
            const size_t step = at.per_channel ? 2 * k : 0;
            const float scale = HalfToFloat(hd::LoadHalfBits(page + at.scale + step));
            const float zero = HalfToFloat(hd::LoadHalfBits(page + at.zero + step));
            const hd::ScaleZero want = hd::ParamsAt(L, S, page, row, c + k);
            ASSERT_EQ(scale, want.scale) << "row " << row << " channel " << c + k;
            ASSERT_EQ(zero, want.zero) << "row " << row << " channel " << c + k;
            const float fp16 = RoundToHalf(static_cast<float>(static_cast<double>(scale) * code + zero));
            const float ref = hd::DequantElement(L, S, page, row, c + k, extras);
            EXPECT_LE(std::fabs(fp16 - ref), std::ldexp(std::fabs(ref), -11) + 6e-8)
                << "row " << row << " channel " << c + k;
          }
        }
        for (int c = 0; c < d; ++c) ASSERT_EQ(seen[c], 1) << "channel " << c << " row " << row;
      }
    }
    EXPECT_GT(sides_taken, 0) << "no side of " << sc.spec << " takes the quad dequantization";
  }
}

}  // namespace
}  // namespace kvq
