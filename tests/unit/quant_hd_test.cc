// The per-group quantize math of kernels/hd/quant_hd.h against the
// reference's functions, one by one, and the pages cuda_host writes from
// it against QuantizeRowsRef's, byte for byte.
#include "kernels/hd/quant_hd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/outliers.h"
#include "kernels/cpu/quant_math.h"
#include "kernels/cpu/range_fit.h"
#include "kernels/cpu/ref_kernels.h"
#include "kernels/cuda/host_program_backend.h"
#include "kernels/group_params.h"
#include "kernels/numeric.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

uint32_t Bits(float f) { return hd::FloatBits(f); }

std::vector<float> Sweep(uint64_t seed, int n, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = RoundToHalf(scale * normal(rng));
  return v;
}

PageLayout Layout(const std::string& spec, int head_dim) {
  absl::StatusOr<QuantSpec> s = QuantSpec::Parse(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  absl::StatusOr<PageLayout> L = PageLayout::Make(*s, head_dim);
  EXPECT_TRUE(L.ok()) << L.status();
  return *L;
}

TEST(QuantHdTest, DirectedHalfRoundingMatchesReference) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, -65504.0f, 65519.0f, 1e-8f,
                           -1e-8f, 5.96e-8f, std::numeric_limits<float>::infinity()};
  for (uint32_t h = 0; h < 0x7c00; h += 7) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    for (float x : {f, std::nextafter(f, 1e9f), std::nextafter(f, -1e9f)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  for (float x : xs) {
    EXPECT_EQ(hd::FloatToHalfDown(x), FloatToHalfDown(x)) << x;
    EXPECT_EQ(hd::FloatToHalfUp(x), FloatToHalfUp(x)) << x;
  }
}

TEST(QuantHdTest, Params16AndCodesMatchReference) {
  const std::vector<float> x = Sweep(1, 4000, 3.0f);
  for (int bits : {2, 3, 4, 8}) {
    for (bool nuq : {false, true}) {
      for (size_t i = 0; i + 1 < x.size(); i += 2) {
        float lo = std::min(x[i], x[i + 1]), hi = std::max(x[i], x[i + 1]);
        if (i % 50 == 0) hi = lo;  // A zero range.
        const GroupParams want = MakeGroupParams(lo, hi, bits, nuq);
        const hd::ScaleZero got = hd::Params16({lo, hi}, bits, nuq);
        ASSERT_EQ(Bits(got.scale), Bits(want.scale)) << lo << " " << hi << " bits " << bits;
        ASSERT_EQ(Bits(got.zero), Bits(want.zero)) << lo << " " << hi;
        for (size_t j = 0; j < 40; ++j) {
          const float v = x[(i * 7 + j) % x.size()];
          ASSERT_EQ(hd::UniformCode(v, got, bits), UniformCode(v, want, bits)) << v;
        }
      }
    }
    // Every element an outlier: the range is [0, 0].
    const hd::ScaleZero empty = hd::Params16({hd::Infinity(), -hd::Infinity()}, bits, false);
    EXPECT_EQ(Bits(empty.scale), 0u);
    EXPECT_EQ(Bits(empty.zero), 0u);
  }
}

TEST(QuantHdTest, NearestLevelMatchesReference) {
  for (int bits : {2, 3, 4}) {
    const int n = 1 << bits;
    std::vector<float> levels(n);
    for (int i = 0; i < n; ++i) levels[i] = RoundToHalf(std::pow(static_cast<float>(i) / (n - 1), 1.5f));
    const std::vector<float> x = Sweep(2, 3000, 2.0f);
    for (size_t i = 0; i + 1 < x.size(); i += 2) {
      const GroupParams p{RoundToHalf(std::fabs(x[i]) + 0.25f), x[i + 1]};
      for (float v : {x[(i + 5) % x.size()], p.zero, p.zero + p.scale, p.zero + 0.5f * p.scale}) {
        ASSERT_EQ(hd::NearestLevel(v, {p.scale, p.zero}, levels.data(), n),
                  NearestLevel(v, p, levels.data(), n))
            << v;
      }
      // A zero scale normalises every element to 0.
      EXPECT_EQ(hd::NearestLevel(x[i], {0.0f, 0.0f}, levels.data(), n),
                NearestLevel(x[i], GroupParams{0.0f, 0.0f}, levels.data(), n));
    }
  }
}

// StoreGroupParams' p8 blocks against the same ranges encoded with the
// quant_hd.h steps in the encoder's order.
std::vector<uint8_t> EncodeP8Hd(const std::vector<hd::Range>& r, int bits, bool nuq,
                                std::vector<float>& scale, std::vector<float>& zero) {
  const int groups = static_cast<int>(r.size());
  std::vector<uint8_t> block(kParams8HeaderBytes + 2 * groups);
  const float top = hd::Params8Top(bits, nuq);
  float zmin = hd::Infinity(), zmax = -hd::Infinity();
  for (const hd::Range& g : r) {
    zmin = hd::MinOf(zmin, hd::Params8Low(g));
    zmax = hd::MaxOf(zmax, hd::Params8Low(g));
  }
  const hd::ZeroSteps8 z = hd::ZeroSteps(zmin, zmax);
  std::vector<float> needed(groups);
  float smax = 0.0f;
  scale.assign(groups, 0.0f);
  zero.assign(groups, 0.0f);
  for (int k = 0; k < groups; ++k) {
    const hd::Code8 c = hd::ZeroCode8(r[k], z);
    block[kParams8HeaderBytes + groups + k] = c.code;
    zero[k] = c.value;
    needed[k] = hd::NeededScale8(r[k], c.value, top);
    smax = hd::MaxOf(smax, needed[k]);
  }
  const hd::ZeroSteps8 s = hd::ScaleStep8(smax);
  for (int k = 0; k < groups; ++k) {
    const hd::Code8 c = hd::ScaleCode8(r[k], needed[k], zero[k], s.step, top);
    block[kParams8HeaderBytes + k] = c.code;
    scale[k] = c.value;
  }
  hd::StoreParams8Header(block.data(), s.step_bits, z.base_bits, z.step_bits);
  return block;
}

TEST(QuantHdTest, Params8MatchReferenceIncludingLimits) {
  struct Case {
    std::string spec;
    int head_dim;
  };
  std::mt19937_64 rng(3);
  for (const Case& c : {Case{"kivi4:p8", 64}, Case{"kivi2:p8:nuq", 64}, Case{"kivi3:p8:ktok", 64},
                        Case{"kivi2:g8:r8:p8:ktok", 16}}) {
    const PageLayout L = Layout(c.spec, c.head_dim);
    const bool nuq = c.spec.find("nuq") != std::string::npos;
    for (Side side : {Side::kKey, Side::kValue}) {
      const SideLayout& S = L.side(side);
      const int groups = L.EntriesPerBlock(S) * L.ParamsPerEntry(S);
      for (int trial = 0; trial < 60; ++trial) {
        // Ranges from tiny to the fp16 limits, zero ranges, empty groups
        // (every element an outlier) and blocks of nothing but those.
        const float magnitude = trial % 6 == 0 ? 65504.0f : std::ldexp(1.0f, trial % 30 - 20);
        std::uniform_real_distribution<float> u(-magnitude, magnitude);
        std::vector<hd::Range> r(groups);
        std::vector<float> lo(groups), hi(groups);
        for (int k = 0; k < groups; ++k) {
          float a = RoundToHalf(u(rng)), b = RoundToHalf(u(rng));
          if (a > b) std::swap(a, b);
          if (trial % 5 == 1 && k % 3 == 0) b = a;
          if ((trial % 5 == 2 && k % 4 == 0) || trial % 10 == 3) {
            a = hd::Infinity();
            b = -hd::Infinity();
          }
          r[k] = {a, b};
          lo[k] = a;
          hi[k] = b;
        }
        std::vector<uint8_t> page(L.page_bytes, 0);
        std::vector<float> ws(groups), wz(groups), gs, gz;
        StoreGroupParams(L, S, page.data(), 0, L.EntriesPerBlock(S), lo.data(), hi.data(), nuq,
                         ws.data(), wz.data());
        const std::vector<uint8_t> got = EncodeP8Hd(r, S.bits, nuq, gs, gz);
        ASSERT_EQ(std::memcmp(got.data(), L.ParamBlock(page.data(), S, 0), got.size()), 0)
            << c.spec << " trial " << trial;
        for (int k = 0; k < groups; ++k) {
          ASSERT_EQ(Bits(gs[k]), Bits(ws[k])) << c.spec << " group " << k;
          ASSERT_EQ(Bits(gz[k]), Bits(wz[k])) << c.spec << " group " << k;
        }
      }
    }
  }
}

TEST(QuantHdTest, FittedRangeMatchesReferenceOverMembers) {
  std::mt19937_64 rng(4);
  for (int bits : {2, 3, 4}) {
    for (int trial = 0; trial < 200; ++trial) {
      const int count = 8 << (trial % 4);
      std::vector<float> x = Sweep(100 + trial, count, 1.0f + trial % 7);
      if (trial % 3 == 0) x[trial % count] = 40.0f;  // A far element to clip.
      std::vector<uint8_t> out(count, 0);
      for (int i = 0; i < count; ++i) out[i] = (rng() % 9 == 0) ? 1 : 0;
      if (trial % 11 == 0) std::fill(out.begin(), out.end(), 1);
      std::vector<float> members;
      for (int i = 0; i < count; ++i) {
        if (!out[i]) members.push_back(x[i]);
      }
      hd::StridedGroup<float, hd::ByteMask> g{x.data(), 0, 1, count, hd::ByteMask{out.data()}};
      const hd::Range got = hd::GroupRange(g, bits, /*fit=*/true);
      if (members.empty()) {
        EXPECT_EQ(Bits(got.lo), 0u);
        EXPECT_EQ(Bits(got.hi), 0u);
        continue;
      }
      const auto [mn, mx] = std::minmax_element(members.begin(), members.end());
      const FittedRange want =
          FitUniformRange(members.data(), static_cast<int>(members.size()), bits, *mn, *mx);
      ASSERT_EQ(Bits(got.lo), Bits(want.lo)) << "bits " << bits << " trial " << trial;
      ASSERT_EQ(Bits(got.hi), Bits(want.hi)) << "bits " << bits << " trial " << trial;
    }
  }
}

TEST(QuantHdTest, KthSmallestIsNthElement) {
  for (int trial = 0; trial < 100; ++trial) {
    const int m = 1 + trial % 40;
    std::vector<float> x = Sweep(200 + trial, m, 1.0f);
    if (trial % 4 == 0) {
      for (float& v : x) v = std::round(v);  // Many ties.
    }
    for (int k = 0; k < m; ++k) {
      std::vector<float> s = x;
      std::nth_element(s.begin(), s.begin() + k, s.end());
      EXPECT_EQ(hd::KthSmallest([&](int i) { return x[i]; }, m, k), s[k]);
    }
  }
}

// The outliers of a block chosen with quant_hd.h: SelectOutliersRef's
// indices in its order, per-channel and per-token groups, ties included.
std::vector<int> SelectHd(const PageLayout& L, const SideLayout& S, const float* block, int k) {
  const int rows = L.block_tokens, d = L.head_dim;
  const int groups = hd::GroupsPerUnit(L, S, rows);
  std::vector<hd::RobustCenter> centers(groups);
  for (int j = 0; j < groups; ++j) {
    centers[j] = hd::RobustCenterOf(hd::GroupAt(L, S, block, rows, j, hd::NoMask{}));
  }
  auto score = [&](int i) {
    return hd::OutlierScore(block[i], centers[hd::GroupOf(L, S, i / d, i % d)]);
  };
  std::vector<int> out;
  int prev = -1;
  float prev_score = 0.0f;
  for (int e = 0; e < k; ++e) {
    prev = hd::NextOutlier(score, rows * d, prev_score, prev);
    prev_score = score(prev);
    out.push_back(prev);
  }
  return out;
}

TEST(QuantHdTest, OutlierSelectionMatchesReference) {
  for (const char* spec : {"kivi4:outliers=1", "kivi2:g16:r32:outliers=10:ktok", "kivi4:g8:r8:outliers=5"}) {
    const PageLayout L = Layout(spec, 64);
    for (Side side : {Side::kKey, Side::kValue}) {
      const SideLayout& S = L.side(side);
      for (int trial = 0; trial < 6; ++trial) {
        std::vector<float> block = testutil::MakeKeys(L.block_tokens, 64, 300 + trial);
        if (trial % 2 == 1) {
          for (float& v : block) v = std::round(v);  // Equal scores: ties to the lower index.
        }
        const std::vector<int> want = SelectOutliersRef(block.data(), L.block_tokens, 64, S,
                                                        L.outliers_per_block);
        EXPECT_EQ(SelectHd(L, S, block.data(), L.outliers_per_block), want)
            << spec << " side " << static_cast<int>(side) << " trial " << trial;
      }
    }
  }
}

// When only NaN scores are left, NextOutlier finds no candidate (-1, which
// the selection loops once used as an index); NextOutlierOrUnchosen then
// takes the lowest index not chosen yet, so k picks stay distinct and
// inside the block, and for finite scores it is NextOutlier.
TEST(QuantHdTest, OutlierSelectionWithoutCandidatesStaysInTheBlock) {
  const std::vector<float> scores = {3.0f, NAN, 5.0f, NAN, 1.0f, NAN};
  auto score = [&](int i) { return scores[i]; };
  const int n = static_cast<int>(scores.size());
  std::vector<uint8_t> chosen(n, 0);
  std::vector<int> picks;
  int prev = -1;
  float prev_score = 0.0f;
  for (int e = 0; e < n; ++e) {
    const int i = hd::NextOutlierOrUnchosen(score, n, prev_score, prev, hd::ByteMask{chosen.data()});
    ASSERT_GE(i, 0);
    ASSERT_LT(i, n);
    ASSERT_EQ(chosen[i], 0) << "index " << i << " chosen twice";
    chosen[i] = 1;
    picks.push_back(i);
    prev = i;
    prev_score = score(i);
  }
  // The finite scores in the order, then the NaN ones by index.
  EXPECT_EQ(picks, (std::vector<int>{2, 0, 4, 1, 3, 5}));
  EXPECT_EQ(hd::NextOutlier(score, n, scores[4], 4), -1) << "the case the fallback covers";
  const std::vector<uint8_t> none(n, 0);
  EXPECT_EQ(hd::NextOutlierOrUnchosen(score, n, 0.0f, -1, hd::ByteMask{none.data()}), 2);
}

TEST(QuantHdTest, PackedBytesMatchPackCodes) {
  std::mt19937_64 rng(5);
  for (int bits : {2, 3, 4, 8}) {
    for (int n = 16; n <= 256; n += 16) {
      std::vector<uint8_t> codes(n);
      for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() % (1u << bits));
      std::vector<uint8_t> want(hd::PackedRowBytes(n, bits)), got(want.size());
      PackCodes(codes.data(), n, bits, want.data());
      for (size_t j = 0; j < got.size(); ++j) {
        got[j] = hd::PackedByte([&](int c) { return codes[c]; }, n, bits, static_cast<int>(j));
      }
      EXPECT_EQ(got, want) << "bits " << bits << " n " << n;
    }
  }
}

