// grpc::Status <-> absl::Status at the RPC edge of the client library.
#ifndef KVQ_CLIENT_GRPC_STATUS_H_
#define KVQ_CLIENT_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvq {

// Same code, same message (the codes share their numbering). A code outside
// the canonical range becomes UNKNOWN.
absl::Status FromGrpcStatus(const grpc::Status& status);
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace kvq

#endif  // KVQ_CLIENT_GRPC_STATUS_H_
