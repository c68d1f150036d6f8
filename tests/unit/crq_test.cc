// crq (calibrated rotated quantization): its Lloyd-Max levels, the
// calibration transform, and every backend against the reference and the
// float math (round trip, attention in the coded space, bytes, raw pages,
// forks, the error contract).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/accounting.h"
#include "kernels/backend.h"
#include "kernels/cpu/simd_crq.h"
#include "kernels/cpu/simd_dispatch.h"
#include "kernels/crq_transform.h"
#include "kernels/hd/crq_hd.h"
#include "kernels/lloyd_max.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::MakeGaussian;
using testutil::MakeKeys;
using testutil::MakeValues;

// --- The codebook. ---

TEST(LloydMaxTest, LevelsAreSymmetricSortedAndOptimal) {
  // MSE of the Lloyd-Max quantizer of N(0, 1) (Max 1960; Lloyd 1982).
  const double known[5] = {0.0, 0.3634, 0.1175, 0.03454, 0.009497};
  for (int bits = 1; bits <= 4; ++bits) {
    const LloydMaxCodebook& cb = LloydMax(bits);
    const int n = 1 << bits;
    ASSERT_EQ(cb.levels.size(), static_cast<size_t>(n));
    ASSERT_EQ(cb.thresholds.size(), static_cast<size_t>(n - 1));
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(cb.levels[i], -cb.levels[n - 1 - i]) << bits << " bits, level " << i;
      if (i > 0) EXPECT_LT(cb.levels[i - 1], cb.levels[i]) << bits << " bits";
    }
    EXPECT_NEAR(cb.mse, known[bits], 0.01 * known[bits]) << bits << " bits";
    // The same MSE measured: 400k N(0, 1) samples coded to their nearest level.
    const std::vector<float> x = MakeGaussian(400000, 7 + bits);
    double err = 0.0;
    for (float e : x) {
      int code = 0;
      for (float t : cb.thresholds) code += e > t;
      err += (e - cb.levels[code]) * (e - cb.levels[code]);
    }
    EXPECT_NEAR(err / x.size(), known[bits], 0.02 * known[bits]) << bits << " bits, sampled";
  }
}

// --- The scheme on every backend. ---

struct CrqCase {
  std::string spec;
  int head_dim;
  RopeConfig rope;
  std::string label;
};

RopeConfig Rope(RopeConfig::Pairing pairing, int rotary_dim) {
  RopeConfig r;
  r.pairing = pairing;
  r.rotary_dim = rotary_dim;
  return r;
}

std::vector<CrqCase> Cases() {
  using P = RopeConfig::Pairing;
  return {
      {"crq3:pre_rope", 128, Rope(P::kHalfSplit, 0), "crq3_d128_half"},
      {"crq2.5:r16:pre_rope", 64, Rope(P::kAdjacent, 32), "crq2_5_r16_d64_adj_rot32"},
      {"crq4:v2:r0:pre_rope:sink=4", 128, Rope(P::kHalfSplit, 96), "crq4_v2_r0_sink4_d128_rot96"},
      {"crq3.5:v2.5:r32:pre_rope:sink=3", 64, Rope(P::kHalfSplit, 0), "crq3_5_v2_5_r32_sink3_d64"},
      {"crq2:r0:pre_rope", 256, Rope(P::kAdjacent, 0), "crq2_r0_d256_adj"},
  };
}

struct Param {
  std::string backend;
  CrqCase c;
  bool hidden_pages = false;
};

std::vector<Param> Params() {
  std::vector<Param> out;
  // "cuda" where this build has it and a device is present (BackendNames).
  for (const std::string& b : testutil::BackendNames()) {
    for (const CrqCase& c : Cases()) out.push_back({b, c});
  }
  for (const CrqCase& c : Cases()) out.push_back({"cuda_host", c, true});
  return out;
}

testutil::StreamParam AsStreamParam(const Param& p) {
  testutil::SchemeCase sc;
  sc.spec = p.c.spec;
  sc.head_dim = p.c.head_dim;
  sc.rope = p.c.rope;
  sc.rope_label = p.c.label;
  return {p.backend, sc, p.hidden_pages};
}

class CrqBackendTest : public ::testing::TestWithParam<Param> {
 protected:
  StreamConfig Config() const { return AsStreamParam(GetParam()).scheme.Config(); }
  std::unique_ptr<KvStream> Make() const { return testutil::MakeStream(AsStreamParam(GetParam())); }
  std::unique_ptr<KvStream> MakeRef() const {
    testutil::StreamParam p = AsStreamParam(GetParam());
    p.backend = "ref";
    p.hidden_pages = false;
    return testutil::MakeStream(p);
  }
  int d() const { return GetParam().c.head_dim; }
};

