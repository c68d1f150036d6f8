// KvStream::Fork: prefix sharing copy-on-write.
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::AllStreamParams;
using testutil::StreamParam;

class ForkTest : public ::testing::TestWithParam<StreamParam> {};

TEST_P(ForkTest, WholeForkReadsTheSameAndDivergesIndependently) {
  testutil::TestAllocator alloc;
  {
    std::unique_ptr<KvStream> src = testutil::MakeStream(GetParam(), &alloc);
    const int d = src->head_dim();
    const int n = 300;
    std::vector<float> k = testutil::MakeKeys(n + 64, d, 11);
    std::vector<float> v = testutil::MakeValues(n + 64, d, 12);
    ASSERT_TRUE(testutil::AppendRows(*src, k, v, 0, n).ok());
    const size_t before = alloc.live_bytes();

    absl::StatusOr<std::unique_ptr<KvStream>> fork = src->Fork(n);
    ASSERT_TRUE(fork.ok()) << fork.status();
    EXPECT_EQ((*fork)->num_tokens(), n);
    for (Side side : {Side::kKey, Side::kValue}) {
      EXPECT_EQ(testutil::ReadSide(**fork, side, 0, n), testutil::ReadSide(*src, side, 0, n));
    }
    // Full pages are shared: the fork costs at most one page plus its aux block.
    EXPECT_LE(alloc.live_bytes() - before,
              src->layout().page_bytes + AuxBytes(src->config()));

    // Appending different tokens to each leaves the other untouched.
    const std::vector<float> src_k = testutil::ReadSide(*src, Side::kKey, 0, n);
    ASSERT_TRUE(testutil::AppendRows(**fork, k, v, n, n + 64).ok());
    EXPECT_EQ(testutil::ReadSide(*src, Side::kKey, 0, n), src_k);
    // (The fork's own append may have flushed its tail, so compare the fork
    // with itself before and after the source appends.)
    const std::vector<float> fork_k = testutil::ReadSide(**fork, Side::kKey, 0, n + 64);
    std::vector<float> k2 = testutil::MakeKeys(n + 64, d, 21);
    std::vector<float> v2 = testutil::MakeValues(n + 64, d, 22);
    ASSERT_TRUE(testutil::AppendRows(*src, k2, v2, n, n + 64).ok());
    EXPECT_EQ(testutil::ReadSide(**fork, Side::kKey, 0, n + 64), fork_k);
    EXPECT_NE(testutil::ReadSide(**fork, Side::kKey, n, n + 64),
              testutil::ReadSide(*src, Side::kKey, n, n + 64));
    EXPECT_EQ(alloc.bad_frees(), 0);
  }
  EXPECT_EQ(alloc.live_bytes(), 0u) << "streams must release every reference";
  EXPECT_EQ(alloc.bad_frees(), 0);
}

TEST_P(ForkTest, PrefixForkOnlyOnBlockBoundaries) {
  std::unique_ptr<KvStream> src = testutil::MakeStream(GetParam());
  const int d = src->head_dim();
  const int n = 700;
  std::vector<float> k = testutil::MakeKeys(n, d, 13);
  std::vector<float> v = testutil::MakeValues(n, d, 14);
  ASSERT_TRUE(testutil::AppendRows(*src, k, v, 0, n).ok());
  const QuantSpec& spec = src->spec();
  const int boundary = spec.sink + spec.flush_tokens() * (src->quantized_tokens() > 0 ? 1 : 0);
  absl::StatusOr<std::unique_ptr<KvStream>> fork = src->Fork(boundary);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(testutil::ReadSide(**fork, Side::kValue, 0, boundary),
            testutil::ReadSide(*src, Side::kValue, 0, boundary));
  if (spec.flush_tokens() > 1) {
    absl::StatusOr<std::unique_ptr<KvStream>> bad = src->Fork(spec.sink + 1 + spec.flush_tokens());
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(bad.status().message().find("splits a quantization block"), absl::string_view::npos)
        << bad.status();
  }
  EXPECT_EQ(src->Fork(n + 1).status().code(), absl::StatusCode::kOutOfRange);
}

INSTANTIATE_TEST_SUITE_P(All, ForkTest, ::testing::ValuesIn(AllStreamParams()),
                         [](const auto& info) { return testutil::StreamParamName(info.param); });
INSTANTIATE_TEST_SUITE_P(HiddenPages, ForkTest,
                         ::testing::ValuesIn(testutil::HiddenPageStreamParams()),
                         [](const auto& info) { return testutil::StreamParamName(info.param); });

}  // namespace
}  // namespace kvq
