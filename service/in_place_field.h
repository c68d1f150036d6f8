// InPlaceField: a protobuf message decoded from the slices gRPC received it
// in, with one bytes field left in those slices.
//
// The pages of a quantized Append are almost all of its bytes (~1 MiB).
// Parsed as a proto, they are copied out of gRPC's slices into a string
// before the server copies them again into the pool. Decoded here, every
// other field is parsed by protobuf as usual and the field at `path` (a
// bytes field inside nested messages: AppendRequest.chunk.pages.page_data)
// is read from the slices through a ByteReader. It lies there at any
// address: its reader must not assume alignment. A message with a large
// field off the path (a dense tensor) is parsed whole by protobuf instead,
// so that field is copied once, as before.
#ifndef KVQ_SERVICE_IN_PLACE_FIELD_H_
#define KVQ_SERVICE_IN_PLACE_FIELD_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/byte_reader.h"

namespace kvq {

class InPlaceField {
 public:
  // Decodes `buffer` into `message` (cleared first), keeping references to
  // the slices. The length-delimited fields numbered path[0], path[1], ...
  // lead to the bytes field left in place: when found(), it is empty in
  // `message` and its bytes are field() (the last occurrence, as protobuf
  // merges). INVALID_ARGUMENT "the message is not a <type_name>" when the
  // bytes do not parse.
  absl::Status Decode(const grpc::ByteBuffer& buffer, absl::Span<const uint32_t> path,
                      absl::string_view type_name, google::protobuf::MessageLite* message);

  // Whether the field was present and left in the slices (false for a
  // message protobuf parsed whole: then the field is in the message).
  bool found() const { return found_; }
  // The field's bytes (valid until the next Decode or destruction).
  size_t field_size() const;
  ByteReader field() const { return ByteReader(runs_); }
  // The encoded message's size.
  size_t wire_bytes() const { return wire_bytes_; }

 private:
  std::vector<grpc::Slice> slices_;
  std::vector<ByteReader::Run> runs_;
  bool found_ = false;
  size_t wire_bytes_ = 0;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_IN_PLACE_FIELD_H_
