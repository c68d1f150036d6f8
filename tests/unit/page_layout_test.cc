#include "kernels/page_layout.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

std::vector<uint8_t> Pack(const std::vector<uint8_t>& codes, int bits) {
  std::vector<uint8_t> row(codes.size() * bits / 8, 0xee);
  PackCodes(codes.data(), static_cast<int>(codes.size()), bits, row.data());
  return row;
}

TEST(PageLayoutTest, PackUnpackRoundTrip) {
  std::mt19937 rng(3);
  for (int bits : {2, 3, 4, 8}) {
    for (int n : {8, 16, 64, 128, 256}) {
      std::vector<uint8_t> codes(n);
      for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
      const std::vector<uint8_t> row = Pack(codes, bits);
      ASSERT_EQ(row.size(), static_cast<size_t>(n) * bits / 8);
      std::vector<uint8_t> back(n, 0xff);  // Unpack must not depend on prior contents.
      UnpackCodes(row.data(), n, bits, back.data());
      EXPECT_EQ(back, codes) << "bits=" << bits << " n=" << n;
    }
  }
}

// The documented placement, on hand-computed bytes.
TEST(PageLayoutTest, FourBitPlaneExample) {
  std::vector<uint8_t> codes(16);
  for (int i = 0; i < 16; ++i) codes[i] = static_cast<uint8_t>(i);
  // P = 8: byte j = code[j] | code[j + 8] << 4.
  const std::vector<uint8_t> expected = {0x80, 0x91, 0xa2, 0xb3, 0xc4, 0xd5, 0xe6, 0xf7};
  EXPECT_EQ(Pack(codes, 4), expected);
}

TEST(PageLayoutTest, TwoBitPlaneExample) {
  const std::vector<uint8_t> codes = {0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 2, 2, 3, 0, 3, 0};
  // P = 4: byte j = c[j] | c[j+4] << 2 | c[j+8] << 4 | c[j+12] << 6.
  const std::vector<uint8_t> expected = {0xdc, 0x19, 0xe6, 0x23};
  EXPECT_EQ(Pack(codes, 2), expected);
}

TEST(PageLayoutTest, ThreeBitPlanesExample) {
  const std::vector<uint8_t> codes = {0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0};
  // A 2-bit plane of the low bits (4 bytes) then a 1-bit plane of the high
  // bit (2 bytes, byte j holds channels j + 2m at bit m).
  const std::vector<uint8_t> expected = {0xf0, 0xa5, 0x5a, 0x0f, 0x3c, 0x3c};
  EXPECT_EQ(Pack(codes, 3), expected);
}

TEST(PageLayoutTest, EightBitIsIdentity) {
  std::vector<uint8_t> codes(32);
  for (int i = 0; i < 32; ++i) codes[i] = static_cast<uint8_t>(255 - 7 * i);
  EXPECT_EQ(Pack(codes, 8), codes);
}

// The placement rule of page_layout.h, checked bit by bit on random rows.
TEST(PageLayoutTest, PlacementRuleHoldsForEveryBit) {
  std::mt19937 rng(5);
  for (int bits : {2, 3, 4}) {
    const int n = 128;
    std::vector<uint8_t> codes(n);
    for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
    const std::vector<uint8_t> row = Pack(codes, bits);
    struct Plane {
      int b, shift;
    };
    std::vector<Plane> planes;
    if (bits == 3) {
      planes = {{2, 0}, {1, 2}};
    } else {
      planes = {{bits, 0}};
    }
    size_t offset = 0;
    for (const Plane& pl : planes) {
      const int p = n * pl.b / 8;
      for (int j = 0; j < p; ++j) {
        for (int m = 0; m < 8 / pl.b; ++m) {
          const int got = (row[offset + j] >> (m * pl.b)) & ((1 << pl.b) - 1);
          const int want = (codes[j + p * m] >> pl.shift) & ((1 << pl.b) - 1);
          ASSERT_EQ(got, want) << "bits=" << bits << " plane b=" << pl.b << " byte " << j
                               << " slot " << m;
        }
      }
      offset += p;
    }
    EXPECT_EQ(offset, row.size());
  }
}

struct Section {
  const char* what;
  size_t offset, bytes, align;
};