// Appends rows [0, n) of k, v in uneven runs.
void Fill(KvStream& s, const std::vector<float>& k, const std::vector<float>& v, int n) {
  int t = 0, step = 5;
  while (t < n) {
    const int m = std::min(step, n - t);
    ASSERT_TRUE(testutil::AppendRows(s, k, v, t, t + m).ok());
    t += m;
    step = step * 2 + 1;
  }
}

double MeanSquare(const std::vector<float>& a) {
  double s = 0.0;
  for (float x : a) s += static_cast<double>(x) * x;
  return s / a.size();
}

TEST_P(CrqBackendTest, ReadsBackWhatTheReferenceReads) {
  const int n = 150;
  const std::vector<float> k = MakeKeys(n, d(), 21), v = MakeValues(n, d(), 22);
  std::unique_ptr<KvStream> s = Make(), ref = MakeRef();
  ASSERT_TRUE(s && ref);
  Fill(*s, k, v, n);
  Fill(*ref, k, v, n);
  ASSERT_EQ(s->quantized_tokens(), ref->quantized_tokens());
  for (Side side : {Side::kKey, Side::kValue}) {
    for (bool rope : {true, false}) {
      const std::vector<float> got = testutil::ReadSide(*s, side, 0, n, rope);
      const std::vector<float> want = testutil::ReadSide(*ref, side, 0, n, rope);
      std::vector<float> diff(got.size());
      for (size_t i = 0; i < got.size(); ++i) diff[i] = got[i] - want[i];
      // Codes may differ only where a coordinate sits on a decision
      // threshold (float vs fp64 sums): a rare level apart.
      EXPECT_LT(MeanSquare(diff), 1e-4 * MeanSquare(want))
          << (side == Side::kKey ? "keys" : "values") << (rope ? " post-RoPE" : " pre-RoPE");
    }
  }
  // Sink and tail rows are fp16 as appended.
  const std::vector<float> keys = testutil::ReadSide(*s, Side::kKey, 0, n, false);
  for (int t = 0; t < n; ++t) {
    if (testutil::PlaceOf(*s, t) == testutil::Place::kPage) continue;
    for (int c = 0; c < d(); ++c) {
      const float x = k[static_cast<size_t>(t) * d() + c];
      ASSERT_NEAR(keys[static_cast<size_t>(t) * d() + c], x, std::fabs(x) * 1e-3 + 1e-6);
    }
  }
}

// With an identity calibration and Gaussian data, the rotated coordinates
// are Gaussian and the round trip's relative MSE is the Lloyd-Max MSE of
// the coordinates' widths (the least-squares gain can only lower it).
TEST_P(CrqBackendTest, IdentityCalibrationRoundTripHasLloydMaxError) {
  StreamConfig config = Config();
  const HeadCalibration id = HeadCalibration::Identity(d());
  const KernelBackend* backend = *BackendByName(GetParam().backend);
  PageAllocator* alloc = testutil::DefaultPages(AsStreamParam(GetParam()));
  absl::StatusOr<std::unique_ptr<KvStream>> s = KvStream::Create(config, backend, alloc, nullptr, &id);
  ASSERT_TRUE(s.ok()) << s.status();
  const int n = config.spec.sink + 512;
  const std::vector<float> k = MakeGaussian(static_cast<size_t>(n) * d(), 31);
  const std::vector<float> v = MakeGaussian(static_cast<size_t>(n) * d(), 32);
  ASSERT_TRUE(testutil::AppendRows(**s, k, v, 0, n).ok());
  const int first = config.spec.sink;
  const int last = first + (*s)->quantized_tokens();
  ASSERT_GE(last - first, 256);
  for (Side side : {Side::kKey, Side::kValue}) {
    const std::vector<float>& x = side == Side::kKey ? k : v;
    const std::vector<float> got = testutil::ReadSide(**s, side, first, last, false);
    double err = 0.0, mag = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double e = got[i] - x[static_cast<size_t>(first) * d() + i];
      err += e * e;
      mag += x[static_cast<size_t>(first) * d() + i] * x[static_cast<size_t>(first) * d() + i];
    }
    const int hb = config.spec.crq_half_bits(side == Side::kKey);
    const double expected = 0.5 * (LloydMax((hb + 1) / 2).mse + LloydMax(hb / 2).mse);
    EXPECT_NEAR(err / mag, expected, 0.12 * expected)
        << (side == Side::kKey ? "keys" : "values") << " at " << hb / 2.0 << " bits";
  }
}

