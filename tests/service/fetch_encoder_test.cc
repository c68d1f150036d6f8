// DenseFetchMessage and RawFetchMessage write exactly the bytes protobuf
// serializes for the same FetchResponse, so clients parse them as one; the
// pages RawFetchMessage shares stay referenced exactly as long as its
// buffer.
#include "service/fetch_encoder.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "service/page_pool.h"

namespace kvq {
namespace {

std::string Bytes(grpc::ByteBuffer buf) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buf.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

// A FetchResponse with the fields every message carries.
v1::FetchResponse Header(int32_t layer, int32_t token_begin, int32_t range_layer_end,
                         int32_t range_token_end) {
  v1::FetchResponse r;
  r.set_layer(layer);
  r.set_token_begin(token_begin);
  r.set_range_layer_end(range_layer_end);
  r.set_range_token_end(range_token_end);
  return r;
}

struct Case {
  int32_t layer, token_begin, range_layer_end, range_token_end;
  v1::DType dtype;
  std::array<int64_t, 3> shape;
  size_t bytes_per_element;
};

class FetchEncoderTest : public ::testing::TestWithParam<Case> {};

TEST_P(FetchEncoderTest, BytesEqualProtobufSerialization) {
  const Case& c = GetParam();
  const size_t n = static_cast<size_t>(c.shape[0] * c.shape[1] * c.shape[2]) * c.bytes_per_element;
  std::string k(n, '\0'), v(n, '\0');
  for (size_t i = 0; i < n; ++i) {
    k[i] = static_cast<char>(i * 7 + 1);
    v[i] = static_cast<char>(i * 13 + 5);
  }
  DenseFetchMessage m(c.layer, c.token_begin, c.dtype, c.shape, n, c.range_layer_end,
                      c.range_token_end);
  if (n > 0) {
    std::memcpy(m.k_data(), k.data(), n);
    std::memcpy(m.v_data(), v.data(), n);
  }
  const size_t size = m.size();
  const std::string ours = Bytes(m.Release());

  v1::FetchResponse r = Header(c.layer, c.token_begin, c.range_layer_end, c.range_token_end);
  for (auto [t, data] : {std::pair{r.mutable_k(), &k}, std::pair{r.mutable_v(), &v}}) {
    t->set_dtype(c.dtype);
    for (int64_t d : c.shape) t->add_shape(d);
    t->set_data(*data);
  }
  EXPECT_EQ(ours, r.SerializeAsString());
  EXPECT_EQ(size, r.ByteSizeLong());
  v1::FetchResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(ours));
  EXPECT_EQ(parsed.k().data(), k);
  EXPECT_EQ(parsed.v().shape(2), c.shape[2]);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FetchEncoderTest,
    ::testing::Values(
        Case{0, 0, 0, 0, v1::DTYPE_FP16, {3, 5, 64}, 2},               // Defaults omitted.
        Case{0, 0, 30, 4096, v1::DTYPE_FP16, {3, 5, 64}, 2},           // A first message.
        Case{29, 4090, 0, 0, v1::DTYPE_FP32, {8, 7, 128}, 4},          // Multi-byte varints.
        Case{1, 200000, 2, 300000, v1::DTYPE_BF16, {3, 2730, 64}, 2},  // ~1 MiB, 3-byte lengths.
        Case{2, 17, 0, 0, v1::DTYPE_FP16, {3, 0, 64}, 2},              // No tokens: no data field.
        Case{0, 0, 0, 0, v1::DTYPE_UNSPECIFIED, {1, 1, 16}, 2}));      // dtype 0 omitted.

struct RawCase {
  int32_t layer, token_begin, layers, tokens;
  int64_t page_bytes;
  int32_t page_tokens, pages, range_layer_end, range_token_end;
};

// Counts the references RawFetchMessage takes and drops on blocks it
// shares; the blocks live in the test's own buffer.
class CountingAllocator final : public PageAllocator {
 public:
  absl::StatusOr<uint8_t*> Allocate(size_t) override {
    ADD_FAILURE() << "RawFetchMessage takes references; it never allocates";
    return absl::ResourceExhaustedError("the counting allocator holds no memory");
  }
  void Retain(uint8_t* block, size_t bytes) override {
    ++refs[block];
    EXPECT_EQ(bytes, expected_bytes);
  }
  void Free(uint8_t* block, size_t bytes) override {
    EXPECT_GT(refs[block]--, 0) << "a reference dropped twice";
    EXPECT_EQ(bytes, expected_bytes);
  }
  int live() const {
    int n = 0;
    for (const auto& [block, count] : refs) n += count;
    return n;
  }

