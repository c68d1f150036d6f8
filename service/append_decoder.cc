#include "service/append_decoder.h"

#include <grpcpp/support/slice.h>

#include <cstdint>
#include <string>

#include "service/request_decoder.h"

namespace kvq {

absl::Status AppendMessage::Decode(const grpc::ByteBuffer& buffer) {
  // AppendRequest.chunk (2) -> KvChunk.pages (4) -> QuantizedPages.page_data (5).
  static constexpr uint32_t kPageData[] = {2, 4, 5};
  in_message_.clear();
  absl::Status st = field_.Decode(buffer, kPageData, "kvq.v1.AppendRequest", &request_);
  if (!st.ok()) {
    // Name the field protobuf refused where one is at fault.
    grpc::Slice whole;
    if (!buffer.DumpToSingleSlice(&whole).ok()) return st;
    return DescribeUndecodable(
        request_, absl::string_view(reinterpret_cast<const char*>(whole.begin()), whole.size()));
  }
  if (!field_.found()) {
    const std::string& d = request_.chunk().pages().page_data();
    if (!d.empty()) in_message_.emplace_back(reinterpret_cast<const uint8_t*>(d.data()), d.size());
  }
  return CheckStringFields(request_);
}

size_t AppendMessage::page_data_size() const {
  return field_.found() ? field_.field_size() : request_.chunk().pages().page_data().size();
}

ByteReader AppendMessage::page_data() const {
  return field_.found() ? field_.field() : ByteReader(in_message_);
}

}  // namespace kvq