// One task over `s`: queries [query][group][d] at positions `pos`, outputs
// laid out alike.
AttentionTask CausalTask(const KvStream& s, const std::vector<float>& q,
                         const std::vector<int32_t>& pos, int group, std::vector<float>& out,
                         std::vector<float>& lse) {
  AttentionTask t;
  t.stream = &s;
  t.num_queries = static_cast<int>(pos.size());
  t.q = q.data();
  t.q_stride = group * s.head_dim();
  t.q_positions = pos.data();
  t.out = out.data();
  t.out_stride = group * s.head_dim();
  t.lse = lse.data();
  t.lse_stride = group;
  return t;
}

// Attention in the coded space equals fp64 attention over what Read()
// returns (post-RoPE keys, values), up to float rounding; split key ranges
// merge by their log-sum-exp.
TEST_P(CrqBackendTest, AttentionEqualsAttentionOverDequantizedRows) {
  const int n = 300;
  const std::vector<float> k = MakeKeys(n, d(), 41), v = MakeValues(n, d(), 42);
  std::unique_ptr<KvStream> s = Make();
  ASSERT_TRUE(s);
  Fill(*s, k, v, n);
  const std::vector<float> keys = testutil::ReadSide(*s, Side::kKey, 0, n, true);
  const std::vector<float> values = testutil::ReadSide(*s, Side::kValue, 0, n, true);
  const int group = 2, queries = 3;
  const std::vector<float> q = MakeGaussian(static_cast<size_t>(queries) * group * d(), 43);
  const std::vector<int32_t> pos = {n - 1, n / 2, 3};
  std::vector<float> out(q.size()), lse(queries * group);
  const AttentionTask t = CausalTask(*s, q, pos, group, out, lse);
  AttentionOptions o;
  o.group_size = group;
  ASSERT_TRUE(s->backend()->Attend({&t, 1}, o).ok());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d()));
  for (int i = 0; i < queries; ++i) {
    for (int g = 0; g < group; ++g) {
      const float* qi = q.data() + (static_cast<size_t>(i) * group + g) * d();
      const testutil::Attention64 want =
          testutil::ReferenceAttention(qi, keys.data(), values.data(), 0, pos[i] + 1, d(), scale);
      EXPECT_LT(testutil::RelativeError(out.data() + (static_cast<size_t>(i) * group + g) * d(),
                                        want.out),
                1e-4)
          << "query " << i << " head " << g;
      EXPECT_NEAR(lse[i * group + g], want.lse, 1e-4 * std::max(1.0, std::fabs(want.lse)));
    }
  }
  // Two halves of the range merge into the whole.
  std::vector<float> oa(d()), ob(d()), om(d());
  float la, lb, lm;
  for (auto [begin, end, o_, l_] : {std::tuple{0, 137, oa.data(), &la},
                                    std::tuple{137, n, ob.data(), &lb}}) {
    AttentionTask p = t;
    p.key_begin = begin;
    p.key_end = end;
    p.num_queries = 1;
    p.q_positions = nullptr;
    p.out = o_;
    p.lse = l_;
    p.out_stride = d();
    AttentionOptions one;
    ASSERT_TRUE(s->backend()->Attend({&p, 1}, one).ok());
  }
  MergeAttention(oa.data(), la, ob.data(), lb, d(), om.data(), &lm);
  const testutil::Attention64 whole =
      testutil::ReferenceAttention(q.data(), keys.data(), values.data(), 0, n, d(), scale);
  EXPECT_LT(testutil::RelativeError(om.data(), whole.out), 1e-4);
  EXPECT_NEAR(lm, whole.lse, 1e-4 * std::max(1.0, std::fabs(whole.lse)));
}

