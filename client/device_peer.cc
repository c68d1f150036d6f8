#include "client/device_peer.h"

#include "absl/strings/str_cat.h"

namespace kvq {

absl::string_view PayloadTransportName(PayloadTransport t) {
  switch (t) {
    case PayloadTransport::kGrpc: return "grpc";
    case PayloadTransport::kCudaIpc: return "cuda_ipc";
    case PayloadTransport::kNccl: return "nccl";
  }
  return "unknown";
}

absl::StatusOr<PayloadTransport> ParsePayloadTransport(absl::string_view name) {
  for (PayloadTransport t :
       {PayloadTransport::kGrpc, PayloadTransport::kCudaIpc, PayloadTransport::kNccl}) {
    if (name == PayloadTransportName(t)) return t;
  }
  return absl::InvalidArgumentError(absl::StrCat("transport = \"", name,
                                                 "\" must be \"grpc\", \"cuda_ipc\" or \"nccl\""));
}

}  // namespace kvq