std::unique_ptr<KvStream> Filled(const StreamConfig& config, int tokens, uint64_t seed,
                                 const KernelBackend* backend) {
  return testutil::UnevenlyFilledStream(config, backend, tokens, seed,
                                        [](int step) { return step * 3 % 61 + 1; });
}

// Every scheme of the typed suites (fp16, bf16 and fp8 rows, int8, kivi at
// 2/3/4 bits, vN, ktok, outliers, nuq, fit, p8): cuda_host's pages are the
// reference's bytes.
TEST(QuantHdTest, CudaHostPagesEqualReference) {
  const KernelBackend* host = *BackendByName("cuda_host");
  for (const testutil::SchemeCase& sc : testutil::AllSchemeCases()) {
    const StreamConfig c = sc.Config();
    std::unique_ptr<KvStream> ref = Filled(c, 333, 101, &RefBackend());
    std::unique_ptr<KvStream> got = Filled(c, 333, 101, host);
    ASSERT_NE(ref, nullptr);
    ASSERT_NE(got, nullptr);
    ASSERT_GT(ref->num_pages(), 0) << sc.Label();
    ASSERT_EQ(ref->num_pages(), got->num_pages()) << sc.Label();
    for (int p = 0; p < ref->num_pages(); ++p) {
      EXPECT_EQ(std::memcmp(ref->page(p), got->page(p), ref->layout().page_bytes), 0)
          << sc.Label() << ": page " << p << " differs";
    }
  }
}