// A prefill chunk's many queries: blocks of queries share decoded tiles of
// keys, key ranges span several chunks, and visible ends fall anywhere (in
// the sink, on and off tile edges, in the fp16 tail). Every row equals fp64
// attention over the dequantized rows, as a single query does.
TEST_P(CrqBackendTest, ManyQueriesEqualAttentionOverDequantizedRows) {
  const int n = 1200;
  const std::vector<float> k = MakeKeys(n, d(), 61), v = MakeValues(n, d(), 62);
  std::unique_ptr<KvStream> s = Make();
  ASSERT_TRUE(s);
  Fill(*s, k, v, n);
  const std::vector<float> keys = testutil::ReadSide(*s, Side::kKey, 0, n, true);
  const std::vector<float> values = testutil::ReadSide(*s, Side::kValue, 0, n, true);
  const int group = 3, queries = 41;
  const std::vector<float> q = MakeGaussian(static_cast<size_t>(queries) * group * d(), 63);
  std::vector<int32_t> pos(queries);
  std::mt19937 rng(64);
  for (int i = 0; i < queries; ++i) pos[i] = static_cast<int32_t>(rng() % n);
  pos[0] = 0;
  pos[1] = 2;
  pos[2] = 511;
  pos[3] = 512;
  pos[4] = n - 1;
  for (int i = 5; i < 12; ++i) pos[i] = n - 12 + i;  // Consecutive, as a chunk's.
  std::vector<float> out(q.size()), lse(queries * group);
  const AttentionTask t = CausalTask(*s, q, pos, group, out, lse);
  AttentionOptions o;
  o.group_size = group;
  ASSERT_TRUE(s->backend()->Attend({&t, 1}, o).ok());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d()));
  for (int i = 0; i < queries; ++i) {
    for (int g = 0; g < group; ++g) {
      const size_t row = static_cast<size_t>(i) * group + g;
      const testutil::Attention64 want = testutil::ReferenceAttention(
          q.data() + row * d(), keys.data(), values.data(), 0, pos[i] + 1, d(), scale);
      ASSERT_LT(testutil::RelativeError(out.data() + row * d(), want.out), 1e-4)
          << "query " << i << " at " << pos[i] << " head " << g;
      ASSERT_NEAR(lse[row], want.lse, 1e-4 * std::max(1.0, std::fabs(want.lse)))
          << "query " << i << " at " << pos[i] << " head " << g;
    }
  }
}

// Against the original K/V, a backend's attention error may exceed the
// reference's by 10% (backend.h's contract). The reference's own error is
// bounded loosely (a random query over N(0, 1) values has a small output, so
// the relative error of 2-bit values is near 0.5): a sanity bound.
TEST_P(CrqBackendTest, AttentionErrorAgainstOriginalWithinContract) {
  const int n = 400;
  const std::vector<float> k = MakeKeys(n, d(), 51), v = MakeValues(n, d(), 52);
  std::unique_ptr<KvStream> s = Make(), ref = MakeRef();
  ASSERT_TRUE(s && ref);
  Fill(*s, k, v, n);
  Fill(*ref, k, v, n);
  // Original post-RoPE keys.
  std::vector<float> kpost = k;
  const class Rope rope(Config().rope, d());
  for (int t = 0; t < n; ++t) rope.Apply(&kpost[static_cast<size_t>(t) * d()], t);
  const std::vector<float> q = MakeGaussian(d(), 53);
  auto error = [&](const KvStream& stream) {
    std::vector<float> out(d());
    float lse;
    AttentionTask t;
    t.stream = &stream;
    t.q = q.data();
    t.out = out.data();
    t.lse = &lse;
    EXPECT_TRUE(stream.backend()->Attend({&t, 1}, AttentionOptions{}).ok());
    const testutil::Attention64 want = testutil::ReferenceAttention(
        q.data(), kpost.data(), v.data(), 0, n, d(), 1.0 / std::sqrt(static_cast<double>(d())));
    return testutil::RelativeError(out.data(), want.out);
  };
  const double ref_err = error(*ref), err = error(*s);
  EXPECT_LE(err, 1.1 * ref_err + 1e-5);
  EXPECT_LT(ref_err, 0.6) << "crq's own error on synthetic keys";
}

