// Attention over every backend x scheme against fp64 references: the stream's
// own dequantized K/V (backend correctness) and the original float K/V
// (scheme quality), plus the merge identity, empty ranges and bad tasks.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::Attention64;
using testutil::ReferenceAttention;
using testutil::RelativeError;
using testutil::StreamParam;

struct Tolerance {
  // max |out - ref| over a head's output row, relative to max |ref| floored
  // at the RMS of the visible values: an output that averages out near zero
  // is judged on the scale of what it averages.
  double out_rel;
  double lse_abs;  // |lse - ref lse|.
};

double RmsOfRows(const std::vector<float>& rows, int begin, int end, int d) {
  double sum = 0.0;
  for (size_t i = static_cast<size_t>(begin) * d; i < static_cast<size_t>(end) * d; ++i) {
    sum += static_cast<double>(rows[i]) * rows[i];
  }
  return end > begin ? std::sqrt(sum / (static_cast<double>(end - begin) * d)) : 0.0;
}

// Against the stream's own dequantized K/V.
// Float math end to end (the reference; fp16/bf16/fp8 paths).
constexpr Tolerance kFloatPathTol = {1e-4, 1e-3};
// Backends that quantize queries to int8 on integer (int8/kivi) fast paths.
constexpr Tolerance kIntegerPathTol = {5e-3, 1e-2};
// Splitting a key range and merging the halves: float paths, and integer
// paths, whose value weights (AVX3_DL: 16 bits per tile, against the tile's
// largest) round differently when a split moves the tiles (measured <= 3.2e-5).
constexpr double kMergeTol = 1e-5;
constexpr double kIntegerMergeTol = 1e-4;

// Against the original float K/V: what the scheme itself loses. Measured with
// the reference backend on this file's data (keys with outlier channels,
// N(0, 1) values and queries, GQA 4, 4 queries, ~300-450 tokens); each bound
// is about twice the worst case over the scheme's variants (measured output /
// lse error in the comment).
constexpr Tolerance kFp16SchemeTol = {1e-3, 1e-3};      // 3.7e-4 / 1.3e-4
constexpr Tolerance kBf16SchemeTol = {5e-3, 2e-3};      // 2.3e-3 / 8.2e-4
constexpr Tolerance kFp8SchemeTol = {6e-2, 6e-2};       // 2.6e-2 / 2.7e-2
constexpr Tolerance kInt8SchemeTol = {1.6e-2, 6e-3};    // 7.8e-3 / 3.0e-3
constexpr Tolerance kKivi4SchemeTol = {0.16, 0.08};     // 0.079 (ntk) / 0.037
constexpr Tolerance kKivi3SchemeTol = {0.35, 0.17};     // 0.166 / 0.082
constexpr Tolerance kKivi2SchemeTol = {1.3, 1.5};       // 0.66 (r0) / 0.76 (r0)
// Per-token 2-bit keys: the ablation KIVI warns about.
constexpr Tolerance kKivi2KtokSchemeTol = {2.3, 2.0};   // 1.13 / 0.96

Tolerance SchemeTol(const QuantSpec& s) {
  switch (s.kind) {
    case SchemeKind::kFp16: return kFp16SchemeTol;
    case SchemeKind::kBf16: return kBf16SchemeTol;
    case SchemeKind::kFp8E4m3: return kFp8SchemeTol;
    case SchemeKind::kInt8: return kInt8SchemeTol;
    case SchemeKind::kKivi: break;
  }
  // Mixed bits (vN): the narrower side bounds the error.
  const int bits = std::min(s.key_bits(), s.value_bits());
  if (bits == 4) return kKivi4SchemeTol;
  if (bits == 3) return kKivi3SchemeTol;
  return s.key_axis == KeyAxis::kPerToken ? kKivi2KtokSchemeTol : kKivi2SchemeTol;
}

// One Attend() call's buffers.
struct AttendCall {
  int num_queries = 1, group = 1, d = 0;
  int q_stride = 0, out_stride = 0, lse_stride = 0;
  std::vector<float> q, out, lse;
  std::vector<int32_t> positions;

