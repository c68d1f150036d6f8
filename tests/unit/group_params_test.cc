// The two storage formats of group parameters (kernels/group_params.h):
// directed fp16 rounding, the p8 encoder's coverage and tightness, exact
// decoding, page checks, layout bytes, and what p8 costs in round-trip
// error against fp16 parameters on the synthetic KV set.
#include "kernels/group_params.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/numeric.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

PageLayout Layout(const std::string& spec, int head_dim) {
  absl::StatusOr<QuantSpec> s = QuantSpec::Parse(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  absl::StatusOr<PageLayout> l = PageLayout::Make(*s, head_dim);
  EXPECT_TRUE(l.ok()) << l.status();
  return *l;
}

TEST(GroupParamsTest, DirectedHalfRounding) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mag(-20.0f, 14.9f);  // Inside fp16's range.
  for (int i = 0; i < 20000; ++i) {
    const float f = std::ldexp(1.0f + (rng() % 1000) / 1000.0f, static_cast<int>(mag(rng))) *
                    ((rng() & 1) ? -1.0f : 1.0f);
    const float down = HalfToFloat(FloatToHalfDown(f));
    const float up = HalfToFloat(FloatToHalfUp(f));
    ASSERT_LE(down, f) << f;
    ASSERT_GE(up, f) << f;
    // The two neighbours of f: one of them is the nearest half, and both
    // are f itself when f is representable.
    const float nearest = RoundToHalf(f);
    ASSERT_TRUE(nearest == down || nearest == up) << f;
    if (nearest == f) {
      ASSERT_EQ(down, f);
      ASSERT_EQ(up, f);
    } else {
      ASSERT_LT(down, f);
      ASSERT_GT(up, f);
    }
  }
  EXPECT_EQ(FloatToHalfDown(0.375f), FloatToHalf(0.375f)) << "representable: unchanged";
  EXPECT_EQ(FloatToHalfUp(-2.0f), FloatToHalf(-2.0f));
  EXPECT_EQ(FloatToHalfUp(0.0f), 0u) << "+0 stays +0";
  EXPECT_LT(HalfToFloat(FloatToHalfDown(-1e-9f)), 0.0f) << "below zero, however little";
  EXPECT_GT(HalfToFloat(FloatToHalfUp(1e-9f)), 0.0f);
}

// Ranges of a key block of head_dim 64: most channels near 0, a few outlier
// channels with large offsets, one constant channel and one whose every
// element is an outlier (lo > hi).
void MakeRanges(int n, uint64_t seed, std::vector<float>* lo, std::vector<float>* hi) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  lo->resize(n);
  hi->resize(n);
  for (int i = 0; i < n; ++i) {
    const float center = (i % 16 == 3) ? 12.0f * g(rng) : 0.3f * g(rng);
    const float half = std::fabs(g(rng)) * ((i % 16 == 3) ? 6.0f : 1.0f) + 0.01f;
    (*lo)[i] = center - half;
    (*hi)[i] = center + half;
  }
  (*lo)[5] = (*hi)[5] = -1.25f;
  (*lo)[6] = INFINITY;
  (*hi)[6] = -INFINITY;
}