TEST_P(CrqBackendTest, BytesAreExact) {
  const StreamConfig config = Config();
  std::unique_ptr<KvStream> s = Make();
  ASSERT_TRUE(s);
  const int n = 203;
  Fill(*s, MakeKeys(n, d(), 61), MakeValues(n, d(), 62), n);
  const ByteBreakdown got = s->AllocatedBytes();
  EXPECT_EQ(got, *AnalyticBytes(config, n));
  const QuantSpec& spec = config.spec;
  const int quantized = s->quantized_tokens();
  const int flush = spec.flush_tokens();
  EXPECT_EQ(quantized, (n - spec.sink) / flush * flush);
  auto row_bytes = [&](bool key) {
    const int hb = spec.crq_half_bits(key);
    return static_cast<size_t>(d()) / 2 * ((hb + 1) / 2 + hb / 2) / 8;
  };
  EXPECT_EQ(got.codes, quantized * (row_bytes(true) + row_bytes(false)));
  EXPECT_EQ(got.scales, static_cast<size_t>(quantized) * 2 * 2) << "one fp16 gain per token and side";
  EXPECT_EQ(got.residual, static_cast<size_t>(spec.has_tail() ? spec.residual : 0) * d() * 4);
  EXPECT_EQ(got.sink, static_cast<size_t>(spec.sink) * d() * 4);
  EXPECT_EQ(got.codebook, 0u) << "the levels are constants of the format";
  EXPECT_EQ(got.outliers, 0u);
}

TEST_P(CrqBackendTest, RawPagesAndForksReadTheSame) {
  const int n = 260;
  const std::vector<float> k = MakeKeys(n, d(), 71), v = MakeValues(n, d(), 72);
  std::unique_ptr<KvStream> s = Make();
  ASSERT_TRUE(s);
  Fill(*s, k, v, n);
  const int q = s->quantized_tokens();
  std::vector<uint8_t> pages(static_cast<size_t>(s->PagesFor(q)) * s->layout().page_bytes);
  ASSERT_TRUE(s->CopyPages(0, q, pages.data()).ok());
  // Into a second stream (its sink first), then read back.
  std::unique_ptr<KvStream> t = Make();
  ASSERT_TRUE(t);
  const int sink = s->sink_tokens();
  ASSERT_TRUE(testutil::AppendRows(*t, k, v, 0, sink).ok());
  ASSERT_TRUE(t->AppendPages(pages.data(), q).ok());
  for (Side side : {Side::kKey, Side::kValue}) {
    EXPECT_EQ(testutil::ReadSide(*t, side, 0, sink + q), testutil::ReadSide(*s, side, 0, sink + q));
  }
  // ReadPages reads what Read reads.
  std::vector<float> kr(static_cast<size_t>(q) * d());
  ASSERT_TRUE(s->ReadPages(pages.data(), q, sink, sink, sink + q, ReadOptions{},
                           Floats(kr.data(), q, d()), TensorView{})
                  .ok());
  EXPECT_EQ(kr, testutil::ReadSide(*s, Side::kKey, sink, sink + q));
  // A fork on a flush boundary and a whole fork read as the original.
  for (int len : {sink + q, n}) {
    absl::StatusOr<std::unique_ptr<KvStream>> f = s->Fork(len);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(testutil::ReadSide(**f, Side::kValue, 0, len), testutil::ReadSide(*s, Side::kValue, 0, len));
    EXPECT_EQ(testutil::ReadSide(**f, Side::kKey, 0, len), testutil::ReadSide(*s, Side::kKey, 0, len));
  }
  // A gain that is not finite is refused naming the page, row and field.
  if (q > 0) {
    std::vector<uint8_t> bad = pages;
    const uint16_t inf = 0x7c00;
    std::memcpy(PageLayout::Gain(bad.data(), s->layout().value, 1), &inf, 2);
    std::unique_ptr<KvStream> u = Make();
    ASSERT_TRUE(testutil::AppendRows(*u, k, v, 0, sink).ok());
    const absl::Status st = u->AppendPages(bad.data(), q);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(), "page 0 value row 1: gain must be finite and >= 0");
  }
}

INSTANTIATE_TEST_SUITE_P(All, CrqBackendTest, ::testing::ValuesIn(Params()),
                         [](const auto& info) {
                           return absl::StrCat(info.param.backend,
                                               info.param.hidden_pages ? "_hidden_" : "_",
                                               info.param.c.label);
                         });

// --- The error contract. ---

StreamConfig CrqConfig(const std::string& spec, int head_dim) {
  StreamConfig c;
  c.spec = *QuantSpec::Parse(spec);
  c.head_dim = head_dim;
  return c;
}

TEST(CrqContractTest, NeedsACalibration) {
  const absl::StatusOr<std::unique_ptr<KvStream>> s =
      KvStream::Create(CrqConfig("crq3:pre_rope", 64), &RefBackend());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(),
            "scheme crq3:r128:pre_rope needs a calibration (the HeadCalibration of this "
            "stream's layer and KV head)");
}

