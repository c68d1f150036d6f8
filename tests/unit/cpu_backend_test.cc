// What is specific to the "cpu" backend, against the reference on the same
// streams: the work split across threads and its LSE merge (long contexts,
// many tasks), query rows padded to the kernels' block sizes, tiles that
// start or stop inside pages, G-token blocks, the sink and the tail, causal
// rows that see nothing, and bit-exact QuantizeRows / DequantizeRows.
// (attention_test.cc holds the typed suite every backend passes.)
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/quant_math.h"
#include "kernels/kv_stream.h"
#include "kernels/stream_config.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

// The accuracy contract of cpu against ref on the same stream: float paths,
// and the integer paths (kivi keys with int16 queries on the codes, and on
// AVX3_DL kivi values with 15-bit weights on the codes), as in
// attention_test.cc.
constexpr double kFloatOut = 1e-4, kFloatLse = 1e-3;
constexpr double kIntegerOut = 5e-3, kIntegerLse = 1e-2;

StreamConfig Config(const std::string& spec, int head_dim, int page_tokens = 0) {
  StreamConfig c;
  absl::StatusOr<QuantSpec> s = QuantSpec::Parse(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  c.spec = *s;
  c.head_dim = head_dim;
  c.page_tokens = page_tokens;
  return c;
}

bool IntegerPath(const StreamConfig& c) {
  return c.spec.is_kivi() || c.spec.kind == SchemeKind::kInt8;
}

std::unique_ptr<KvStream> Filled(const StreamConfig& config, int tokens, uint64_t seed,
                                 const KernelBackend* backend = &RefBackend()) {
  return testutil::UnevenlyFilledStream(config, backend, tokens, seed,
                                        [](int step) { return step * 5 % 997 + 1; });
}

// One Attend call's inputs and outputs for `tasks` tasks sharing a shape.
struct Call {
  int group, queries, d;
  std::vector<AttentionTask> tasks;
  std::vector<std::vector<float>> q, out, lse;
  std::vector<std::vector<int32_t>> positions;

  Call(int num_tasks, int group_size, int num_queries, int head_dim, uint64_t seed)
      : group(group_size), queries(num_queries), d(head_dim), tasks(num_tasks),
        q(num_tasks), out(num_tasks), lse(num_tasks), positions(num_tasks) {
    for (int i = 0; i < num_tasks; ++i) {
      q[i] = testutil::MakeGaussian(static_cast<size_t>(queries) * group * d, seed + i);
      out[i].assign(q[i].size(), std::nanf(""));
      lse[i].assign(static_cast<size_t>(queries) * group, std::nanf(""));
    }
  }
  void Set(int i, const KvStream* s, int begin, int end, bool causal_from = false, int pos0 = 0,
           int pos_step = 0) {
    AttentionTask& t = tasks[i];
    t.stream = s;
    t.key_begin = begin;
    t.key_end = end;
    t.num_queries = queries;
    t.q = q[i].data();
    t.q_stride = group * d;
    t.out = out[i].data();
    t.out_stride = group * d;
    t.lse = lse[i].data();
    t.lse_stride = group;
    if (causal_from) {
      positions[i].resize(queries);
      for (int j = 0; j < queries; ++j) positions[i][j] = pos0 + j * pos_step;
      t.q_positions = positions[i].data();
    }
  }
  absl::Status Run(const KernelBackend& b) {
    AttentionOptions o;
    o.group_size = group;
    return b.Attend(tasks, o);
  }
};

// Runs `call` on both backends and compares every row.
void ExpectMatchesRef(Call& call, double out_tol, double lse_tol, const std::string& what) {
  Call ref = call;
  for (size_t i = 0; i < ref.tasks.size(); ++i) {
    ref.tasks[i].q = ref.q[i].data();
    ref.tasks[i].out = ref.out[i].data();
    ref.tasks[i].lse = ref.lse[i].data();
    if (!ref.positions[i].empty()) ref.tasks[i].q_positions = ref.positions[i].data();
  }
  ASSERT_TRUE(ref.Run(RefBackend()).ok());
  ASSERT_TRUE(call.Run(CpuBackend()).ok());
  const int d = call.d;
  for (size_t i = 0; i < call.tasks.size(); ++i) {
    for (int r = 0; r < call.queries * call.group; ++r) {
      const float* a = call.out[i].data() + static_cast<size_t>(r) * d;
      const float* b = ref.out[i].data() + static_cast<size_t>(r) * d;
      const float la = call.lse[i][r], lb = ref.lse[i][r];
      if (std::isinf(lb)) {
        EXPECT_EQ(la, lb) << what << ": task " << i << " row " << r;
        for (int c = 0; c < d; ++c) ASSERT_EQ(a[c], 0.0f) << what << ": task " << i << " row " << r;
        continue;
      }
      double err = 0.0, scale = 1e-6;
      for (int c = 0; c < d; ++c) {
        err = std::max(err, static_cast<double>(std::fabs(a[c] - b[c])));
        scale = std::max(scale, static_cast<double>(std::fabs(b[c])));
      }
      EXPECT_LE(err / scale, out_tol) << what << ": task " << i << " row " << r;
      EXPECT_LE(std::fabs(la - lb), lse_tol) << what << ": task " << i << " row " << r;
    }
  }
}

void ExpectMatchesRef(Call& call, const StreamConfig& c, const std::string& what) {
  if (IntegerPath(c)) {
    ExpectMatchesRef(call, kIntegerOut, kIntegerLse, what);
  } else {
    ExpectMatchesRef(call, kFloatOut, kFloatLse, what);
  }
}

// Runs a test body with at least two OpenMP threads (the backend only splits
// work when it has threads to give it to).
class TwoThreads {
 public:
  TwoThreads() : saved_(omp_get_max_threads()) { omp_set_num_threads(std::max(2, saved_)); }
  ~TwoThreads() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

// Long contexts split across threads and merge back: one task whose range is
// cut into chunks, and many tasks that each make a unit.
TEST(CpuBackendTest, SplitRangesMergeLikeOneRange) {
  TwoThreads threads;
  for (const char* spec : {"fp16", "kivi2", "kivi4:pre_rope:sink=4"}) {
    const StreamConfig c = Config(spec, 128);
    std::unique_ptr<KvStream> s = Filled(c, 40000, 11);
    ASSERT_NE(s, nullptr);
    Call one(1, 4, 1, 128, 5);
    one.Set(0, s.get(), 0, -1);
    ExpectMatchesRef(one, c, absl::StrCat(spec, " one long task"));
    Call odd(1, 4, 1, 128, 6);  // A range that starts and ends inside pages and blocks.
    odd.Set(0, s.get(), 1237, 39001);
    ExpectMatchesRef(odd, c, absl::StrCat(spec, " inner range"));
  }
}

TEST(CpuBackendTest, AttendUsesThreadsOnlyForCallsItSplits) {
  // 4 rows x 40000 keys is above the parallel threshold (2^17 row-key
  // pairs), 4 rows x 600 keys below it; one thread never splits.
  const StreamConfig c = Config("kivi2", 128);
  std::unique_ptr<KvStream> s = Filled(c, 40000, 12);
  ASSERT_NE(s, nullptr);
  AttentionOptions options;
  options.group_size = 4;
  AttentionTask t;
  t.stream = s.get();
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  EXPECT_TRUE(CpuBackend().AttendUsesThreads({&t, 1}, options));
  t.key_begin = 39400;
  EXPECT_FALSE(CpuBackend().AttendUsesThreads({&t, 1}, options));
  t.key_begin = 0;
  EXPECT_FALSE(RefBackend().AttendUsesThreads({&t, 1}, options));
  omp_set_num_threads(1);
  EXPECT_FALSE(CpuBackend().AttendUsesThreads({&t, 1}, options));
  omp_set_num_threads(saved);
}

// Counts PageCheck calls per (stream, page).
class CountingPageCheck final : public PageCheck {
 public:
  explicit CountingPageCheck(std::vector<const KvStream*> streams) : streams_(std::move(streams)) {
    for (const KvStream* s : streams_) counts_.emplace_back(s->num_pages());
  }
  void Check(const KvStream& stream, int page) const override {
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i] == &stream) {
        ASSERT_GE(page, 0);
        ASSERT_LT(page, stream.num_pages());
        counts_[i][page].fetch_add(1);
        return;
      }
    }
    ADD_FAILURE() << "a page of a stream no task names";
  }
  int count(int stream, int page) const { return counts_[stream][page].load(); }

 private:
  std::vector<const KvStream*> streams_;
  mutable std::vector<std::vector<std::atomic<int>>> counts_;
};