void CheckLayout(const PageLayout& l, const std::string& label) {
  std::vector<Section> sections;
  size_t used = 0;
  for (const SideLayout* s : {&l.key, &l.value}) {
    const char* side = s == &l.key ? "key" : "value";
    sections.push_back({side, s->codes_offset, s->code_row_bytes * l.page_tokens, kPageAlign});
    if (s->params_bytes) {
      sections.push_back({side, s->params_offset, s->params_bytes, kTableAlign});
    }
    if (s->outliers_bytes) {
      sections.push_back({side, s->outliers_offset, s->outliers_bytes, kTableAlign});
    }
    EXPECT_EQ(s->params_bytes > 0, s->axis != ParamAxis::kNone) << label << " " << side;
    EXPECT_EQ(s->outliers_bytes > 0, l.outliers_per_block > 0) << label << " " << side;
  }
  std::sort(sections.begin(), sections.end(),
            [](const Section& a, const Section& b) { return a.offset < b.offset; });
  size_t end = 0;
  for (const Section& s : sections) {
    EXPECT_EQ(s.offset % s.align, 0u) << label << ": " << s.what << " section at " << s.offset;
    // Packed: no more padding in front of a section than its alignment needs.
    EXPECT_LT(s.offset - end, s.align) << label << ": " << s.what << " section at " << s.offset;
    EXPECT_GE(s.offset, end) << label << ": " << s.what << " section overlaps the previous one";
    end = s.offset + s.bytes;
    used += s.bytes;
  }
  EXPECT_LE(end, l.page_bytes) << label << ": a section runs past the page";
  EXPECT_EQ(l.page_bytes % kPageAlign, 0u) << label;
  EXPECT_EQ(used + l.padding_bytes, l.page_bytes) << label << ": page_bytes = sections + padding";
  EXPECT_LT(l.padding_bytes, sections.size() * kPageAlign) << label << ": padding is alignment only";
}

TEST(PageLayoutTest, SectionsAlignedDisjointAndAccountedForEveryScheme) {
  for (const testutil::SchemeCase& c : testutil::AllSchemeCases()) {
    const QuantSpec spec = c.Config().spec;
    for (int d : {16, 64, 128, 256}) {
      for (int pt : {0, 256, 512}) {
        absl::StatusOr<PageLayout> l = PageLayout::Make(spec, d, pt);
        ASSERT_TRUE(l.ok()) << c.spec << " d=" << d << " pt=" << pt << ": " << l.status();
        CheckLayout(*l, absl::StrCat(c.spec, " d=", d, " page_tokens=", pt));
        EXPECT_EQ(l->page_tokens, pt == 0 ? std::max(32, l->block_tokens) : pt);
        EXPECT_EQ(l->page_tokens % l->block_tokens, 0);
      }
    }
  }
}

// The device kernels read pages in 16-byte loads: every layout Make builds
// (every scheme, head_dim 96 included) keeps page_bytes and the code
// sections on that grid, and the check names a field that is off it.
TEST(PageLayoutTest, PagesAreReadableInVectorLoads) {
  int checked = 0;
  for (const testutil::SchemeCase& c : testutil::AllSchemeCases()) {
    for (int d : {64, 96, 128, 256}) {
      absl::StatusOr<PageLayout> l = PageLayout::Make(c.Config().spec, d);
      if (!l.ok()) continue;  // A group size head_dim 96 does not divide.
      ++checked;
      EXPECT_TRUE(l->CheckVectorLoads().ok()) << c.spec << " d=" << d;
      EXPECT_EQ(l->page_bytes % kVectorLoadBytes, 0u);
    }
  }
  EXPECT_GE(checked, 3 * static_cast<int>(testutil::AllSchemeCases().size()));
  absl::StatusOr<PageLayout> l = PageLayout::Make(*QuantSpec::Parse("kivi2"), 128);
  ASSERT_TRUE(l.ok());
  PageLayout bad = *l;
  bad.page_bytes += 8;
  EXPECT_EQ(bad.CheckVectorLoads().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(bad.CheckVectorLoads().message(),
            absl::StrCat("page layout: page_bytes ", bad.page_bytes,
                         " is not a multiple of 16 (the device kernels' load width)"));
  bad = *l;
  bad.value.codes_offset += 4;
  EXPECT_EQ(bad.CheckVectorLoads().message(),
            absl::StrCat("page layout: value.codes_offset ", bad.value.codes_offset,
                         " is not a multiple of 16 (the device kernels' load width)"));
}

TEST(PageLayoutTest, Kivi2G32HeadDim64Explicit) {
  absl::StatusOr<PageLayout> l = PageLayout::Make(*QuantSpec::Parse("kivi2"), 64);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->page_tokens, 32);
  EXPECT_EQ(l->block_tokens, 32);
  EXPECT_EQ(l->key.axis, ParamAxis::kChannelGroups);
  EXPECT_EQ(l->value.axis, ParamAxis::kTokenGroups);
  EXPECT_EQ(l->value.group_channels, 32);
  EXPECT_EQ(l->key.code_row_bytes, 16u);
  // [K codes][V codes][K params][V params]
  EXPECT_EQ(l->key.codes_offset, 0u);
  EXPECT_EQ(l->value.codes_offset, 512u);
  EXPECT_EQ(l->key.params_offset, 1024u);
  EXPECT_EQ(l->key.params_bytes, 256u) << "1 block x (scale+zero) x 64 channels x 2 bytes";
  EXPECT_EQ(l->value.params_offset, 1280u);
  EXPECT_EQ(l->value.params_bytes, 256u) << "32 tokens x 2 x 2 groups x 2 bytes";
  EXPECT_EQ(l->page_bytes, 1536u);
  EXPECT_EQ(l->padding_bytes, 0u);
  EXPECT_EQ(l->outliers_per_block, 0);
}

