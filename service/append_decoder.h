// AppendMessage: a kvq.v1.AppendRequest decoded from its wire bytes with
// its raw pages left where gRPC received them.
//
// Raw pages are almost all of a quantized Append's bytes (~1 MiB
// messages). Parsed as a proto, they are copied out of gRPC's slices into
// the page_data string, then again into the stream's pages. Decoded here,
// chunk.pages.page_data stays in the slices (the message keeps them) and
// KvStream::AppendPages reads it from there through a ByteReader: one copy
// fewer per byte. Every other field is parsed by protobuf as usual. A chunk
// with dense tensors (large fields off that path) is parsed whole by
// protobuf instead, as before, so that its tensors are copied once.
#ifndef KVQ_SERVICE_APPEND_DECODER_H_
#define KVQ_SERVICE_APPEND_DECODER_H_

#include <cstddef>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "kernels/byte_reader.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {

class AppendMessage {
 public:
  // Decodes `buffer`, keeping references to its slices. On success
  // request() holds every field, except that chunk.pages.page_data is empty
  // when page_data_in_place(): its bytes are page_data(). INVALID_ARGUMENT
  // when the bytes are not an AppendRequest.
  absl::Status Decode(const grpc::ByteBuffer& buffer);

  const v1::AppendRequest& request() const { return request_; }
  // Whether chunk.pages.page_data was left in the slices.
  bool page_data_in_place() const { return in_place_; }
  // chunk.pages.page_data: its size and a reader over it (valid while this
  // message is neither decoded again nor destroyed).
  size_t page_data_size() const;
  ByteReader page_data() const;
  // The encoded message's size.
  size_t wire_bytes() const { return wire_bytes_; }

 private:
  std::vector<grpc::Slice> slices_;
  std::vector<ByteReader::Run> page_data_;  // Inside slices_, or request_'s page_data.
  v1::AppendRequest request_;
  bool in_place_ = false;
  size_t wire_bytes_ = 0;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_APPEND_DECODER_H_