// The service verifies page checksums through AttentionOptions::page_check
// (kernels/backend.h): the cpu backend must call it for every page it reads
// before reading it, from the threads that read, and for no page outside
// the keys any query sees.
TEST(CpuBackendTest, ChecksEveryPageItReadsAndNoOther) {
  TwoThreads threads;
  EXPECT_TRUE(CpuBackend().ChecksPages());
  EXPECT_FALSE(RefBackend().ChecksPages());
  for (const char* spec : {"fp16", "kivi2:sink=4", "kivi4:pre_rope"}) {
    const StreamConfig c = Config(spec, 128);
    std::unique_ptr<KvStream> a = Filled(c, 40000, 31);
    std::unique_ptr<KvStream> b = Filled(c, 3000, 32);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    // Task 0 is split across threads; task 1 sees keys [100, 2501) only
    // (causal positions of 3 queries: 1100, 1800, 2500).
    Call call(2, 4, 3, 128, 33);
    call.Set(0, a.get(), 777, 38000);
    call.Set(1, b.get(), 100, -1, /*causal_from=*/true, 1100, 700);
    CountingPageCheck check({a.get(), b.get()});
    AttentionOptions o;
    o.group_size = call.group;
    o.page_check = &check;
    ASSERT_TRUE(CpuBackend().Attend(call.tasks, o).ok());
    const int ranges[2][2] = {{777, 38000}, {100, 2501}};
    const KvStream* streams[2] = {a.get(), b.get()};
    for (int i = 0; i < 2; ++i) {
      const KvStream& s = *streams[i];
      const int pt = s.layout().page_tokens;
      for (int p = 0; p < s.num_pages(); ++p) {
        const int t0 = s.page_base() + p * pt;
        const int t1 = std::min(t0 + pt, s.page_base() + s.quantized_tokens());
        const bool read = t0 < ranges[i][1] && t1 > ranges[i][0];
        if (read) {
          EXPECT_GE(check.count(i, p), 1) << spec << " task " << i << " page " << p;
        } else {
          EXPECT_EQ(check.count(i, p), 0) << spec << " task " << i << " page " << p;
        }
      }
    }
  }
}