TEST(GroupParamsTest, P8CoversEveryRangeAndLosesAtMostOneStepOfEach) {
  for (const auto& [spec, bits] : {std::pair<std::string, int>{"kivi4:g32:r128:p8", 4},
                                   {"kivi2:g32:r128:p8", 2},
                                   {"kivi3:g32:r128:p8:nuq", 3}}) {
    const PageLayout L = Layout(spec, 64);
    const bool nuq = spec.find("nuq") != std::string::npos;
    const float top = nuq ? 1.0f : static_cast<float>((1 << bits) - 1);
    for (uint64_t seed = 1; seed <= 20; ++seed) {
      std::vector<float> lo, hi;
      MakeRanges(64, seed, &lo, &hi);
      std::vector<uint8_t> page(L.page_bytes, 0xAB);
      std::vector<float> scale(64), zero(64);
      StoreGroupParams(L, L.key, page.data(), 0, 1, lo.data(), hi.data(), nuq, scale.data(),
                       zero.data());
      // What a reader decodes is exactly what the encoder returned.
      std::vector<float> loaded(128);
      LoadGroupParams(L, L.key, page.data(), 0, 1, loaded.data());
      uint16_t header[4];
      std::memcpy(header, L.ParamBlock(page.data(), L.key, 0), sizeof(header));
      const float sstep = HalfToFloat(header[0]);
      const float zstep = HalfToFloat(header[2]);
      for (int i = 0; i < 64; ++i) {
        ASSERT_EQ(loaded[i], scale[i]) << spec << " seed " << seed << " group " << i;
        ASSERT_EQ(loaded[64 + i], zero[i]) << spec << " seed " << seed << " group " << i;
        const float l = lo[i] > hi[i] ? 0.0f : lo[i];
        const float u = lo[i] > hi[i] ? 0.0f : hi[i];
        EXPECT_LE(zero[i], l) << spec << " group " << i << ": zero above the minimum";
        EXPECT_GE(zero[i] + scale[i] * top, u) << spec << " group " << i << ": top below the max";
        EXPECT_GE(zero[i], l - zstep * 1.0001f) << spec << " group " << i;
        EXPECT_LE(scale[i] * top, (u - l) + zstep * 1.0001f + sstep * top * 1.0001f)
            << spec << " group " << i;
      }
      EXPECT_EQ(header[3], 0u) << "padding is written as zero";
    }
  }
}

TEST(GroupParamsTest, P8TokenGroupsShareOneHeaderPerBlock) {
  // Values of kivi2:g16:p8 at head_dim 64: 16 rows x 4 groups per block.
  const PageLayout L = Layout("kivi2:g16:r16:p8", 64);
  ASSERT_EQ(L.value.axis, ParamAxis::kTokenGroups);
  ASSERT_EQ(L.EntriesPerBlock(L.value), 16);
  EXPECT_EQ(L.ParamBlockBytes(L.value), kParams8HeaderBytes + 2u * 16 * 4);
  std::vector<float> lo, hi;
  MakeRanges(16 * 4, 3, &lo, &hi);
  std::vector<uint8_t> page(L.page_bytes, 0);
  std::vector<float> scale(64), zero(64);
  // The page's second block: entries (rows) 16..31.
  StoreGroupParams(L, L.value, page.data(), 16, 16, lo.data(), hi.data(), false, scale.data(),
                   zero.data());
  std::vector<float> row(8);
  for (int r = 0; r < 16; ++r) {
    LoadGroupParams(L, L.value, page.data(), 16 + r, 1, row.data());
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(row[j], scale[r * 4 + j]) << "row " << r << " group " << j;
      EXPECT_EQ(row[4 + j], zero[r * 4 + j]) << "row " << r << " group " << j;
    }
  }
  const std::vector<uint8_t> first_block(page.begin() + L.value.params_offset,
                                         page.begin() + L.value.params_offset +
                                             L.ParamBlockBytes(L.value));
  EXPECT_TRUE(std::all_of(first_block.begin(), first_block.end(), [](uint8_t b) { return b == 0; }))
      << "writing block 1 touched block 0";
}

TEST(GroupParamsTest, P8HalvesTheParameterBytes) {
  // head_dim 64, g128: keys 64 channels x (scale, zero) per 128-token block,
  // values 128 rows x 1 group.
  const PageLayout p16 = Layout("kivi4:g128:r128", 64);
  const PageLayout p8 = Layout("kivi4:g128:r128:p8", 64);
  EXPECT_EQ(p16.ParamBlockBytes(p16.key), 256u);
  EXPECT_EQ(p8.ParamBlockBytes(p8.key), 8u + 128u);
  EXPECT_EQ(p16.ParamBlockBytes(p16.value), 512u);
  EXPECT_EQ(p8.ParamBlockBytes(p8.value), 8u + 256u);
  EXPECT_EQ(p8.key.params_bytes, p8.ParamBlockBytes(p8.key)) << "one block per 128-token page";
}

