// Pinning the SIMD target of the cpu backend (kernels/cpu/simd_dispatch.h):
// names, errors, and that a pin changes which kernels run. ctest also runs
// the cpu kernels' suites pinned to AVX2 and to the portable baseline
// (tests/unit/CMakeLists.txt), so every compiled path is checked on an
// AVX-512 machine.
#include "kernels/cpu/simd_dispatch.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/simd_kernels.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using cpu::ActiveSimdTarget;
using cpu::AvailableSimdTargets;
using cpu::PinSimdTarget;

bool IsAvx512(const std::string& target) {
  return target == "AVX3" || target == "AVX3_DL" || target == "AVX3_ZEN4" || target == "AVX3_SPR";
}

class SimdDispatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // CpuBackend() applies KVQ_SIMD_TARGET on first use: let it, then start
    // every test from the best target whatever the environment says.
    (void)CpuBackend();
    ASSERT_TRUE(PinSimdTarget("").ok());
    best_ = AvailableSimdTargets();
  }
  void TearDown() override { ASSERT_TRUE(PinSimdTarget("").ok()); }
  std::vector<std::string> best_;
};

TEST_F(SimdDispatchTest, ListsTheBestFirstAndAlwaysThePortableBaseline) {
  ASSERT_FALSE(best_.empty());
  const std::string& last = best_.back();
  EXPECT_TRUE(last == "SCALAR" || last == "EMU128") << last;
  EXPECT_EQ(ActiveSimdTarget(), best_.front());
}

TEST_F(SimdDispatchTest, PinsEachTargetCaseInsensitivelyAndReturnsToTheBest) {
  for (const std::string& t : best_) {
    std::string lower = t;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(ch));
    ASSERT_TRUE(PinSimdTarget(lower).ok()) << t;
    EXPECT_EQ(ActiveSimdTarget(), t);
    EXPECT_EQ(AvailableSimdTargets(), best_) << "a pin must not shrink the list";
  }
  ASSERT_TRUE(PinSimdTarget("best").ok());
  EXPECT_EQ(ActiveSimdTarget(), best_.front());
}

TEST_F(SimdDispatchTest, UnknownTargetIsNotFoundAndKeepsThePin) {
  ASSERT_TRUE(PinSimdTarget(best_.back()).ok());
  const absl::Status s = PinSimdTarget("NEON_SVE");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), absl::StrCat("SIMD target \"NEON_SVE\" is not available here; available: ",
                                      absl::StrJoin(best_, ", "), " (or best)"));
  EXPECT_EQ(ActiveSimdTarget(), best_.back());
}

// kivi4 keys take the integer path (int16 queries) on AVX2, AVX3 and
// AVX3_DL and the float path on the portable baseline: the outputs differ in the last bits,
// each within the integer path's contract of the reference.
TEST_F(SimdDispatchTest, APinChangesWhichKernelsRun) {
  if (best_.size() < 2 || (best_.front() != "AVX2" && best_.front() != "AVX3" &&
                           best_.front() != "AVX3_DL")) {
    GTEST_SKIP() << "no x86 AVX2 target here";
  }
  constexpr int kD = 128, kTokens = 600, kGroup = 4;
  StreamConfig config;
  config.spec = *QuantSpec::Parse("kivi4");
  config.head_dim = kD;
  absl::StatusOr<std::unique_ptr<KvStream>> s = testutil::TryMakeStream(config, &RefBackend());
  ASSERT_TRUE(s.ok()) << s.status();
  const std::vector<float> k = testutil::MakeKeys(kTokens, kD, 7);
  const std::vector<float> v = testutil::MakeValues(kTokens, kD, 7);
  ASSERT_TRUE(testutil::AppendRows(**s, k, v, 0, kTokens).ok());
  const std::vector<float> q = testutil::MakeGaussian(kGroup * kD, 8);

  auto attend = [&](const KernelBackend& b) {
    std::vector<float> out(kGroup * kD), lse(kGroup);
    AttentionTask t;
    t.stream = s->get();
    t.key_begin = 0;
    t.key_end = kTokens;
    t.num_queries = 1;
    t.q = q.data();
    t.q_stride = kGroup * kD;
    t.out = out.data();
    t.out_stride = kGroup * kD;
    t.lse = lse.data();
    t.lse_stride = kGroup;
    AttentionOptions o;
    o.group_size = kGroup;
    EXPECT_TRUE(b.Attend({t}, o).ok());
    return out;
  };
  const std::vector<float> ref = attend(RefBackend());
  const std::vector<float> fast = attend(CpuBackend());
  ASSERT_TRUE(PinSimdTarget(best_.back()).ok());
  const std::vector<float> portable = attend(CpuBackend());

  EXPECT_NE(fast, portable);
  double scale = 0.0, err_fast = 0.0, err_portable = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
    err_fast = std::max(err_fast, std::fabs(static_cast<double>(fast[i]) - ref[i]));
    err_portable = std::max(err_portable, std::fabs(static_cast<double>(portable[i]) - ref[i]));
  }
  EXPECT_LE(err_fast / scale, 5e-3);      // The integer key path's contract.
  EXPECT_LE(err_portable / scale, 1e-4);  // Float paths'.
}