TEST(CpuBackendTest, ManyTasksOverSharedAndSeparateStreams) {
  TwoThreads threads;
  const StreamConfig c = Config("kivi4:sink=2", 128);
  std::vector<std::unique_ptr<KvStream>> streams;
  for (int h = 0; h < 4; ++h) streams.push_back(Filled(c, 9000 + 531 * h, 20 + h));
  Call call(8, 4, 1, 128, 9);
  for (int i = 0; i < 8; ++i) call.Set(i, streams[i % 4].get(), 17 * i, i % 3 ? -1 : 8000 - 3 * i);
  ExpectMatchesRef(call, c, "8 tasks over 4 streams");
}

// Row counts that are not 1, 2, 4 or 8 are padded inside the kernels; rows
// beyond 8 take several passes.
TEST(CpuBackendTest, AnyGroupAndQueryCount) {
  for (const char* spec : {"fp16", "kivi2", "kivi3:nuq", "int8"}) {
    const StreamConfig c = Config(spec, 128);
    std::unique_ptr<KvStream> s = Filled(c, 700, 31);
    ASSERT_NE(s, nullptr);
    for (int group : {1, 3, 5, 7, 12}) {
      for (int queries : {1, 3}) {
        Call call(1, group, queries, 128, 40 + group);
        call.Set(0, s.get(), 0, -1);
        ExpectMatchesRef(call, c, absl::StrCat(spec, " group ", group, " queries ", queries));
      }
    }
  }
}