// Blocks where every element of a group is an outlier, constant (zero
// range) groups, 8-bit parameters and fitted keys: the unit paths the
// random data above rarely reaches. Group 0 of row 0 holds 1..8 and every
// other element is 0, so group 0 scores highest and its median (score 0)
// still wins the ties by its lower index: all 8 of its elements are outliers.
TEST(QuantHdTest, AllOutlierAndConstantGroupsEqualReference) {
  for (const char* spec : {"kivi4:g8:r8:outliers=10:ktok", "kivi2:g8:r8:outliers=10:ktok:p8",
                           "kivi2:g8:r8:outliers=10:ktok:fit", "kivi3:g8:r8:outliers=10:ktok:p8:fit"}) {
    StreamConfig c;
    c.spec = *QuantSpec::Parse(spec);
    c.head_dim = 16;
    absl::StatusOr<std::unique_ptr<KvStream>> s = testutil::TryMakeStream(c, &RefBackend());
    ASSERT_TRUE(s.ok()) << s.status();
    const PageLayout& L = (*s)->layout();
    ASSERT_GE(L.outliers_per_block, 8) << spec;
    std::vector<float> rows(static_cast<size_t>(L.block_tokens) * 16, 0.0f);
    for (int c8 = 0; c8 < 8; ++c8) rows[c8] = static_cast<float>(c8 + 1);
    for (Side side : {Side::kKey, Side::kValue}) {
      std::vector<uint8_t> want(L.page_bytes, 0), got(L.page_bytes, 0);
      QuantizeRowsRef(**s, side, rows.data(), L.block_tokens, want.data(), 0);
      HostQuantizeRows(**s, side, rows.data(), L.block_tokens, got.data(), 0);
      EXPECT_EQ(want, got) << spec << " side " << static_cast<int>(side);
      const uint16_t* table = L.Outliers(want.data(), L.side(side), 0);
      std::vector<int> chosen(table, table + L.outliers_per_block);
      for (int c8 = 0; c8 < 8; ++c8) {
        EXPECT_NE(std::find(chosen.begin(), chosen.end(), c8), chosen.end())
            << spec << ": element " << c8 << " of the all-outlier group not chosen";
      }
    }
  }
}

}  // namespace
}  // namespace kvq
