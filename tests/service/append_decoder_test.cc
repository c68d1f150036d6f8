// AppendMessage decodes what protobuf decodes, whatever slices the bytes
// arrive in, with raw pages left in the slices; dense chunks and malformed
// bytes take protobuf's path and its verdict.
#include "service/append_decoder.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvq {
namespace {

// `bytes` in slices of the sizes in `cuts`, cycled.
grpc::ByteBuffer Sliced(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0, i = 0; at < bytes.size(); ++i) {
    const size_t n = std::min(cuts[i % cuts.size()], bytes.size() - at);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Read(const AppendMessage& m) {
  ByteReader r = m.page_data();
  std::string out(r.remaining(), '\0');
  r.Read(out.size(), reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

v1::AppendRequest RawRequest(size_t page_data_bytes) {
  v1::AppendRequest r;
  r.mutable_sequence()->set_namespace_("tenant");
  r.mutable_sequence()->set_sequence_id("seq-1");
  v1::KvChunk* c = r.mutable_chunk();
  c->set_layer_begin(3);
  v1::QuantizedPages* p = c->mutable_pages();
  p->set_layers(2);
  p->set_tokens(-1);  // Negative: a ten-byte varint, kept as it is.
  p->set_page_bytes(2304);
  p->set_page_tokens(32);
  std::string data(page_data_bytes, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31 + 7);
  p->set_page_data(data);
  for (int t : {5, 9, 100000}) r.add_token_ids(t);
  return r;
}

const std::vector<std::vector<size_t>> kCuts = {{1u << 30}, {1}, {3, 5, 700}, {16384}};

TEST(AppendDecoderTest, RawPagesStayInTheSlicesAndTheRestParsesAsProtobuf) {
  for (size_t bytes : {size_t{64}, size_t{100000}}) {
    const v1::AppendRequest want = RawRequest(bytes);
    const std::string wire = want.SerializeAsString();
    for (const std::vector<size_t>& cuts : kCuts) {
      AppendMessage m;
      ASSERT_TRUE(m.Decode(Sliced(wire, cuts)).ok());
      EXPECT_TRUE(m.page_data_in_place());
      EXPECT_EQ(m.wire_bytes(), wire.size());
      EXPECT_EQ(m.page_data_size(), bytes);
      EXPECT_EQ(Read(m), want.chunk().pages().page_data()) << cuts[0];
      v1::AppendRequest rest = want;
      rest.mutable_chunk()->mutable_pages()->clear_page_data();
      EXPECT_EQ(m.request().SerializeAsString(), rest.SerializeAsString()) << cuts[0];
      EXPECT_TRUE(m.request().chunk().has_pages());
    }
  }
}

TEST(AppendDecoderTest, TheLastPageDataOfAMergedMessageWins) {
  // Two serialized messages end to end parse as their merge.
  const v1::AppendRequest first = RawRequest(300), second = RawRequest(500);
  const std::string wire = first.SerializeAsString() + second.SerializeAsString();
  v1::AppendRequest want;
  ASSERT_TRUE(want.ParseFromString(wire));
  AppendMessage m;
  ASSERT_TRUE(m.Decode(Sliced(wire, {77})).ok());
  EXPECT_EQ(Read(m), want.chunk().pages().page_data());
  want.mutable_chunk()->mutable_pages()->clear_page_data();
  EXPECT_EQ(m.request().SerializeAsString(), want.SerializeAsString());
}

TEST(AppendDecoderTest, DenseChunksAndEmptyPagesParseWhole) {
  for (size_t data_bytes : {size_t{100}, size_t{1} << 20}) {  // Below and above the large field.
    v1::AppendRequest want;
    want.mutable_sequence()->set_sequence_id("dense");
    v1::Tensor* k = want.mutable_chunk()->mutable_k();
    k->set_dtype(v1::DTYPE_FP16);
    for (int64_t d : {int64_t{1}, int64_t{3}, static_cast<int64_t>(data_bytes / 384), int64_t{64}}) {
      k->add_shape(d);
    }
    k->set_data(std::string(data_bytes, 'k'));
    *want.mutable_chunk()->mutable_v() = *k;
    const std::string wire = want.SerializeAsString();
    for (const std::vector<size_t>& cuts : kCuts) {
      AppendMessage m;
      ASSERT_TRUE(m.Decode(Sliced(wire, cuts)).ok());
      EXPECT_FALSE(m.page_data_in_place());
      EXPECT_EQ(m.page_data_size(), 0u);
      EXPECT_EQ(m.request().SerializeAsString(), wire);
    }
  }
  v1::AppendRequest empty = RawRequest(0);
  AppendMessage m;
  ASSERT_TRUE(m.Decode(Sliced(empty.SerializeAsString(), {9})).ok());
  EXPECT_FALSE(m.page_data_in_place());
  EXPECT_EQ(m.page_data_size(), 0u);
  EXPECT_TRUE(m.request().chunk().has_pages());
  EXPECT_EQ(m.request().SerializeAsString(), empty.SerializeAsString());
}

TEST(AppendDecoderTest, MalformedBytesAreRefused) {
  const std::string wire = RawRequest(1000).SerializeAsString();
  const absl::Status refused =
      absl::InvalidArgumentError("request is not a valid kvq.v1.AppendRequest");
  for (const std::string& bad :
       {wire.substr(0, wire.size() - 1),           // page_data cut short.
        wire.substr(0, 3),                         // Inside the sequence.
        std::string("\x13", 1) + wire,             // A group start (wire type 3).
        std::string("\x00", 1) + wire,             // Field number 0.
        std::string(11, '\xff')}) {                // A varint of more than ten bytes.
    for (const std::vector<size_t>& cuts : kCuts) {
      AppendMessage m;
      EXPECT_EQ(m.Decode(Sliced(bad, cuts)), refused) << bad.size() << " bytes";
    }
  }
}

}  // namespace
}  // namespace kvq