// Causal chunks: rows whose position is before the range see nothing (zero
// output, lse -inf) while the others see a growing prefix.
TEST(CpuBackendTest, CausalRowsWithNothingVisible) {
  for (const char* spec : {"bf16", "kivi4:outliers=1", "kivi2:g64:r64:rotate"}) {
    const StreamConfig c = Config(spec, 64);
    std::unique_ptr<KvStream> s = Filled(c, 1500, 51);
    ASSERT_NE(s, nullptr);
    Call call(1, 4, 6, 64, 60);
    call.Set(0, s.get(), 300, 1400, /*causal_from=*/true, /*pos0=*/200, /*pos_step=*/230);
    ExpectMatchesRef(call, c, absl::StrCat(spec, " causal chunk"));
    Call none(1, 2, 2, 64, 61);
    none.Set(0, s.get(), 500, 600, true, 100, 10);  // No row sees a key.
    ExpectMatchesRef(none, c, absl::StrCat(spec, " nothing visible"));
  }
}

// Ranges that start and end anywhere: inside the sink, a page, a G-block,
// the tail; and every head_dim the integer kernels specialise.
TEST(CpuBackendTest, ArbitraryRangesOverSinkPagesAndTail) {
  struct Case {
    const char* spec;
    int d;
    int page_tokens;
  };
  for (const Case& k : {Case{"kivi2:sink=5", 64, 0}, Case{"kivi3:g64:sink=3", 256, 128},
                        Case{"kivi4:g16:r32", 256, 48}, Case{"kivi2:g128:r128", 128, 0},
                        Case{"fp16", 256, 40}, Case{"kivi4:g8:r8:ktok", 96, 0},
                        Case{"fp8_e4m3", 48, 0}}) {
    const StreamConfig c = Config(k.spec, k.d, k.page_tokens);
    std::unique_ptr<KvStream> s = Filled(c, 611, 71);
    ASSERT_NE(s, nullptr);
    const int n = s->num_tokens();
    for (auto [b, e] : {std::pair<int, int>{0, n}, {1, 2}, {3, 70}, {33, 577}, {n - 130, n - 1},
                        {n - 1, n}, {n, n}}) {
      Call call(1, 4, 1, k.d, 80 + b);
      call.Set(0, s.get(), b, e);
      ExpectMatchesRef(call, c, absl::StrCat(k.spec, " d", k.d, " keys [", b, ", ", e, ")"));
    }
  }
}

// The float tile kernel (16-bit pages, float rows of the generic path) at
// every number of query rows a pass takes (1 .. kMaxRows, and more rows
// than one pass) and at head dims whose channel count leaves a remainder
// for each row count's channel blocks (on AVX-512: 16 * W channels, W =
// 16 / rows).
TEST(CpuBackendTest, FloatTileKernelAtEveryRowCountAndOddHeadDims) {
  for (const char* spec : {"fp16", "bf16", "fp8_e4m3"}) {
    for (int d : {16, 48, 80, 112}) {
      const StreamConfig c = Config(spec, d);
      std::unique_ptr<KvStream> s = Filled(c, 300, 95 + d);
      ASSERT_NE(s, nullptr);
      for (auto [group, queries] : {std::pair<int, int>{1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1},
                                    {3, 2}, {7, 1}, {8, 1}, {4, 3}}) {
        Call call(1, group, queries, d, 96 + group);
        call.Set(0, s.get(), 0, -1);
        ExpectMatchesRef(call, c,
                         absl::StrCat(spec, " d", d, " GQA ", group, " x ", queries, " queries"));
      }
    }
  }
}