  AttendCall(int nq, int g, int dim, uint64_t seed, int pad = 0)
      : num_queries(nq), group(g), d(dim), q_stride(g * dim + pad), out_stride(g * dim + 2 * pad),
        lse_stride(g + pad) {
    q = testutil::MakeGaussian(static_cast<size_t>(nq) * q_stride, seed);
    out.assign(static_cast<size_t>(nq) * out_stride, 7.0f);  // Poison: must be overwritten.
    lse.assign(static_cast<size_t>(nq) * lse_stride, 7.0f);
  }
  AttentionTask Task(const KvStream* s, int begin, int end) {
    AttentionTask t;
    t.stream = s;
    t.key_begin = begin;
    t.key_end = end;
    t.num_queries = num_queries;
    t.q = q.data();
    t.q_stride = q_stride;
    t.q_positions = positions.empty() ? nullptr : positions.data();
    t.out = out.data();
    t.out_stride = out_stride;
    t.lse = lse.data();
    t.lse_stride = lse_stride;
    return t;
  }
  const float* Q(int i, int g) const { return &q[static_cast<size_t>(i) * q_stride + g * d]; }
  const float* Out(int i, int g) const { return &out[static_cast<size_t>(i) * out_stride + g * d]; }
  float Lse(int i, int g) const { return lse[static_cast<size_t>(i) * lse_stride + g]; }
  // Keys query i sees within [begin, end).
  int VisibleEnd(int i, int end) const {
    return positions.empty() ? end : std::min(end, positions[i] + 1);
  }
};

class AttentionTest : public testutil::StreamTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StreamTest::SetUp());
    const QuantSpec& s = config_.spec;
    n_ = s.is_kivi() ? s.sink + 3 * s.flush_tokens() + s.flush_tokens() / 2 + 3 : 300;
    k_ = testutil::MakeKeys(n_, d_, 2);
    v_ = testutil::MakeValues(n_, d_, 2);
    stream_ = testutil::MakeStream(GetParam());
    ASSERT_NE(stream_, nullptr);
    ASSERT_TRUE(testutil::AppendRows(*stream_, k_, v_, 0, n_).ok());
    // The stream's own K/V as attention must see them (post-RoPE, unrotated).
    kd_ = testutil::ReadSide(*stream_, Side::kKey, 0, n_, true);
    vd_ = testutil::ReadSide(*stream_, Side::kValue, 0, n_, true);
    // The original K/V, post-RoPE.
    k0_ = k_;
    if (stream_->rope()) {
      for (int t = 0; t < n_; ++t) stream_->rope()->Apply(&k0_[static_cast<size_t>(t) * d_], t);
    }
    scale_ = 1.0 / std::sqrt(static_cast<double>(d_));
    pb_ = stream_->page_base();
    pt_ = stream_->layout().page_tokens;
    quantized_ = stream_->quantized_tokens();
  }

  bool IntegerPath() const {
    return GetParam().backend != "ref" &&
           (config_.spec.is_kivi() || config_.spec.kind == SchemeKind::kInt8);
  }
  Tolerance PathTol() const { return IntegerPath() ? kIntegerPathTol : kFloatPathTol; }
  double MergeTol() const { return IntegerPath() ? kIntegerMergeTol : kMergeTol; }

  absl::Status Attend(AttendCall& run, int begin, int end, float softmax_scale = 0.0f) {
    const AttentionTask task = run.Task(stream_.get(), begin, end);
    AttentionOptions options;
    options.group_size = run.group;
    options.softmax_scale = softmax_scale;
    return backend_->Attend({&task, 1}, options);
  }

  // Every (query, head) of `run` over [begin, end) against fp64 attention on
  // keys/values, within `tol`.
  void Check(const AttendCall& run, int begin, int end, const std::vector<float>& keys,
             const std::vector<float>& values, Tolerance tol, const std::string& what,
             double scale = 0.0) {
    if (scale == 0.0) scale = scale_;
    for (int i = 0; i < run.num_queries; ++i) {
      const int visible = run.VisibleEnd(i, end);
      for (int g = 0; g < run.group; ++g) {
        const Attention64 ref =
            ReferenceAttention(run.Q(i, g), keys.data(), values.data(), begin, visible, d_, scale);
        const double err =
            RelativeError(run.Out(i, g), ref.out, std::max(1e-6, RmsOfRows(values, begin, visible, d_)));
        // An empty visible range must give exactly -inf.
        const double lse_err = std::isinf(ref.lse) || std::isinf(run.Lse(i, g))
                                   ? (run.Lse(i, g) == ref.lse ? 0.0 : INFINITY)
                                   : std::fabs(run.Lse(i, g) - ref.lse);
        EXPECT_LE(err, tol.out_rel) << what << ": query " << i << " head " << g << " keys ["
                                    << begin << ", " << visible << ") output error";
        EXPECT_LE(lse_err, tol.lse_abs) << what << ": query " << i << " head " << g << " keys ["
                                        << begin << ", " << visible << ") lse " << run.Lse(i, g)
                                        << " vs " << ref.lse;
      }
    }
  }
  void CheckOwn(const AttendCall& run, int begin, int end, const std::string& what, double scale = 0.0) {
    Check(run, begin, end, kd_, vd_, PathTol(), what, scale);
  }

  int n_ = 0, pb_ = 0, pt_ = 0, quantized_ = 0;
  double scale_ = 0.0;
  std::vector<float> k_, v_, kd_, vd_, k0_;
  std::unique_ptr<KvStream> stream_;
};