  std::map<const uint8_t*, int> refs;
  size_t expected_bytes = 0;
};

// How page_data is given: all copied, all shared (adjacent pages, one run),
// or alternating (every shared page its own run).
enum class Add { kCopy, kShare, kAlternate };

class RawFetchEncoderTest
    : public ::testing::TestWithParam<std::tuple<RawCase, Add>> {};

TEST_P(RawFetchEncoderTest, BytesEqualProtobufSerialization) {
  const auto& [c, add] = GetParam();
  const size_t n = static_cast<size_t>(c.pages) * static_cast<size_t>(c.page_bytes);
  std::string data(n, '\0');
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>(i * 11 + 3);
  auto owner = std::make_shared<CountingAllocator>();
  owner->expected_bytes = static_cast<size_t>(c.page_bytes);
  std::string ours;
  size_t size = 0;
  {
    RawFetchMessage m(c.layer, c.token_begin, c.layers, c.tokens, c.page_bytes, c.page_tokens, n,
                      c.range_layer_end, c.range_token_end);
    for (int i = 0; i < c.pages; ++i) {
      const auto* page = reinterpret_cast<const uint8_t*>(data.data()) + i * c.page_bytes;
      if (add == Add::kCopy || (add == Add::kAlternate && i % 2 == 1)) {
        m.AddCopy(page, c.page_bytes);
      } else {
        m.AddShared(owner, page, c.page_bytes);
      }
    }
    EXPECT_EQ(m.data_added(), n);
    size = m.size();
    grpc::ByteBuffer buf = m.Release();
    const int shared = add == Add::kCopy ? 0 : add == Add::kShare ? c.pages : (c.pages + 1) / 2;
    EXPECT_EQ(owner->live(), shared) << "one reference per shared page while the buffer lives";
    ours = Bytes(buf);
    EXPECT_EQ(owner->live(), shared);
  }
  EXPECT_EQ(owner->live(), 0) << "the buffer's last slice dropped every reference";

  v1::FetchResponse r = Header(c.layer, c.token_begin, c.range_layer_end, c.range_token_end);
  v1::QuantizedPages* p = r.mutable_pages();
  p->set_layers(c.layers);
  p->set_tokens(c.tokens);
  p->set_page_bytes(c.page_bytes);
  p->set_page_tokens(c.page_tokens);
  p->set_page_data(data);
  EXPECT_EQ(ours, r.SerializeAsString());
  EXPECT_EQ(size, r.ByteSizeLong());
  v1::FetchResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(ours));
  EXPECT_TRUE(parsed.has_pages());
  EXPECT_EQ(parsed.pages().page_data(), data);
  EXPECT_EQ(parsed.pages().page_bytes(), c.page_bytes);
}

TEST(RawFetchMessageTest, AnAbandonedMessageDropsItsReferences) {
  std::string data(3 * 64, 'x');
  auto owner = std::make_shared<CountingAllocator>();
  owner->expected_bytes = 64;
  {
    RawFetchMessage m(0, 0, 1, 96, 64, 32, data.size());
    const auto* base = reinterpret_cast<const uint8_t*>(data.data());
    m.AddShared(owner, base, 64);
    m.AddCopy(base + 64, 64);
    m.AddShared(owner, base + 128, 64);  // Still an open run when dropped.
    EXPECT_EQ(owner->live(), 2);
  }
  EXPECT_EQ(owner->live(), 0);
}

// A page shared into a message outlives the stream that dropped it, and
// the pool outlives its last other owner, until gRPC drops the buffer: what
// lets FetchDequant send pages of a sequence released (or evicted) while
// its messages are in flight, and a server stop before the transport lets
// go of them.
TEST(RawFetchMessageTest, SharedPagesOutliveTheirStreamAndThePool) {
  absl::StatusOr<std::unique_ptr<PagePool>> made = PagePool::Create({size_t{4} << 20, size_t{1} << 20});
  ASSERT_TRUE(made.ok()) << made.status();
  std::shared_ptr<PagePool> pool = std::move(*made);
  constexpr size_t kPage = 2304;
  std::string want;
  grpc::ByteBuffer buf;
  {
    RawFetchMessage m(0, 0, 1, 64, kPage, 32, 2 * kPage);
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<uint8_t*> page = pool->Allocate(kPage);
      ASSERT_TRUE(page.ok());
      std::memset(*page, 'a' + i, kPage);
      want.append(kPage, static_cast<char>('a' + i));
      m.AddShared(pool, *page, kPage);
      pool->Free(*page, kPage);  // The stream's reference goes: the message's stays.
    }
    buf = m.Release();
  }
  EXPECT_EQ(pool->Stats().blocks_used, 2u);
  std::weak_ptr<PagePool> watch = pool;
  pool.reset();
  ASSERT_FALSE(watch.expired()) << "the buffer keeps the pool";
  const std::string bytes = Bytes(buf);
  EXPECT_EQ(bytes.substr(bytes.size() - want.size()), want);
  buf.Clear();
  EXPECT_TRUE(watch.expired()) << "the last slice let the pool go";
}

INSTANTIATE_TEST_SUITE_P(
    Pages, RawFetchEncoderTest,
    ::testing::Combine(
        ::testing::Values(
            RawCase{0, 0, 1, 32, 1728, 32, 1, 0, 0},              // Defaults omitted.
            RawCase{0, 4, 1, 4096, 2304, 32, 3 * 128, 30, 4100},  // A first message, ~864 KiB.
            RawCase{29, 4064, 1, 32, 1728, 32, 3, 0, 0},          // Multi-byte varints.
            RawCase{1, 0, 1, 96, 300000, 32, 4, 0, 0},            // 1.2 MB: 3-byte lengths.
            RawCase{0, 0, 0, 0, 0, 0, 0, 0, 0}),                  // Empty pages, still present.
        ::testing::Values(Add::kCopy, Add::kShare, Add::kAlternate)));

}  // namespace
}  // namespace kvq