// head_dim 256 through every specialised path: nuq levels (2 and 3 bits),
// pre_rope keys with outliers and a sink, mixed widths, p8, int8 values.
// (ctest also runs this suite pinned to AVX2 and to the portable target.)
TEST(CpuBackendTest, EveryFastPathAtHeadDim256) {
  for (const char* spec : {"kivi2:nuq", "kivi3:nuq", "kivi2:pre_rope:outliers=1:sink=4",
                           "kivi4:v2", "kivi4:p8", "int8"}) {
    const StreamConfig c = Config(spec, 256);
    std::unique_ptr<KvStream> s = Filled(c, 1000, 93);
    ASSERT_NE(s, nullptr);
    Call call(1, 4, 2, 256, 94);
    call.Set(0, s.get(), 0, -1);
    ExpectMatchesRef(call, c, absl::StrCat(spec, " d256"));
  }
}

// The integer key path stays far inside its contract.
TEST(CpuBackendTest, IntegerKeyPathIsTight) {
  for (const char* spec : {"kivi4", "kivi3", "kivi2"}) {
    const StreamConfig c = Config(spec, 128);
    std::unique_ptr<KvStream> s = Filled(c, 3000, 91);
    ASSERT_NE(s, nullptr);
    Call call(1, 4, 2, 128, 92);
    call.Set(0, s.get(), 0, -1);
    ExpectMatchesRef(call, 2e-3, 2e-3, spec);
  }
}

// DequantizeRows is bit-identical to the reference on every format, any row
// range; QuantizeRows writes identical pages.
TEST(CpuBackendTest, QuantizeAndDequantizeRowsMatchReferenceExactly) {
  for (const testutil::SchemeCase& sc : testutil::AllSchemeCases()) {
    const StreamConfig c = sc.Config();
    std::unique_ptr<KvStream> ref = Filled(c, 333, 101, &RefBackend());
    std::unique_ptr<KvStream> cpu = Filled(c, 333, 101, &CpuBackend());
    ASSERT_NE(ref, nullptr);
    ASSERT_NE(cpu, nullptr);
    ASSERT_EQ(ref->num_pages(), cpu->num_pages());
    const PageLayout& L = ref->layout();
    for (int p = 0; p < ref->num_pages(); ++p) {
      EXPECT_EQ(std::memcmp(ref->page(p), cpu->page(p), L.page_bytes), 0)
          << sc.Label() << ": page " << p << " differs";
    }
    const int pt = L.page_tokens;
    const int g = L.block_tokens;
    std::vector<float> a(static_cast<size_t>(pt) * c.head_dim), b(a.size());
    for (int p = 0; p < ref->num_pages(); ++p) {
      for (Side side : {Side::kKey, Side::kValue}) {
        for (auto [r0, n] : {std::pair<int, int>{0, pt}, {g, pt - g}, {1, 1}, {pt - 3, 3}}) {
          if (r0 < 0 || n <= 0 || r0 + n > pt) continue;
          RefBackend().DequantizeRows(*ref, side, ref->page(p), r0, n, a.data());
          CpuBackend().DequantizeRows(*ref, side, ref->page(p), r0, n, b.data());
          ASSERT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * n * c.head_dim), 0)
              << sc.Label() << ": page " << p << " side " << static_cast<int>(side) << " rows ["
              << r0 << ", " << r0 + n << ")";
        }
      }
    }
  }
}

// UniformCode rounds (x - zero) * (1 / scale), the reciprocal rounded
// once, as every quantizer computes it: not the division, which rounds
// differently for a few quotients next to half-integers. Found by search,
// then required.
TEST(CpuBackendTest, UniformCodeRoundsTheProductByTheReciprocal) {
  int differ = 0;
  for (int si = 1; si < 4000 && differ < 20; ++si) {
    const GroupParams p{RoundToHalf(static_cast<float>(si) / 4096.0f), 0.0f};
    const float inv = 1.0f / p.scale;
    for (int k = 0; k < 255; ++k) {
      float x = (static_cast<float>(k) + 0.5f) * p.scale;
      for (int step = 0; step < 3; ++step, x = std::nextafter(x, 1e9f)) {
        const float by_product = std::nearbyint(x * inv);
        const float by_division = std::nearbyint(x / p.scale);
        if (by_product == by_division || by_product > 255.0f) continue;
        ++differ;
        EXPECT_EQ(UniformCode(x, p, 8), static_cast<uint8_t>(by_product))
            << "x " << x << " scale " << p.scale;
      }
    }
  }
  EXPECT_GT(differ, 0) << "no quotient where the product and the division round apart";
}