TEST(PageLayoutTest, Kivi2OutliersExplicit) {
  absl::StatusOr<PageLayout> l = PageLayout::Make(*QuantSpec::Parse("kivi2:outliers=1"), 64);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->outliers_per_block, 21) << "ceil(1% of 32 x 64)";
  // [K codes][V codes][K params][K outliers][V params][V outliers], the
  // tables on 8 bytes, the page on 64.
  EXPECT_EQ(l->value.codes_offset, 512u);
  EXPECT_EQ(l->key.params_offset, 1024u);
  EXPECT_EQ(l->key.outliers_offset, 1280u);
  EXPECT_EQ(l->key.outliers_bytes, 84u) << "21 x (index + value) x 2 bytes";
  EXPECT_EQ(l->value.params_offset, 1368u) << "1364 rounded up to 8";
  EXPECT_EQ(l->value.outliers_offset, 1624u);
  EXPECT_EQ(l->page_bytes, 1728u) << "1708 rounded up to 64";
  EXPECT_EQ(l->padding_bytes, 24u);
}

// vN: each side's code rows have that side's bits; everything else is as
// for equal bits. kivi4:v2, d 64, g32: K rows 32 bytes, V rows 16.
TEST(PageLayoutTest, MixedKeyValueBitsExplicit) {
  absl::StatusOr<PageLayout> l = PageLayout::Make(*QuantSpec::Parse("kivi4:v2"), 64);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->key.bits, 4);
  EXPECT_EQ(l->value.bits, 2);
  EXPECT_EQ(l->key.code_row_bytes, 32u);
  EXPECT_EQ(l->value.code_row_bytes, 16u);
  EXPECT_EQ(l->value.codes_offset, 1024u) << "32 rows x 32 bytes";
  EXPECT_EQ(l->key.params_offset, 1536u) << "+ 32 rows x 16 bytes";
  EXPECT_EQ(l->key.params_bytes, 256u) << "fp16 scale and zero per channel";
  EXPECT_EQ(l->value.params_offset, 1792u);
  EXPECT_EQ(l->value.params_bytes, 256u) << "fp16 scale and zero per token, 2 groups";
  EXPECT_EQ(l->page_bytes, 2048u);
  EXPECT_EQ(l->padding_bytes, 0u);
}

