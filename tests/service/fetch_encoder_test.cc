// DenseFetchMessage and RawFetchMessage write exactly the bytes protobuf
// serializes for the same FetchResponse, so clients parse them as one.
#include "service/fetch_encoder.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

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

class RawFetchEncoderTest : public ::testing::TestWithParam<RawCase> {};

TEST_P(RawFetchEncoderTest, BytesEqualProtobufSerialization) {
  const RawCase& c = GetParam();
  const size_t n = static_cast<size_t>(c.pages) * static_cast<size_t>(c.page_bytes);
  std::string data(n, '\0');
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>(i * 11 + 3);
  RawFetchMessage m(c.layer, c.token_begin, c.layers, c.tokens, c.page_bytes, c.page_tokens, n,
                    c.range_layer_end, c.range_token_end);
  if (n > 0) std::memcpy(m.page_data(), data.data(), n);
  const size_t size = m.size();
  const std::string ours = Bytes(m.Release());

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

INSTANTIATE_TEST_SUITE_P(
    Pages, RawFetchEncoderTest,
    ::testing::Values(
        RawCase{0, 0, 1, 32, 1728, 32, 1, 0, 0},            // Defaults omitted.
        RawCase{0, 4, 1, 4096, 2304, 32, 3 * 128, 30, 4100},  // A first message, ~864 KiB.
        RawCase{29, 4064, 1, 32, 1728, 32, 3, 0, 0},          // Multi-byte varints.
        RawCase{1, 0, 1, 96, 300000, 32, 4, 0, 0},           // 1.2 MB: 3-byte lengths.
        RawCase{0, 0, 0, 0, 0, 0, 0, 0, 0}));                  // Empty pages, still present.

}  // namespace
}  // namespace kvq