// Quotients (x - zero) / scale that are exactly half-integers, and (int8,
// whose float input reaches the quantizer unrounded) one float ulp either
// side, where rounding is most fragile: the SIMD append clamps before it
// rounds and rounds in the conversion, and must give the reference's codes
// for every one. Every group spans [0, top * 3/32], so scale = 3/32 and
// zero = 0 exactly, and 1 / scale is inexact.
TEST(CpuBackendTest, QuantizeRowsRoundsHalfIntegersAsTheReference) {
  constexpr int kD = 64, kTokens = 128;
  constexpr float kScale = 3.0f / 32.0f;
  for (const char* spec : {"kivi4:r0", "kivi4:g64", "kivi2", "kivi3", "int8"}) {
    StreamConfig c;
    c.spec = *QuantSpec::Parse(spec);
    c.head_dim = kD;
    const bool float_input = c.spec.kind == SchemeKind::kInt8;
    const float top = static_cast<float>((1 << (float_input ? 8 : c.spec.key_bits())) - 1);
    std::vector<float> x(static_cast<size_t>(kTokens) * kD);
    for (int t = 0; t < kTokens; ++t) {
      for (int ch = 0; ch < kD; ++ch) {
        // Rows 0 and 1 of each 32-token block and channels 0 and 1 of each
        // 32-channel group hold the range; the rest are ties.
        float e;
        if (t % 32 == 0 || (t % 32 > 1 && ch % 32 == 0)) {
          e = 0.0f;
        } else if (t % 32 == 1 || ch % 32 == 1) {
          e = top * kScale;
        } else {
          const int k = (t + 3 * ch) % static_cast<int>(top);
          e = (static_cast<float>(k) + 0.5f) * kScale;
          if (float_input && ch % 3 == 1) e = std::nextafter(e, 0.0f);
          if (float_input && ch % 3 == 2) e = std::nextafter(e, 1e9f);
        }
        x[static_cast<size_t>(t) * kD + ch] = e;
      }
    }
    absl::StatusOr<std::unique_ptr<KvStream>> ref = testutil::TryMakeStream(c, &RefBackend());
    absl::StatusOr<std::unique_ptr<KvStream>> cpu = testutil::TryMakeStream(c, &CpuBackend());
    ASSERT_TRUE(ref.ok() && cpu.ok()) << spec;
    ASSERT_TRUE(testutil::AppendRows(**ref, x, x, 0, kTokens).ok()) << spec;
    ASSERT_TRUE(testutil::AppendRows(**cpu, x, x, 0, kTokens).ok()) << spec;
    ASSERT_GT((*ref)->num_pages(), 0) << spec;
    ASSERT_EQ((*ref)->num_pages(), (*cpu)->num_pages()) << spec;
    for (int p = 0; p < (*ref)->num_pages(); ++p) {
      EXPECT_EQ(std::memcmp((*ref)->page(p), (*cpu)->page(p), (*ref)->layout().page_bytes), 0)
          << spec << ": page " << p << " differs";
    }
  }
}

TEST(CpuBackendTest, RejectsBadTasksLikeTheReference) {
  const StreamConfig c = Config("kivi2", 64);
  std::unique_ptr<KvStream> s = Filled(c, 100, 7);
  ASSERT_NE(s, nullptr);
  Call call(1, 2, 1, 64, 1);
  call.Set(0, s.get(), 10, 101);
  const absl::Status want = call.Run(RefBackend());
  const absl::Status got = call.Run(CpuBackend());
  EXPECT_EQ(got.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(got, want);
  call.Set(0, nullptr, 0, -1);
  EXPECT_EQ(call.Run(CpuBackend()), call.Run(RefBackend()));
  EXPECT_EQ(call.Run(CpuBackend()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq
