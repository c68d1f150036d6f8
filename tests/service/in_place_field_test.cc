// InPlaceField on another message and path than the server's Append
// (append_decoder_test): a raw FetchResponse's page_data stays in the
// slices, the rest parses as protobuf, dense messages parse whole, bad
// bytes name the type.
#include "service/in_place_field.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {
namespace {

constexpr uint32_t kPageData[] = {5, 5};  // FetchResponse.pages.page_data.

grpc::ByteBuffer Sliced(const std::string& bytes, size_t cut) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += cut) {
    slices.emplace_back(bytes.data() + at, std::min(cut, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(InPlaceFieldTest, RawFetchPagesStayInTheSlices) {
  v1::FetchResponse want;
  want.set_layer(7);
  want.set_token_begin(36);
  want.mutable_pages()->set_tokens(64);
  want.mutable_pages()->set_page_bytes(1728);
  std::string data(3 * 1728 * 2, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 13);
  want.mutable_pages()->set_page_data(data);
  want.set_range_token_end(4100);
  const std::string wire = want.SerializeAsString();
  for (size_t cut : {size_t{1}, size_t{1000}, wire.size()}) {
    InPlaceField field;
    v1::FetchResponse got;
    ASSERT_TRUE(field.Decode(Sliced(wire, cut), kPageData, "kvq.v1.FetchResponse", &got).ok());
    ASSERT_TRUE(field.found());
    EXPECT_EQ(field.wire_bytes(), wire.size());
    EXPECT_EQ(field.field_size(), data.size());
    std::string read(data.size(), '\0');
    field.field().Read(read.size(), reinterpret_cast<uint8_t*>(read.data()));
    EXPECT_EQ(read, data);
    v1::FetchResponse rest = want;
    rest.mutable_pages()->clear_page_data();
    EXPECT_EQ(got.SerializeAsString(), rest.SerializeAsString()) << cut;
  }
}

TEST(InPlaceFieldTest, DenseMessagesParseWholeAndBadBytesNameTheType) {
  v1::FetchResponse dense;
  dense.set_layer(1);
  dense.mutable_k()->set_data(std::string(10000, 'k'));
  dense.mutable_v()->set_data(std::string(10000, 'v'));
  const std::string wire = dense.SerializeAsString();
  InPlaceField field;
  v1::FetchResponse got;
  ASSERT_TRUE(field.Decode(Sliced(wire, 777), kPageData, "kvq.v1.FetchResponse", &got).ok());
  EXPECT_FALSE(field.found());
  EXPECT_EQ(field.field_size(), 0u);
  EXPECT_EQ(got.SerializeAsString(), wire);
  for (const std::string& bad : {wire.substr(0, 100), std::string("\x2a\x05\x2a\x7f", 4)}) {
    EXPECT_EQ(field.Decode(Sliced(bad, 7), kPageData, "kvq.v1.FetchResponse", &got),
              absl::InvalidArgumentError("the message is not a kvq.v1.FetchResponse"));
    EXPECT_FALSE(field.found());
  }
}

// Found by tests/fuzz/append_decoder_fuzz: a tag spelled in more than five
// bytes (protobuf refuses it) was re-encoded shorter, and the rest then
// parsed, so the decoder took bytes protobuf refuses.
TEST(InPlaceFieldTest, TagsAreReadAsProtobufReadsThem) {
  constexpr uint32_t kAppendPageData[] = {2, 4, 5};
  using namespace std::string_literals;
  const std::string six_byte_tag = "\xc2\xc2\xc2\xc2\xc2\x00\x00\x12\x00"s;
  v1::AppendRequest check;
  ASSERT_FALSE(check.ParseFromString(six_byte_tag));
  InPlaceField field;
  v1::AppendRequest got;
  const absl::Status st =
      field.Decode(Sliced(six_byte_tag, 4), kAppendPageData, "kvq.v1.AppendRequest", &got);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "the message is not a kvq.v1.AppendRequest");

  // Five bytes whose high bits protobuf drops: field 2 (chunk), as protobuf
  // reads it, with the pages left in place.
  v1::AppendRequest inner;
  inner.mutable_chunk()->mutable_pages()->set_page_data("pages");
  const std::string chunk = inner.SerializeAsString().substr(1);  // Without chunk's tag.
  const std::string five_byte_tag = "\x92\x80\x80\x80\x10"s + chunk;
  v1::AppendRequest want;
  ASSERT_TRUE(want.ParseFromString(five_byte_tag));
  ASSERT_EQ(want.chunk().pages().page_data(), "pages");
  ASSERT_TRUE(field.Decode(Sliced(five_byte_tag, 3), kAppendPageData, "kvq.v1.AppendRequest", &got)
                  .ok());
  EXPECT_TRUE(field.found());
  EXPECT_EQ(field.field_size(), 5u);
}

}  // namespace
}  // namespace kvq
