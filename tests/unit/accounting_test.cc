// Byte accounting: what the allocator hands out, what the stream reports and
// what AnalyticBytes() predicts are the same number, split the same way.
#include "kernels/accounting.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "tests/unit/hidden_page_allocator.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::StreamParam;
using testutil::TestAllocator;

std::string Describe(const ByteBreakdown& b) {
  return absl::StrCat("{codes ", b.codes, ", scales ", b.scales, ", outliers ", b.outliers,
                      ", residual ", b.residual, ", sink ", b.sink, ", codebook ", b.codebook,
                      ", padding ", b.padding, "; total ", b.total(), "}");
}

class AccountingTest : public ::testing::TestWithParam<StreamParam> {};

// The body of AllocatorStreamAndAnalyticAgree for either counting
// allocator (host memory, or pages the host cannot address).
template <typename Allocator>
void CheckAllocatorStreamAndAnalyticAgree(const StreamParam& param) {
  const StreamConfig config = param.scheme.Config();
  const int d = config.head_dim;
  const int flush = config.spec.flush_tokens();
  const int n = config.spec.sink + 4 * flush + 37;
  const std::vector<float> k = testutil::MakeKeys(n, d, 3), v = testutil::MakeValues(n, d, 3);
  const std::vector<std::vector<int>> patterns = {{n}, {1}, {37, 5, flush + 1, 2 * flush - 1}};
  for (const std::vector<int>& pattern : patterns) {
    const std::string label = absl::StrCat("appends of {", absl::StrJoin(pattern, ", "), "}");
    Allocator allocator;
    {
      std::unique_ptr<KvStream> s = testutil::MakeStream(param, &allocator);
      ASSERT_NE(s, nullptr);
      int t = 0;
      for (size_t i = 0; t < n; ++i) {
        const int end = std::min(n, t + pattern[i % pattern.size()]);
        ASSERT_TRUE(testutil::AppendRows(*s, k, v, t, end).ok());
        t = end;
        const ByteBreakdown got = s->AllocatedBytes();
        absl::StatusOr<ByteBreakdown> want = AnalyticBytes(config, t);
        ASSERT_TRUE(want.ok()) << want.status();
        ASSERT_EQ(allocator.live_bytes(), got.total())
            << label << " at " << t << " tokens: the allocator holds " << allocator.live_bytes()
            << " bytes, the stream reports " << Describe(got);
        ASSERT_EQ(got, *want) << label << " at " << t << " tokens: stream " << Describe(got)
                              << " vs analytic " << Describe(*want);
      }
      // The code bytes are exactly the quantized tokens' rows.
      const ByteBreakdown b = s->AllocatedBytes();
      EXPECT_EQ(b.codes, static_cast<size_t>(s->quantized_tokens()) *
                             (s->layout().key.code_row_bytes + s->layout().value.code_row_bytes))
          << label;
    }
    EXPECT_EQ(allocator.live_bytes(), 0u) << label << ": freeing the stream returns every byte";
    EXPECT_EQ(allocator.live_blocks(), 0) << label;
    EXPECT_EQ(allocator.bad_frees(), 0) << label << ": a Free did not match its Allocate";
  }
}

TEST_P(AccountingTest, AllocatorStreamAndAnalyticAgree) {
  if (GetParam().hidden_pages) {
    CheckAllocatorStreamAndAnalyticAgree<testutil::HiddenPageAllocator>(GetParam());
  } else {
    CheckAllocatorStreamAndAnalyticAgree<TestAllocator>(GetParam());
  }
}

TEST_P(AccountingTest, EmptyStreamCostsOnlyItsFixedPart) {
  const StreamConfig config = GetParam().scheme.Config();
  TestAllocator allocator;
  std::unique_ptr<KvStream> s = testutil::MakeStream(GetParam(), &allocator);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(allocator.live_bytes(), AuxBytes(config));
  EXPECT_EQ(s->AllocatedBytes(), *AnalyticBytes(config, 0));
  EXPECT_EQ(s->AllocatedBytes().codes, 0u);
  EXPECT_EQ(s->num_pages(), 0);
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndSchemes, AccountingTest,
                         ::testing::ValuesIn(testutil::AllStreamParams()),
                         [](const ::testing::TestParamInfo<StreamParam>& info) {
                           return testutil::StreamParamName(info.param);
                         });
INSTANTIATE_TEST_SUITE_P(HiddenPages, AccountingTest,
                         ::testing::ValuesIn(testutil::HiddenPageStreamParams()),
                         [](const ::testing::TestParamInfo<StreamParam>& info) {
                           return testutil::StreamParamName(info.param);
                         });

StreamConfig Config(const std::string& spec, int head_dim) {
  StreamConfig c;
  c.spec = *QuantSpec::Parse(spec);
  c.head_dim = head_dim;
  return c;
}

// The headline case: kivi2 g32 r128, head_dim 64, 4096 tokens.
TEST(AccountingClosedFormTest, Kivi2G32R128HeadDim64At4096) {
  absl::StatusOr<ByteBreakdown> b = AnalyticBytes(Config("kivi2:g32:r128", 64), 4096);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->codes, 4096u * 64 * 2 * 2 / 8) << "2 bits x K and V";
  EXPECT_EQ(b->scales, (4096u / 32) * 2 * 64 * 2 + 4096u * 2 * 2 * 2)
      << "keys: per 32-token block scale+zero per channel; values: per token 2 groups";
  EXPECT_EQ(b->outliers, 0u);
  EXPECT_EQ(b->residual, 128u * 64 * 2 * 2) << "R rows of K and V in fp16";
  EXPECT_EQ(b->sink, 0u);
  EXPECT_EQ(b->codebook, 0u);
  // Pages are exactly full (32 tokens, sections already aligned); the aux
  // block pads its 8-byte header to 64.
  EXPECT_EQ(b->padding, 64u);
  EXPECT_NEAR(b->BitsPerElement(4096, 64), 8.0 * (131072 + 65536 + 32768 + 64) / (2 * 4096 * 64),
              1e-12);
  EXPECT_DOUBLE_EQ(NominalBitsPerElement(Config("kivi2:g32:r128", 64)), 3.0)
      << "2 code bits + 1 bit of fp16 scale/zero per 32 elements";
}

TEST(AccountingClosedFormTest, Fp16At100Tokens) {
  absl::StatusOr<ByteBreakdown> b = AnalyticBytes(Config("fp16", 128), 100);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->codes, 100u * 128 * 2 * 2);
  EXPECT_EQ(b->scales, 0u);
  EXPECT_EQ(b->residual, 0u);
  // 4 pages of 32 tokens: 28 unused rows of K and V.
  EXPECT_EQ(b->padding, 28u * 128 * 2 * 2);
  EXPECT_EQ(b->total(), 4u * 16384);
  EXPECT_DOUBLE_EQ(NominalBitsPerElement(Config("fp16", 128)), 16.0);
}

TEST(AccountingClosedFormTest, Int8AndFp8) {
  absl::StatusOr<ByteBreakdown> i8 = AnalyticBytes(Config("int8", 64), 64);
  ASSERT_TRUE(i8.ok());
  EXPECT_EQ(i8->codes, 64u * 64 * 2);
  EXPECT_EQ(i8->scales, 64u * 2 * 2 * 2) << "per token scale+zero, K and V";
  EXPECT_EQ(i8->padding, 0u);
  EXPECT_DOUBLE_EQ(NominalBitsPerElement(Config("int8", 64)), 8.5);
  absl::StatusOr<ByteBreakdown> f8 = AnalyticBytes(Config("fp8_e4m3", 64), 10);
  ASSERT_TRUE(f8.ok());
  EXPECT_EQ(f8->codes, 10u * 64 * 2);
  EXPECT_EQ(f8->scales, 8u) << "the two per-stream fp32 scales";
  EXPECT_EQ(f8->padding, (32u - 10) * 64 * 2 + (64 - 8)) << "unused rows + header padding";
  EXPECT_EQ(f8->total(), 4096u + 64);
}

TEST(AccountingClosedFormTest, KiviWithSinkOutliersAndCodebook) {
  // kivi4 g32 r64, head_dim 64, outliers=1, sink=4, nuq at 4 + 64*3 + 10 tokens.
  const StreamConfig c = Config("kivi4:g32:r64:outliers=1:sink=4:nuq", 64);
  absl::StatusOr<ByteBreakdown> b = AnalyticBytes(c, 4 + 192 + 10);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->codes, 192u * 64 * 4 / 8 * 2);
  EXPECT_EQ(b->scales, 6u * 2 * 64 * 2 + 192u * 2 * 2 * 2);
  EXPECT_EQ(b->outliers, 6u * 21 * 4 * 2) << "21 entries of 4 bytes per block per side";
  EXPECT_EQ(b->sink, 4u * 64 * 2 * 2);
  EXPECT_EQ(b->residual, 64u * 64 * 2 * 2);
  EXPECT_EQ(b->codebook, 2u * 64 * 16 * 2) << "16 fp16 levels per channel per side";
  EXPECT_EQ(b->total() % kPageAlign, 0u);
}

TEST(AccountingClosedFormTest, SinkTokensAreNeverQuantized) {
  const StreamConfig c = Config("kivi2:sink=4", 64);
  for (int tokens : {0, 1, 4, 5, 131, 132, 133}) {
    absl::StatusOr<ByteBreakdown> b = AnalyticBytes(c, tokens);
    ASSERT_TRUE(b.ok());
    const int quantized = tokens >= 132 ? 128 : 0;
    EXPECT_EQ(b->codes, static_cast<size_t>(quantized) * 64 * 2 * 2 / 8) << tokens << " tokens";
  }
}

TEST(AccountingClosedFormTest, BreakdownSums) {
  ByteBreakdown a{1, 2, 3, 4, 5, 6, 7}, b{10, 20, 30, 40, 50, 60, 70};
  a += b;
  EXPECT_EQ(a, (ByteBreakdown{11, 22, 33, 44, 55, 66, 77}));
  EXPECT_EQ(a.total(), 308u);
  EXPECT_EQ(ByteBreakdown{}.BitsPerElement(0, 64), 0.0);
}

TEST(AccountingClosedFormTest, AnalyticRejectsBadConfig) {
  absl::StatusOr<ByteBreakdown> b = AnalyticBytes(Config("kivi2", 72), 10);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.status().message(), "head_dim must be a multiple of 16 in [16, 256], got 72");
}

}  // namespace
}  // namespace kvq