TEST(GroupParamsTest, CheckNamesTheBadHeaderField) {
  const PageLayout L = Layout("kivi2:g32:r128:p8", 64);
  std::vector<uint8_t> page(L.page_bytes, 0);
  EXPECT_TRUE(CheckGroupParams(L, L.value, page.data(), 32).ok());
  const struct {
    int field;
    uint16_t value;
    const char* message;
  } cases[] = {
      {0, 0x7c00, "block 0: scale step must be finite and >= 0"},
      {0, 0xbc00, "block 0: scale step must be finite and >= 0"},
      {1, 0x7e00, "block 0: zero base is not finite"},
      {2, 0xfc00, "block 0: zero step must be finite and >= 0"},
      {2, 0x8400, "block 0: zero step must be finite and >= 0"},
  };
  for (const auto& c : cases) {
    std::vector<uint8_t> bad = page;
    std::memcpy(L.ParamBlock(bad.data(), L.value, 0) + 2 * c.field, &c.value, 2);
    const absl::Status st = CheckGroupParams(L, L.value, bad.data(), 32);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(st.message(), c.message);
  }
  // Negative zero is a valid (zero) step; a negative zero base is fine.
  std::vector<uint8_t> ok = page;
  const uint16_t neg_zero = 0x8000, minus_two = 0xc000;
  std::memcpy(L.ParamBlock(ok.data(), L.value, 0), &neg_zero, 2);
  std::memcpy(L.ParamBlock(ok.data(), L.value, 0) + 2, &minus_two, 2);
  EXPECT_TRUE(CheckGroupParams(L, L.value, ok.data(), 32).ok());
}

// fp16 parameters, both axes: every position of every entry is checked
// (the first pass is branch-free; the message comes from the second).
TEST(GroupParamsTest, CheckNamesTheBadFp16Parameter) {
  const PageLayout L = Layout("kivi2:g32:r128", 64);
  std::vector<uint8_t> page(L.page_bytes, 0);
  for (const SideLayout* S : {&L.key, &L.value}) {
    const int rows = L.page_tokens;
    const int n = L.ParamsPerEntry(*S);
    const int entries = S->axis == ParamAxis::kChannelGroups ? rows / L.block_tokens : rows;
    ASSERT_TRUE(CheckGroupParams(L, *S, page.data(), rows).ok());
    const int last = entries - 1;
    const struct {
      int entry, index;  // index < n: scale index; else zero point index - n.
      uint16_t value;
      std::string message;
    } cases[] = {
        {0, 0, 0x7c00, "row 0: scale 0 must be finite and >= 0"},
        {last, n - 1, 0xbc00, absl::StrCat("row ", last, ": scale ", n - 1, " must be finite and >= 0")},
        {last, n - 1, 0x8001, absl::StrCat("row ", last, ": scale ", n - 1, " must be finite and >= 0")},
        {0, n, 0x7e00, "row 0: zero point 0 is not finite"},
        {last, 2 * n - 1, 0xfc00, absl::StrCat("row ", last, ": zero point ", n - 1, " is not finite")},
    };
    for (const auto& c : cases) {
      std::vector<uint8_t> bad = page;
      L.Params(bad.data(), *S, c.entry)[c.index] = c.value;
      const absl::Status st = CheckGroupParams(L, *S, bad.data(), rows);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.message;
      EXPECT_EQ(st.message(), c.message);
    }
    // A negative zero scale is a zero scale; zero points may be negative.
    std::vector<uint8_t> ok = page;
    L.Params(ok.data(), *S, last)[0] = 0x8000;
    L.Params(ok.data(), *S, last)[n] = 0xc000;
    L.Params(ok.data(), *S, 0)[n - 1] = 0x7bff;  // The largest finite scale.
    EXPECT_TRUE(CheckGroupParams(L, *S, ok.data(), rows).ok());
  }
}

