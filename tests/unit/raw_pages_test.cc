// Raw pages: CopyPages on one stream, AppendPages on another, as a client
// library that quantizes locally and a server that validates would.
#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::StreamParam;

bool TakesPages(const QuantSpec& s) { return s.kind != SchemeKind::kFp8E4m3; }

class RawPagesTest : public ::testing::TestWithParam<StreamParam> {};

TEST_P(RawPagesTest, CopiedPagesAppendToAnEquivalentStream) {
  std::unique_ptr<KvStream> src = testutil::MakeStream(GetParam());
  std::unique_ptr<KvStream> dst = testutil::MakeStream(GetParam());
  const int d = src->head_dim();
  const QuantSpec& spec = src->spec();
  const int n = spec.sink + 3 * std::max(spec.flush_tokens(), 64) + 5;
  std::vector<float> k = testutil::MakeKeys(n, d, 31);
  std::vector<float> v = testutil::MakeValues(n, d, 32);
  ASSERT_TRUE(testutil::AppendRows(*src, k, v, 0, n).ok());
  // The destination takes the sink as rows, the quantized part as pages,
  // the tail as rows again.
  ASSERT_TRUE(testutil::AppendRows(*dst, k, v, 0, spec.sink).ok());
  ASSERT_TRUE(dst->AcceptsPages());
  const int q = src->quantized_tokens();
  std::vector<uint8_t> wire(static_cast<size_t>(src->PagesFor(q)) * src->layout().page_bytes);
  ASSERT_TRUE(src->CopyPages(0, q, wire.data()).ok());
  absl::Status st = dst->AppendPages(wire.data(), q);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(testutil::AppendRows(*dst, k, v, spec.sink + q, n).ok());
  for (Side side : {Side::kKey, Side::kValue}) {
    EXPECT_EQ(testutil::ReadSide(*dst, side, 0, n), testutil::ReadSide(*src, side, 0, n));
  }
  EXPECT_EQ(dst->AllocatedBytes(), src->AllocatedBytes());
}

TEST_P(RawPagesTest, CorruptPagesAreRejectedAndNothingIsStored) {
  std::unique_ptr<KvStream> src = testutil::MakeStream(GetParam());
  const QuantSpec& spec = src->spec();
  if (!spec.is_kivi() && spec.kind != SchemeKind::kInt8 && spec.kind != SchemeKind::kFp16) {
    GTEST_SKIP() << "corruption case written for scaled and fp16 pages";
  }
  std::unique_ptr<KvStream> dst = testutil::MakeStream(GetParam());
  const int d = src->head_dim();
  const int n = spec.sink + 2 * std::max(spec.flush_tokens(), 64);
  std::vector<float> k = testutil::MakeKeys(n, d, 33);
  std::vector<float> v = testutil::MakeValues(n, d, 34);
  ASSERT_TRUE(testutil::AppendRows(*src, k, v, 0, n).ok());
  ASSERT_TRUE(testutil::AppendRows(*dst, k, v, 0, spec.sink).ok());
  const int q = src->quantized_tokens();
  const PageLayout& L = src->layout();
  std::vector<uint8_t> wire(static_cast<size_t>(src->PagesFor(q)) * L.page_bytes);
  ASSERT_TRUE(src->CopyPages(0, q, wire.data()).ok());
  // An infinite fp16 value in the second page's value side.
  uint8_t* page1 = wire.data() + L.page_bytes;
  const uint16_t inf = 0x7c00;
  if (L.value.axis == ParamAxis::kNone) {
    std::memcpy(PageLayout::CodeRow(page1, L.value, 0), &inf, 2);
  } else {
    // The first scale (fp16 parameters) or the scale step (p8 header).
    std::memcpy(L.ParamBlock(page1, L.value, 0), &inf, 2);
  }
  const ByteBreakdown before = dst->AllocatedBytes();
  absl::Status st = dst->AppendPages(wire.data(), q);
  ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(L.value.param_bits == 8
                                  ? "page 1 value block 0: scale step must be finite and >= 0"
                                  : "page 1 value row 0"),
            absl::string_view::npos)
      << st;
  EXPECT_EQ(dst->num_tokens(), spec.sink);
  EXPECT_EQ(dst->AllocatedBytes(), before);
}

TEST_P(RawPagesTest, PagesOnlyAtABoundary) {
  std::unique_ptr<KvStream> s = testutil::MakeStream(GetParam());
  const QuantSpec& spec = s->spec();
  const int d = s->head_dim();
  std::vector<float> k = testutil::MakeKeys(spec.sink + 3, d, 35);
  std::vector<float> v = testutil::MakeValues(spec.sink + 3, d, 36);
  ASSERT_TRUE(testutil::AppendRows(*s, k, v, 0, spec.sink + 3).ok());
  std::vector<uint8_t> page(s->layout().page_bytes);
  absl::Status st = s->AppendPages(page.data(), spec.flush_tokens());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(s->num_tokens(), spec.sink + 3);
}

INSTANTIATE_TEST_SUITE_P(All, RawPagesTest,
                         ::testing::ValuesIn(testutil::StreamParamsWhere(&TakesPages)),
                         [](const auto& info) { return testutil::StreamParamName(info.param); });

}  // namespace
}  // namespace kvq
