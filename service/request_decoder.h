// DecodeRequest: a request message from the bytes gRPC received, checked
// against the contract's bounds on its strings before any handler sees it.
//
// Every method of the service is raw (grpc::ByteBuffer): gRPC's own
// decoding answers a message that does not parse with UNIMPLEMENTED and no
// message. Here the answer is INVALID_ARGUMENT naming the field (a string
// that is not valid UTF-8: "items[2].sequence.sequence_id is not valid
// UTF-8"), or "request is not a valid kvq.v1.X" when the bytes are not a
// protobuf message of that type at all.
#ifndef KVQ_SERVICE_REQUEST_DECODER_H_
#define KVQ_SERVICE_REQUEST_DECODER_H_

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <grpcpp/support/byte_buffer.h>

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvq {

// Longest id or namespace (sequence_id, namespace, new_sequence_id,
// session_id), and longest scheme string, in bytes: the bounds the proto
// documents.
inline constexpr size_t kMaxNameBytes = 128;
inline constexpr size_t kMaxSchemeBytes = 256;

// The bound of a string field of a request: kMaxSchemeBytes for `scheme`,
// kMaxNameBytes for every other.
size_t StringFieldLimit(const google::protobuf::FieldDescriptor& field);

// INVALID_ARGUMENT naming the first string field of `message` (its path:
// "items[3].sequence.namespace") longer than its StringFieldLimit, and the
// limit; OK when every one fits.
absl::Status CheckStringFields(const google::protobuf::Message& message);

// Why `bytes` do not parse as a message of `prototype`'s type:
// INVALID_ARGUMENT "<path> is not valid UTF-8" for a string field protobuf
// refuses, otherwise "request is not a valid <full type name>".
absl::Status DescribeUndecodable(const google::protobuf::Message& prototype,
                                 absl::string_view bytes);

// Parses `buffer` into `message` (cleared first), then CheckStringFields.
absl::Status DecodeRequest(const grpc::ByteBuffer& buffer, google::protobuf::Message* message);

// `message` serialized into `buffer` (its previous contents dropped).
absl::Status EncodeResponse(const google::protobuf::Message& message, grpc::ByteBuffer* buffer);

}  // namespace kvq

#endif  // KVQ_SERVICE_REQUEST_DECODER_H_