// The word-at-a-time first pass against a parameter-at-a-time predicate,
// for every way entries fall into 64-bit words: n = 1 and 2 (whole entries
// per word, including an odd entry count), 3 (entries across words), 4 and
// 8 (whole words of scales or zeros), and channel groups (n = head_dim).
TEST(GroupParamsTest, CheckAgreesWithAParameterAtATimeRule) {
  const struct {
    const char* spec;
    int head_dim;
  } layouts[] = {{"kivi2:g64:r128", 64}, {"kivi2:g32:r128", 64},  {"kivi4:g16:r128", 48},
                 {"kivi2:g32:r128", 128}, {"kivi4:g16:r128", 128}, {"kivi3:g32:r128", 96}};
  const uint16_t specials[] = {0x7c00, 0xfc00, 0x7e01, 0x7fff, 0x8000, 0x8001,
                               0xbc00, 0x3c00, 0x7bff, 0xfbff, 0x0001, 0xc000};
  std::mt19937 rng(7);
  for (const auto& c : layouts) {
    const PageLayout L = Layout(c.spec, c.head_dim);
    for (const SideLayout* S : {&L.key, &L.value}) {
      const int n = L.ParamsPerEntry(*S);
      for (int rows : {L.page_tokens, L.block_tokens, 1, 7}) {
        if (S->axis == ParamAxis::kChannelGroups && rows % L.block_tokens != 0) continue;
        const int entries = S->axis == ParamAxis::kChannelGroups ? rows / L.block_tokens : rows;
        int rejected = 0;
        for (int trial = 0; trial < 200; ++trial) {
          std::vector<uint8_t> page(L.page_bytes, 0);
          uint16_t* p = L.Params(page.data(), *S, 0);
          const int flips = static_cast<int>(rng() % 3);
          for (int f = 0; f < flips; ++f) {
            const size_t at = rng() % (static_cast<size_t>(entries) * 2 * n);
            p[at] = rng() % 2 ? specials[rng() % std::size(specials)]
                              : static_cast<uint16_t>(rng());
          }
          bool want_ok = true;
          for (int e = 0; e < entries; ++e) {
            for (int i = 0; i < 2 * n; ++i) {
              const uint16_t h = p[static_cast<size_t>(e) * 2 * n + i];
              const bool finite = (h & 0x7c00) != 0x7c00;
              const bool negative = (h & 0x8000) != 0 && (h & 0x7fff) != 0;
              if (!finite || (i < n && negative)) want_ok = false;
            }
          }
          const absl::Status st = CheckGroupParams(L, *S, page.data(), rows);
          ASSERT_EQ(st.ok(), want_ok) << c.spec << " d" << c.head_dim << " n=" << n
                                      << " rows=" << rows << " trial " << trial << ": " << st;
          rejected += !want_ok;
        }
        EXPECT_GT(rejected, 20) << c.spec << " n=" << n << ": the trials must reach bad values";
      }
    }
  }
}

// Root-mean-square round-trip error of the quantized tokens of a stream.
double RmsError(const std::string& spec, int head_dim, Side side) {
  testutil::StreamParam p{"cpu", {spec, head_dim, {}, ""}};
  std::unique_ptr<KvStream> s = testutil::MakeStream(p);
  const int n = 1024;
  const std::vector<float> k = testutil::MakeKeys(n, head_dim, 91);
  const std::vector<float> v = testutil::MakeValues(n, head_dim, 92);
  EXPECT_TRUE(testutil::AppendRows(*s, k, v, 0, n).ok());
  const int q = s->quantized_tokens();
  EXPECT_GT(q, 0);
  const std::vector<float> got = testutil::ReadSide(*s, side, 0, q, false);
  const std::vector<float>& want = side == Side::kKey ? k : v;
  double sum = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = static_cast<double>(got[i]) - want[i];
    sum += e * e;
  }
  return std::sqrt(sum / got.size());
}

TEST(GroupParamsTest, P8CostsLittleRoundTripError) {
  // The 8-bit codes widen a group's step by at most one zero step and one
  // scale step of its block; on the synthetic set (keys with outlier
  // channels) that is a few percent of the error, not more.
  for (const std::string base : {"kivi4:g128:r128", "kivi2:g32:r128", "kivi3:g16:r128"}) {
    for (Side side : {Side::kKey, Side::kValue}) {
      const double e16 = RmsError(base, 64, side);
      const double e8 = RmsError(base + ":p8", 64, side);
      EXPECT_LE(e8, 1.05 * e16) << base << (side == Side::kKey ? " keys" : " values")
                                << ": p8 " << e8 << " vs fp16 parameters " << e16;
      EXPECT_GE(e8, 0.95 * e16) << base << ": p8 cannot be much better than fp16 parameters";
    }
  }
}

}  // namespace
}  // namespace kvq