TEST(CrqContractTest, KeyScalesMustBeEqualWithinRopePairs) {
  StreamConfig c = CrqConfig("crq3:pre_rope", 64);
  HeadCalibration cal = HeadCalibration::Identity(64);
  cal.key_scale[3] = 2.0f;  // Half-split pairing: 3 pairs with 35.
  absl::StatusOr<std::unique_ptr<KvStream>> s = KvStream::Create(c, &RefBackend(), nullptr, nullptr, &cal);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(),
            "calibration key_scale must be equal within each RoPE pair (scaling must commute "
            "with RoPE): channels 3 and 35 have 2 and 1");
  c.rope.pairing = RopeConfig::Pairing::kAdjacent;  // Now 2 pairs with 3.
  s = KvStream::Create(c, &RefBackend(), nullptr, nullptr, &cal);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(),
            "calibration key_scale must be equal within each RoPE pair (scaling must commute "
            "with RoPE): channels 2 and 3 have 1 and 2");
  c.rope.pairing = RopeConfig::Pairing::kHalfSplit;
  c.rope.rotary_dim = 32;  // Channel 3 pairs with 19 now; 35 does not rotate.
  cal.key_scale[19] = 2.0f;
  cal.key_scale[40] = 5.0f;
  EXPECT_TRUE(KvStream::Create(c, &RefBackend(), nullptr, nullptr, &cal).ok());
  cal.value_scale[7] = 3.0f;  // Value scales are per channel.
  EXPECT_TRUE(KvStream::Create(c, &RefBackend(), nullptr, nullptr, &cal).ok());
}

TEST(CrqContractTest, CalibrationMustFitTheHead) {
  const HeadCalibration cal = HeadCalibration::Identity(128);
  absl::StatusOr<std::unique_ptr<KvStream>> s =
      KvStream::Create(CrqConfig("crq3:pre_rope", 64), &RefBackend(), nullptr, nullptr, &cal);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CrqContractTest, NeedsAPowerOfTwoHeadDim) {
  const HeadCalibration cal = HeadCalibration::Identity(96);
  absl::StatusOr<std::unique_ptr<KvStream>> s =
      KvStream::Create(CrqConfig("crq2.5:pre_rope", 96), &RefBackend(), nullptr, nullptr, &cal);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(),
            "scheme crq needs a power-of-two head_dim (its Hadamard rotation), got 96");
}

// The device's crq kernels are compiled for head_dim 64, 128 and 256: an
// append of another power of two fails with INVALID_ARGUMENT naming the
// limit, and leaves nothing behind.
TEST(CrqContractTest, CudaTakesHeadDim64To256) {
  absl::StatusOr<const KernelBackend*> cuda = BackendByName("cuda");
  if (!cuda.ok()) GTEST_SKIP() << "no cuda backend in this build or no device";
  testutil::StreamParam p;
  p.backend = "cuda";
  p.scheme.spec = "crq3:r0:pre_rope";
  p.scheme.head_dim = 32;
  std::unique_ptr<KvStream> s = testutil::MakeStream(p);
  ASSERT_TRUE(s);
  const std::vector<float> k = MakeKeys(4, 32, 91), v = MakeValues(4, 32, 92);
  const absl::Status st = testutil::AppendRows(*s, k, v, 0, 4);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "head_dim must be 64, 128 or 256 for crq on the device, got 32");
  EXPECT_EQ(s->num_tokens(), 0);
}

// --- Centering. ---

// Keys and values with a large per-channel mean, as real pre-RoPE keys
// have: x = mu + noise with mu_c ~ 4 N(0, 1) (a few channels at 20) and
// noise N(0, 1). A calibration of the exact means ({mu, s = 1}) must code
// only the noise: the coded rows' error is the Lloyd-Max MSE of ||noise||^2,
// below what the identity calibration (which codes mu too) leaves, and so is
// the attention error against fp32 attention over the original K/V.
class CrqCenteringTest : public ::testing::TestWithParam<std::string> {};

struct CenteredData {
  std::vector<float> mu_k, mu_v, k, v;
};

CenteredData MakeCentered(int n, int d) {
  CenteredData x;
  x.mu_k = MakeGaussian(d, 101);
  x.mu_v = MakeGaussian(d, 102);
  for (int c = 0; c < d; ++c) {
    x.mu_k[c] *= c % 16 == 5 ? 20.0f : 4.0f;
    x.mu_v[c] *= 4.0f;
  }
  x.k = MakeGaussian(static_cast<size_t>(n) * d, 103);
  x.v = MakeGaussian(static_cast<size_t>(n) * d, 104);
  for (int t = 0; t < n; ++t) {
    for (int c = 0; c < d; ++c) {
      x.k[static_cast<size_t>(t) * d + c] += x.mu_k[c];
      x.v[static_cast<size_t>(t) * d + c] += x.mu_v[c];
    }
  }
  return x;
}