TEST_P(AttentionTest, DecodeMatchesOwnDequantizedKv) {
  for (int group : {1, 3, 4, 8}) {
    AttendCall run(1, group, d_, 100 + group);
    ASSERT_TRUE(Attend(run, 0, -1).ok());
    CheckOwn(run, 0, n_, absl::StrCat("decode, GQA ", group));
  }
}

// Scores that climb across the tiles: every key is a constant r(t) in all
// channels plus a little noise, and the query rows are constants too, so
// row g scores about slope_g * t (times the softmax scale) and the last
// tokens win. The running max moves in every tile, by less than the AVX-512
// softmax's lazy slack for the gentle rows (probabilities above 1 until it
// moves) and by more for the steep ones; a jump of 20 nats halfway moves it
// once more.
TEST_P(AttentionTest, ScoresThatClimbAcrossTiles) {
  const std::vector<double> slopes = {0.02, 0.1, 0.25, 0.35};  // Nats per token.
  std::vector<float> k = testutil::MakeGaussian(static_cast<size_t>(n_) * d_, 900);
  for (int t = 0; t < n_; ++t) {
    // q . k_t * scale = sqrt(d) * level * r(t) for a query of `level` everywhere.
    const double r = (t + (t >= n_ / 2 ? 20.0 / slopes.back() : 0.0)) / std::sqrt(static_cast<double>(d_));
    for (int c = 0; c < d_; ++c) k[static_cast<size_t>(t) * d_ + c] = 0.05f * k[t * d_ + c] + r;
  }
  stream_ = testutil::MakeStream(GetParam());
  ASSERT_NE(stream_, nullptr);
  ASSERT_TRUE(testutil::AppendRows(*stream_, k, v_, 0, n_).ok());
  const std::vector<float> kd = testutil::ReadSide(*stream_, Side::kKey, 0, n_, true);
  AttendCall run(1, static_cast<int>(slopes.size()), d_, 901);
  for (int g = 0; g < run.group; ++g) {
    std::fill_n(run.q.begin() + g * d_, d_, static_cast<float>(slopes[g]));
  }
  ASSERT_TRUE(Attend(run, 0, -1).ok());
  Check(run, 0, n_, kd, vd_, PathTol(), "climbing scores");
}

