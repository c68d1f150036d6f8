// AppendMessage: a kvq.v1.AppendRequest decoded from the slices gRPC
// received it in, with its raw pages left there (service/in_place_field.h):
// KvStream::AppendPages reads them from the slices straight into the pool,
// one copy fewer per byte than parsing them into page_data first. A dense
// chunk is parsed whole by protobuf, as before.
#ifndef KVQ_SERVICE_APPEND_DECODER_H_
#define KVQ_SERVICE_APPEND_DECODER_H_

#include <cstddef>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"
#include "kernels/byte_reader.h"
#include "kvq/v1/kvq.pb.h"
#include "service/in_place_field.h"

namespace kvq {

class AppendMessage {
 public:
  // Decodes `buffer`, keeping references to its slices. INVALID_ARGUMENT
  // naming the field when the bytes do not parse ("request is not a valid
  // kvq.v1.AppendRequest" when none is at fault) or a string is longer
  // than its bound (service/request_decoder.h).
  absl::Status Decode(const grpc::ByteBuffer& buffer);

  // Every field, except that chunk.pages.page_data is empty when
  // page_data_in_place().
  const v1::AppendRequest& request() const { return request_; }
  // Whether chunk.pages.page_data was left in the slices.
  bool page_data_in_place() const { return field_.found(); }
  // chunk.pages.page_data, wherever it is: its size and a reader over it
  // (valid while this message is neither decoded again nor destroyed).
  size_t page_data_size() const;
  ByteReader page_data() const;
  // The encoded message's size.
  size_t wire_bytes() const { return field_.wire_bytes(); }

 private:
  InPlaceField field_;
  v1::AppendRequest request_;
  std::vector<ByteReader::Run> in_message_;  // page_data parsed into request_.
};

}  // namespace kvq

#endif  // KVQ_SERVICE_APPEND_DECODER_H_