TEST_P(CrqCenteringTest, CenteringCodesOnlyTheNoise) {
  const int d = 64, n = 4 + 600;
  for (const char* spec : {"crq3:pre_rope:sink=4", "crq3:r0:pre_rope:sink=4"}) {
    StreamConfig config = CrqConfig(spec, d);
    config.rope.pairing = RopeConfig::Pairing::kAdjacent;
    const CenteredData x = MakeCentered(n, d);
    const HeadCalibration id = HeadCalibration::Identity(d);
    HeadCalibration centered = id;
    centered.key_mean = x.mu_k;
    centered.value_mean = x.mu_v;
    const KernelBackend* backend = *BackendByName(GetParam());
    testutil::StreamParam where;
    where.backend = GetParam();
    auto make = [&](const HeadCalibration& cal) {
      absl::StatusOr<std::unique_ptr<KvStream>> s =
          KvStream::Create(config, backend, testutil::DefaultPages(where), nullptr, &cal);
      EXPECT_TRUE(s.ok()) << s.status();
      EXPECT_TRUE(testutil::AppendRows(**s, x.k, x.v, 0, n).ok());
      return std::move(*s);
    };
    std::unique_ptr<KvStream> a = make(id), b = make(centered);
    ASSERT_EQ(a->quantized_tokens(), b->quantized_tokens());
    const int first = config.spec.sink, last = first + b->quantized_tokens();
    ASSERT_GE(last - first, 256) << spec;
    for (Side side : {Side::kKey, Side::kValue}) {
      const std::vector<float>& orig = side == Side::kKey ? x.k : x.v;
      const std::vector<float>& mu = side == Side::kKey ? x.mu_k : x.mu_v;
      auto error = [&](const KvStream& s) {
        const std::vector<float> got = testutil::ReadSide(s, side, first, last, false);
        double err = 0.0;
        for (size_t i = 0; i < got.size(); ++i) {
          const double e = got[i] - orig[static_cast<size_t>(first) * d + i];
          err += e * e;
        }
        return err;
      };
      double noise = 0.0;
      for (int t = first; t < last; ++t) {
        for (int c = 0; c < d; ++c) {
          const double e = orig[static_cast<size_t>(t) * d + c] - mu[c];
          noise += e * e;
        }
      }
      const int hb = config.spec.crq_half_bits(side == Side::kKey);
      const double lloyd = 0.5 * (LloydMax((hb + 1) / 2).mse + LloydMax(hb / 2).mse);
      const double e_id = error(*a), e_centered = error(*b);
      const char* what = side == Side::kKey ? "keys" : "values";
      EXPECT_NEAR(e_centered / noise, lloyd, 0.15 * lloyd) << spec << " " << what;
      EXPECT_LT(e_centered, 0.5 * e_id) << spec << " " << what;
    }
    // Attention error against fp32 attention over the original K/V
    // (keys post-RoPE), for queries along the mean (large scores) and random.
    std::vector<float> kpost = x.k;
    const class Rope rope(config.rope, d);
    for (int t = 0; t < n; ++t) rope.Apply(&kpost[static_cast<size_t>(t) * d], t);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (int trial = 0; trial < 4; ++trial) {
      std::vector<float> q = MakeGaussian(d, 110 + trial);
      const int32_t pos = n - 1 - 37 * trial;
      std::vector<float> qmu = x.mu_k;
      rope.Apply(qmu.data(), pos);
      for (int c = 0; c < d; ++c) q[c] += 0.05f * trial * qmu[c];
      const testutil::Attention64 want =
          testutil::ReferenceAttention(q.data(), kpost.data(), x.v.data(), 0, pos + 1, d, scale);
      auto error = [&](const KvStream& s) {
        std::vector<float> out(d);
        float lse;
        AttentionTask t;
        t.stream = &s;
        t.q = q.data();
        t.q_positions = &pos;
        t.out = out.data();
        t.lse = &lse;
        EXPECT_TRUE(s.backend()->Attend({&t, 1}, AttentionOptions{}).ok());
        return testutil::RelativeError(out.data(), want.out);
      };
      EXPECT_LT(error(*b), error(*a)) << spec << " query " << trial;
    }
  }
}