TEST(PageLayoutTest, BaseSchemesExplicit) {
  struct Case {
    const char* spec;
    int d;
    size_t row_bytes, params_bytes, page_bytes;
    CodeFormat format;
  };
  for (const Case& c : {Case{"fp16", 128, 256, 0, 16384, CodeFormat::kFp16},
                        Case{"bf16", 64, 128, 0, 8192, CodeFormat::kBf16},
                        Case{"int8", 64, 64, 128, 4352, CodeFormat::kInt8},
                        Case{"fp8_e4m3", 64, 64, 0, 4096, CodeFormat::kFp8E4m3},
                        Case{"kivi3", 64, 24, 256, 2048, CodeFormat::kPacked},
                        Case{"kivi4", 128, 64, 512, 5120, CodeFormat::kPacked}}) {
    absl::StatusOr<PageLayout> l = PageLayout::Make(*QuantSpec::Parse(c.spec), c.d);
    ASSERT_TRUE(l.ok()) << c.spec << ": " << l.status();
    for (const SideLayout* s : {&l->key, &l->value}) {
      EXPECT_EQ(s->format, c.format) << c.spec;
      EXPECT_EQ(s->code_row_bytes, c.row_bytes) << c.spec;
    }
    EXPECT_EQ(l->value.params_bytes, c.params_bytes) << c.spec;
    EXPECT_EQ(l->page_bytes, c.page_bytes) << c.spec;
  }
  // int8: one per-token group of all channels.
  absl::StatusOr<PageLayout> i8 = PageLayout::Make(*QuantSpec::Parse("int8"), 64);
  ASSERT_TRUE(i8.ok());
  EXPECT_EQ(i8->key.axis, ParamAxis::kTokenGroups);
  EXPECT_EQ(i8->key.group_channels, 64);
  // ktok: keys per token, groups of min(G, d) channels.
  absl::StatusOr<PageLayout> kt = PageLayout::Make(*QuantSpec::Parse("kivi2:g64:ktok"), 32);
  ASSERT_TRUE(kt.ok());
  EXPECT_EQ(kt->key.axis, ParamAxis::kTokenGroups);
  EXPECT_EQ(kt->key.group_channels, 32);
  EXPECT_EQ(kt->page_tokens, 64);
}

TEST(PageLayoutTest, OffsetHelpersAddressTheSections) {
  absl::StatusOr<PageLayout> l = PageLayout::Make(*QuantSpec::Parse("kivi4:outliers=1"), 64, 64);
  ASSERT_TRUE(l.ok()) << l.status();
  std::vector<uint8_t> page(l->page_bytes);
  uint8_t* p = page.data();
  EXPECT_EQ(PageLayout::CodeRow(p, l->value, 5) - p,
            static_cast<ptrdiff_t>(l->value.codes_offset + 5 * 32));
  EXPECT_EQ(reinterpret_cast<uint8_t*>(l->Params(p, l->key, 1)) - p,
            static_cast<ptrdiff_t>(l->key.params_offset + 1 * 2 * 64 * 2));
  EXPECT_EQ(reinterpret_cast<uint8_t*>(l->Params(p, l->value, 3)) - p,
            static_cast<ptrdiff_t>(l->value.params_offset + 3 * 2 * 2 * 2));
  EXPECT_EQ(reinterpret_cast<uint8_t*>(l->Outliers(p, l->key, 1)) - p,
            static_cast<ptrdiff_t>(l->key.outliers_offset + 1 * 2 * l->outliers_per_block * 2));
  EXPECT_EQ(l->blocks_per_page(), 2);
}

void ExpectMakeError(const char* spec, int d, int pt, const std::string& message) {
  absl::StatusOr<PageLayout> l = PageLayout::Make(*QuantSpec::Parse(spec), d, pt);
  ASSERT_FALSE(l.ok()) << spec << " d=" << d << " pt=" << pt;
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(l.status().message(), message);
}

TEST(PageLayoutTest, RejectsBadShapes) {
  ExpectMakeError("kivi2", 72, 0, "head_dim must be a multiple of 16 in [16, 256], got 72");
  ExpectMakeError("fp16", 8, 0, "head_dim must be a multiple of 16 in [16, 256], got 8");
  ExpectMakeError("fp16", 272, 0, "head_dim must be a multiple of 16 in [16, 256], got 272");
  ExpectMakeError("kivi2", 64, 48,
                  "page_tokens must be a multiple of the group size 32 in [1, 4096], got 48");
  ExpectMakeError("fp16", 64, 5000,
                  "page_tokens must be a multiple of the group size 1 in [1, 4096], got 5000");
  ExpectMakeError("int8", 64, -32,
                  "page_tokens must be a multiple of the group size 1 in [1, 4096], got -32");
}

}  // namespace
}  // namespace kvq