// Every target, every length (whole vectors and tails): the sign bit never
// counts, so -x and x give the same magnitude bits.
TEST_F(SimdDispatchTest, MaxAbsBitsIsExactOnEveryTargetAndTail) {
  for (const std::string& t : best_) {
    ASSERT_TRUE(PinSimdTarget(t).ok());
    for (size_t n : {1, 2, 15, 16, 17, 31, 33, 67, 128}) {
      std::vector<uint16_t> h(n);
      std::vector<uint32_t> f(n);
      for (size_t i = 0; i < n; ++i) {
        h[i] = static_cast<uint16_t>(0x8000 | (0x3c00 + i));  // -(1 + i/1024) as fp16.
        f[i] = 0x80000000u | (0x3f800000u + static_cast<uint32_t>(i));
      }
      EXPECT_EQ(cpu::MaxAbsBits16(h.data(), n), 0x3c00 + n - 1) << t << " n=" << n;
      EXPECT_EQ(cpu::MaxAbsBits32(f.data(), n), 0x3f800000u + n - 1) << t << " n=" << n;
    }
  }
}

// The one-pass fp16 dequantization serves uniform 2-, 3- and 4-bit kivi on
// AVX-512 and declines elsewhere (its callers then convert floats).
TEST_F(SimdDispatchTest, HalfRowsOnAvx512Only) {
  for (const std::string& t : best_) {
    ASSERT_TRUE(PinSimdTarget(t).ok());
    for (const char* scheme : {"kivi4:g32:r128", "kivi2:g32:r128:outliers=1", "kivi3:g32:r128"}) {
      StreamConfig config;
      config.spec = *QuantSpec::Parse(scheme);
      config.head_dim = 64;
      absl::StatusOr<std::unique_ptr<KvStream>> s = KvStream::Create(config, &CpuBackend());
      ASSERT_TRUE(s.ok()) << s.status();
      std::vector<uint8_t> page((*s)->layout().page_bytes, 0);
      std::vector<uint16_t> out(64);
      EXPECT_EQ(CpuBackend().DequantizeRowsHalf(**s, Side::kValue, page.data(), 0, 1, out.data(), 64),
                IsAvx512(t))
          << t << " " << scheme;
    }
  }
}

// The fused fp16 quantizer serves whole blocks of uniform 2-, 3- and 4-bit kivi
// on AVX-512 (head_dim 64, 128 and 256; per-channel keys, and per-token
// groups of 16 to 64 channels) and declines elsewhere; where it serves,
// its bytes are those the reference writes for the same values, constant
// groups (scale 0) included.
TEST_F(SimdDispatchTest, HalfBlocksQuantizeAsTheReferenceOnAvx512Only) {
  struct Case {
    const char* scheme;
    int head_dim;
    bool keys, values;  // Taken on AVX-512.
  };
  const Case cases[] = {
      {"kivi4", 64, true, true},
      {"kivi2", 128, true, true},
      {"kivi4:g16:r16", 256, true, true},
      {"kivi2:g64:r64", 64, true, true},
      {"kivi2:ktok", 64, true, true},
      {"kivi2:g8:r8", 64, true, false},  // Value groups of 8 channels: not a vector.
      {"kivi3", 64, true, true},            // Two planes; the 1-bit one 8 bytes.
      {"kivi3:g16:r16", 128, true, true},
      {"kivi3", 256, true, true},
      {"kivi4:outliers=1", 64, false, false},
      {"kivi2:fit", 64, false, true},  // fit: keys only.
      {"kivi4:p8", 128, false, false},
      {"kivi4", 96, false, false},
  };
  for (const std::string& t : best_) {
    ASSERT_TRUE(PinSimdTarget(t).ok());
    for (const Case& c : cases) {
      StreamConfig config;
      config.spec = *QuantSpec::Parse(c.scheme);
      config.head_dim = c.head_dim;
      absl::StatusOr<std::unique_ptr<KvStream>> s = KvStream::Create(config, &CpuBackend());
      ASSERT_TRUE(s.ok()) << c.scheme << ": " << s.status();
      const PageLayout& L = (*s)->layout();
      const int g = L.block_tokens, d = c.head_dim;
      const int row0 = L.page_tokens - g;  // The page's last block.
      for (Side side : {Side::kKey, Side::kValue}) {
        std::vector<float> x = side == Side::kKey ? testutil::MakeKeys(g, d, 7)
                                                  : testutil::MakeValues(g, d, 7);
        for (int i = 0; i < g; ++i) x[static_cast<size_t>(i) * d + 5] = 0.25f;  // Channel 5.
        for (int ch = 0; ch < d; ++ch) x[static_cast<size_t>(3) * d + ch] = -1.5f;  // Row 3.
        std::vector<uint16_t> bits(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
          bits[i] = FloatToHalf(x[i]);
          x[i] = HalfToFloat(bits[i]);
        }
        std::vector<uint8_t> fused(L.page_bytes, 0), ref(L.page_bytes, 0);
        const bool took =
            CpuBackend().QuantizeRowsHalf(**s, side, bits.data(), g, fused.data(), row0);
        EXPECT_EQ(took, IsAvx512(t) && (side == Side::kKey ? c.keys : c.values))
            << t << " " << c.scheme << " d=" << d << " side " << static_cast<int>(side);
        if (!took) {
          EXPECT_EQ(fused, std::vector<uint8_t>(L.page_bytes, 0)) << t << " " << c.scheme;
          continue;
        }
        RefBackend().QuantizeRows(**s, side, x.data(), g, ref.data(), row0);
        EXPECT_EQ(fused, ref) << t << " " << c.scheme << " d=" << d << " side "
                              << static_cast<int>(side);
      }
    }
  }
}

}  // namespace
}  // namespace kvq