// Every backend (BackendNames: "cuda" where a device is present).
INSTANTIATE_TEST_SUITE_P(All, CrqCenteringTest, ::testing::ValuesIn(testutil::BackendNames()),
                         [](const auto& info) { return info.param; });

TEST(CrqTransformTest, InverseUndoesForward) {
  StreamConfig c = CrqConfig("crq3:pre_rope", 64);
  c.rope.pairing = RopeConfig::Pairing::kAdjacent;
  const HeadCalibration cal = testutil::TestCalibration(c);
  absl::StatusOr<CrqTransform> t = CrqTransform::Make(c, cal);
  ASSERT_TRUE(t.ok()) << t.status();
  const std::vector<float> x = MakeKeys(8, 64, 81);
  for (Side side : {Side::kKey, Side::kValue}) {
    std::vector<float> y = x;
    t->Forward(side, y.data(), 8, 1000);
    EXPECT_NE(y, x);
    t->Inverse(side, y.data(), 8, 1000);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 1e-4 * (1 + std::fabs(x[i])));
  }
}

// The cpu backend's SIMD decode of a code row (permutes over the level
// table, codes straight from the bit planes or through scratch) is
// crq_hd.h's g * level[code] exactly, on every compiled target, for every
// width pair and head_dim 16 to 256 (both plane paths, the 32-code 1-bit
// plane of 3 bits at head_dim 64 included).
TEST(CrqSimdTest, DecodeRowIsTheSharedMathOnEveryTarget) {
  (void)CpuBackend();  // Applies KVQ_SIMD_TARGET first, so the loop's pins win.
  const hd::CrqCodebooks& cb = CrqCodebooks();
  std::mt19937 rng(5);
  for (const std::string& target : cpu::AvailableSimdTargets()) {
    ASSERT_TRUE(cpu::PinSimdTarget(target).ok());
    for (int d : {16, 32, 64, 128, 256}) {
      for (int hb = 4; hb <= 8; ++hb) {
        cpu::CrqRowLevels levels = {};
        const int hi = hd::CrqHiBits(hb), lo = hd::CrqLoBits(hb);
        std::copy_n(hd::CrqLevels(cb, hi), 1 << hi, levels.hi);
        std::copy_n(hd::CrqLevels(cb, lo), 1 << lo, levels.lo);
        std::vector<uint8_t> row(hd::CrqRowBytes(d, hb)), codes(d);
        for (uint8_t& b : row) b = static_cast<uint8_t>(rng());
        const float gain = 0.75f;
        std::vector<float> got(d);
        cpu::CrqDecodeRow(row.data(), d, hb, levels, gain, codes.data(), got.data());
        for (int c = 0; c < d; ++c) {
          ASSERT_EQ(got[c], hd::CrqDequant(row.data(), d, hb, gain, cb, c))
              << target << " d=" << d << " half_bits=" << hb << " c=" << c;
        }
      }
    }
  }
  ASSERT_TRUE(cpu::PinSimdTarget("").ok());
}

// The tile transpose moves every float to its tile-major slot and nothing
// else, on every compiled target, for a row stride wider than the rows.
TEST(CrqSimdTest, TransposeTileIsTileMajorOnEveryTarget) {
  (void)CpuBackend();  // Applies KVQ_SIMD_TARGET first, so the loop's pins win.
  for (const std::string& target : cpu::AvailableSimdTargets()) {
    ASSERT_TRUE(cpu::PinSimdTarget(target).ok());
    for (int d : {8, 32, 64, 136}) {
      const size_t stride = d + 8;
      std::vector<float> rows(cpu::kCrqTile * stride);
      for (size_t x = 0; x < rows.size(); ++x) rows[x] = static_cast<float>(x) + 0.5f;
      std::vector<float> got(static_cast<size_t>(d) * cpu::kCrqTile + 1, -1.0f);
      cpu::CrqTransposeTile(rows.data(), stride, d, got.data());
      for (int c = 0; c < d; ++c) {
        for (int i = 0; i < cpu::kCrqTile; ++i) {
          ASSERT_EQ(got[static_cast<size_t>(c) * cpu::kCrqTile + i], rows[i * stride + c])
              << target << " d=" << d << " c=" << c << " i=" << i;
        }
      }
      ASSERT_EQ(got.back(), -1.0f) << target << " d=" << d;
    }
  }
  ASSERT_TRUE(cpu::PinSimdTarget("").ok());
}

}  // namespace
}  // namespace kvq