// A query near float's range overflows the scores: the call fails with
// OUT_OF_RANGE naming the row, on every path, whether the scores overflow
// to +inf (the query along the keys) or all to -inf (against them, which
// would otherwise read as a row that sees no key). RoPE turns the keys by
// their positions, so their channels' signs mix and the scores may stay in
// range: there the call either fails so or returns finite results.
TEST_P(AttentionTest, ScoresThatOverflowFloatFailTheCall) {
  std::vector<float> k = testutil::MakeGaussian(static_cast<size_t>(n_) * d_, 950);
  for (float& x : k) x = 0.5f + 0.05f * x;  // Every key channel positive.
  stream_ = testutil::MakeStream(GetParam());
  ASSERT_NE(stream_, nullptr);
  ASSERT_TRUE(testutil::AppendRows(*stream_, k, v_, 0, n_).ok());
  for (float sign : {1.0f, -1.0f}) {
    AttendCall run(1, 2, d_, 951);  // Head 0 keeps its ordinary query.
    std::fill_n(run.q.begin() + d_, d_, sign * 1e38f);
    const absl::Status st = Attend(run, 0, -1);
    if (config_.spec.pre_rope && st.ok()) {
      for (int g = 0; g < 2; ++g) {
        EXPECT_TRUE(std::isfinite(run.Lse(0, g))) << "sign " << sign << " head " << g;
        for (int c = 0; c < d_; ++c) ASSERT_TRUE(std::isfinite(run.Out(0, g)[c])) << "head " << g;
      }
      continue;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << "sign " << sign << ": " << st;
    EXPECT_NE(st.message().find("attention task 0, query 0, head 1: the result overflowed float"),
              absl::string_view::npos)
        << st;
  }
}

TEST_P(AttentionTest, ChunkedCausalQueries) {
  AttendCall run(8, 4, d_, 200, /*pad=*/8);
  const int mid_tail = std::min(n_ - 3, pb_ + quantized_ + 1);
  run.positions = {0, 2, pb_ + pt_ / 2, pb_ + quantized_ - 1, mid_tail, n_ - 2, n_ - 1, n_ + 50};
  ASSERT_TRUE(Attend(run, 0, n_).ok());
  CheckOwn(run, 0, n_, "causal chunk");
  // A chunk of consecutive positions (prefill), GQA 3.
  AttendCall chunk(6, 3, d_, 201);
  for (int i = 0; i < 6; ++i) chunk.positions.push_back(n_ - 6 + i);
  ASSERT_TRUE(Attend(chunk, 0, -1).ok());
  CheckOwn(chunk, 0, n_, "prefill chunk");
}

TEST_P(AttentionTest, KeyRangesStartingMidPageAndMidTail) {
  const int tail_begin = pb_ + quantized_;
  std::vector<std::pair<int, int>> ranges = {
      {1, n_},                              // Inside the first page or the sink.
      {pb_ + pt_ / 2 + 1, n_},               // Mid-page to the end.
      {pb_ + 5, pb_ + quantized_ - 3},       // Mid-page to mid-page.
      {pb_ + pt_ - 1, pb_ + pt_ + 1},        // Across a page boundary.
      {std::min(tail_begin + 1, n_ - 1), n_},  // Mid-tail.
      {n_ - 1, n_},                          // The newest token only.
  };
  for (auto [b, e] : ranges) {
    AttendCall run(2, 4, d_, 300 + b);
    ASSERT_TRUE(Attend(run, b, e).ok()) << "[" << b << ", " << e << ")";
    CheckOwn(run, b, e, absl::StrCat("range [", b, ", ", e, ")"));
    // The same range with a causal cut inside it.
    AttendCall causal(2, 4, d_, 400 + b);
    causal.positions = {b + (e - b) / 2, e - 1};
    ASSERT_TRUE(Attend(causal, b, e).ok());
    CheckOwn(causal, b, e, absl::StrCat("causal range [", b, ", ", e, ")"));
  }
}

TEST_P(AttentionTest, MergeOfSplitRangesEqualsWholeRange) {
  AttendCall whole(3, 4, d_, 500);
  ASSERT_TRUE(Attend(whole, 0, n_).ok());
  std::vector<int> splits = {config_.spec.sink > 0 ? 2 : 1, pb_ + pt_ + 5,
                             std::min(n_ - 1, pb_ + quantized_ + 2)};
  // Same error measure as Check(): relative, floored at the values' RMS.
  const double value_rms = RmsOfRows(vd_, 0, n_, d_);
  for (int m : splits) {
    AttendCall a = whole, b = whole;
    ASSERT_TRUE(Attend(a, 0, m).ok());
    ASSERT_TRUE(Attend(b, m, n_).ok());
    for (int i = 0; i < whole.num_queries; ++i) {
      for (int g = 0; g < whole.group; ++g) {
        std::vector<float> merged(d_);
        float lse = 0.0f;
        MergeAttention(a.Out(i, g), a.Lse(i, g), b.Out(i, g), b.Lse(i, g), d_, merged.data(), &lse);
        std::vector<double> want(whole.Out(i, g), whole.Out(i, g) + d_);
        EXPECT_LE(RelativeError(merged.data(), want, value_rms), MergeTol())
            << "split at " << m << ", query " << i << " head " << g;
        EXPECT_NEAR(lse, whole.Lse(i, g), kMergeTol * std::max(1.0f, std::fabs(lse)))
            << "split at " << m << ", query " << i << " head " << g;
      }
    }
  }
}

TEST_P(AttentionTest, EmptyVisibleRangeGivesMinusInfAndZeros) {
  AttendCall run(1, 2, d_, 600);
  ASSERT_TRUE(Attend(run, 5, 5).ok());
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(run.Lse(0, g), -std::numeric_limits<float>::infinity()) << "head " << g;
    for (int c = 0; c < d_; ++c) ASSERT_EQ(run.Out(0, g)[c], 0.0f) << "head " << g << " channel " << c;
  }
  // A query whose position is before the range sees nothing; its neighbour does.
  AttendCall causal(2, 2, d_, 601);
  causal.positions = {9, n_ - 1};
  ASSERT_TRUE(Attend(causal, 10, n_).ok());
  for (int g = 0; g < 2; ++g) {
    EXPECT_EQ(causal.Lse(0, g), -std::numeric_limits<float>::infinity());
    for (int c = 0; c < d_; ++c) ASSERT_EQ(causal.Out(0, g)[c], 0.0f);
  }
  CheckOwn(causal, 10, n_, "query before the range");
  // Merging with an empty part is the identity.
  std::vector<float> merged(d_);
  float lse = 0.0f;
  MergeAttention(run.Out(0, 0), run.Lse(0, 0), causal.Out(1, 0), causal.Lse(1, 0), d_,
                 merged.data(), &lse);
  EXPECT_EQ(lse, causal.Lse(1, 0));
  for (int c = 0; c < d_; ++c) EXPECT_FLOAT_EQ(merged[c], causal.Out(1, 0)[c]);
  MergeAttention(run.Out(0, 0), run.Lse(0, 0), run.Out(0, 1), run.Lse(0, 1), d_, merged.data(), &lse);
  EXPECT_EQ(lse, -std::numeric_limits<float>::infinity()) << "empty + empty";
  for (float x : merged) EXPECT_EQ(x, 0.0f);
}

TEST_P(AttentionTest, SeveralTasksInOneCall) {
  AttendCall a(2, 4, d_, 700), b(1, 4, d_, 701), c(3, 4, d_, 702);
  c.positions = {3, pb_ + pt_, n_ - 1};
  const AttentionTask tasks[] = {a.Task(stream_.get(), 0, -1), b.Task(stream_.get(), pb_ + 3, n_ - 2),
                                 c.Task(stream_.get(), 1, n_)};
  AttentionOptions options;
  options.group_size = 4;
  ASSERT_TRUE(backend_->Attend(tasks, options).ok());
  CheckOwn(a, 0, n_, "task 0");
  CheckOwn(b, pb_ + 3, n_ - 2, "task 1");
  CheckOwn(c, 1, n_, "task 2");
}

TEST_P(AttentionTest, ExplicitSoftmaxScale) {
  AttendCall run(2, 3, d_, 800);
  ASSERT_TRUE(Attend(run, 0, n_, 0.05f).ok());
  CheckOwn(run, 0, n_, "softmax_scale 0.05", 0.05f);
}

// What the scheme loses: attention on the stored K/V vs on the original
// float K/V.
TEST_P(AttentionTest, CloseToAttentionOnOriginalKv) {
  AttendCall run(4, 4, d_, 900);
  ASSERT_TRUE(Attend(run, 0, n_).ok());
  const Tolerance tol = SchemeTol(config_.spec);
  Check(run, 0, n_, k0_, v_, tol, absl::StrCat(config_.spec.ToString(), " vs original K/V"));
}

void ExpectStatus(const absl::Status& st, absl::StatusCode code, const std::string& message) {
  EXPECT_EQ(st.code(), code) << st;
  EXPECT_EQ(st.message(), message);
}

TEST_P(AttentionTest, RejectsBadTasks) {
  AttentionOptions options;
  options.group_size = 2;
  auto attend = [&](std::vector<AttentionTask> tasks, AttentionOptions o) {
    return backend_->Attend(tasks, o);
  };
  AttendCall run(2, 2, d_, 1000);
  const AttentionTask good = run.Task(stream_.get(), 0, -1);
  {
    AttentionTask t = good;
    t.stream = nullptr;
    ExpectStatus(attend({t}, options), absl::StatusCode::kInvalidArgument,
                 "attention task 0: stream is null");
  }
  {
    AttentionTask t = good;
    t.key_begin = 5;
    t.key_end = 3;
    ExpectStatus(attend({good, t}, options), absl::StatusCode::kOutOfRange,
                 absl::StrCat("attention task 1: key range [5, 3) is not inside [0, ", n_, "]"));
    t.key_begin = 0;
    t.key_end = n_ + 1;
    ExpectStatus(attend({t}, options), absl::StatusCode::kOutOfRange,
                 absl::StrCat("attention task 0: key range [0, ", n_ + 1, ") is not inside [0, ", n_, "]"));
    t.key_begin = -1;
    t.key_end = 4;
    ExpectStatus(attend({t}, options), absl::StatusCode::kOutOfRange,
                 absl::StrCat("attention task 0: key range [-1, 4) is not inside [0, ", n_, "]"));
  }
  {
    AttendCall bad = run;
    bad.q[static_cast<size_t>(1) * bad.q_stride + d_ + 6] = std::numeric_limits<float>::quiet_NaN();
    ExpectStatus(attend({bad.Task(stream_.get(), 0, -1)}, options), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("attention task 0: q[1][", d_ + 6, "] is not finite"));
    bad = run;
    bad.q[3] = std::numeric_limits<float>::infinity();
    ExpectStatus(attend({good, bad.Task(stream_.get(), 0, -1)}, options),
                 absl::StatusCode::kInvalidArgument, "attention task 1: q[0][3] is not finite");
  }
  {
    AttentionOptions o = options;
    o.group_size = 0;
    ExpectStatus(attend({good}, o), absl::StatusCode::kInvalidArgument,
                 "group_size must be in [1, 64], got 0");
    o.group_size = 65;
    ExpectStatus(attend({good}, o), absl::StatusCode::kInvalidArgument,
                 "group_size must be in [1, 64], got 65");
    o = options;
    o.softmax_scale = -1.0f;
    ExpectStatus(attend({good}, o), absl::StatusCode::kInvalidArgument,
                 "softmax_scale must be finite and >= 0");
    o.softmax_scale = std::numeric_limits<float>::quiet_NaN();
    ExpectStatus(attend({good}, o), absl::StatusCode::kInvalidArgument,
                 "softmax_scale must be finite and >= 0");
  }
  {
    AttentionTask t = good;
    t.out = nullptr;
    ExpectStatus(attend({t}, options), absl::StatusCode::kInvalidArgument,
                 "attention task 0: q, out and lse must be set");
    t = good;
    t.num_queries = 0;
    ExpectStatus(attend({t}, options), absl::StatusCode::kInvalidArgument,
                 "attention task 0: num_queries must be >= 1");
    t = good;
    t.out_stride = 2 * d_ - 1;
    ExpectStatus(attend({t}, options), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("attention task 0: q_stride and out_stride must be >= "
                              "group_size*head_dim=", 2 * d_, " and lse_stride >= group_size"));
    std::vector<int32_t> positions = {4, -1};
    t = good;
    t.q_positions = positions.data();
    ExpectStatus(attend({t}, options), absl::StatusCode::kInvalidArgument,
                 "attention task 0: q_positions[1] is negative");
  }
  // No tasks is fine.
  EXPECT_TRUE(backend_->Attend({}, options).ok());
}

std::string ParamName(const ::testing::TestParamInfo<StreamParam>& info) {
  return testutil::StreamParamName(info.param);
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndSchemes, AttentionTest,
                         ::testing::ValuesIn(testutil::AllStreamParams()), ParamName);

// The head_dims the CUDA kernels are compiled for beyond the typed suites'
// 64 and 128 (96: not a power of two; 256: the largest), on the fp32 and
// the tensor-core paths' schemes, every backend; and GQA groups wider than
// one 16-row tile of the device kernels (cuda_host runs their algorithm).
std::vector<StreamParam> KernelShapeParams() {
  using P = RopeConfig::Pairing;
  RopeConfig half;
  half.pairing = P::kHalfSplit;
  const testutil::SchemeCase cases[] = {
      {"fp16", 96, {}, ""},   {"int8", 256, {}, ""},  {"kivi4", 96, {}, ""},
      {"kivi2", 256, {}, ""}, {"kivi3", 256, {}, ""}, {"kivi3", 96, {}, ""}, {"kivi2", 96, {}, ""}, {"kivi4:pre_rope", 256, half, "half"},
  };
  std::vector<StreamParam> out;
  for (const std::string& b : testutil::BackendNames()) {  // "cuda" too, with a device.
    for (const testutil::SchemeCase& c : cases) out.push_back({b, c});
  }
  return out;
}

class KernelShapeAttentionTest : public AttentionTest {};

TEST_P(KernelShapeAttentionTest, GroupsWiderThanOneRowTile) {
  for (int group : {17, 32, 64}) {
    AttendCall run(2, group, d_, 500 + group);
    ASSERT_TRUE(Attend(run, 0, -1).ok());
    CheckOwn(run, 0, n_, absl::StrCat("decode, GQA ", group));
  }
}

INSTANTIATE_TEST_SUITE_P(KernelHeadDims, AttentionTest, ::testing::ValuesIn(KernelShapeParams()),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(KernelHeadDims, KernelShapeAttentionTest,
                         ::testing::ValuesIn(KernelShapeParams()), ParamName);

// MergeAttention on hand-made inputs.
TEST(MergeAttentionTest, WeightsByExpOfLse) {
  const float a[2] = {1.0f, 0.0f}, b[2] = {0.0f, 3.0f};
  float out[2], lse;
  MergeAttention(a, std::log(1.0f), b, std::log(3.0f), 2, out, &lse);
  EXPECT_NEAR(lse, std::log(4.0f), 1e-6);
  EXPECT_NEAR(out[0], 0.25f, 1e-6);
  EXPECT_NEAR(out[1], 2.25f, 1e-6);
  // Large lse values do not overflow.
  MergeAttention(a, 1000.0f, b, 1000.0f, 2, out, &lse);
  EXPECT_NEAR(lse, 1000.0f + std::log(2.0f), 1e-3);
  EXPECT_NEAR(out[0], 0.5f, 1e-6);
  EXPECT_NEAR(out[1], 1.5f, 1e-6);
}

}  // namespace
}  // namespace kvq
