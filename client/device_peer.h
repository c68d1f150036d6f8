// DevicePeer: the client's side of a device payload path (docs/TRANSPORT.md).
// AppendPrompt and FetchDequantInto take one in their options when
// `transport` is not kGrpc; the bytes then move GPU to GPU and the RPC
// carries descriptors only. The CUDA implementations are in
// client/cuda_device_peers.h (its own target, kvq_cuda_peers); tests use an
// in-process fake.
//
// Plain C++ and absl only, so the CUDA peers' target adds CUDA to the client
// and the client library itself needs none.
#ifndef KVQ_CLIENT_DEVICE_PEER_H_
#define KVQ_CLIENT_DEVICE_PEER_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvq {

// How an Append's or a Fetch's K/V bytes travel.
enum class PayloadTransport {
  kGrpc,     // In the messages (the default).
  kCudaIpc,  // Same node: the server maps a CUDA IPC handle of the client's memory.
  kNccl,     // Across nodes: ncclSend/ncclRecv over a session (OpenTransfer).
};

// "grpc", "cuda_ipc", "nccl".
absl::string_view PayloadTransportName(PayloadTransport t);
// The inverse; INVALID_ARGUMENT naming the accepted names.
absl::StatusOr<PayloadTransport> ParsePayloadTransport(absl::string_view name);

// A device allocation exported for another process (cudaIpcMemHandle_t).
struct IpcExport {
  std::string handle;  // The handle's bytes.
  int64_t offset = 0;  // Of the exported pointer inside the allocation.
  int device = 0;
};

// What OpenTransfer answered: the session to join.
struct SessionJoin {
  std::string session_id;
  std::string nccl_unique_id;
  int world_size = 2;
  int server_rank = 0;
  int client_rank = 1;
};

class DevicePeer {
 public:
  virtual ~DevicePeer() = default;
  virtual PayloadTransport kind() const = 0;

  // kCudaIpc: a handle the server can open for the memory at `ptr`.
  virtual absl::StatusOr<IpcExport> Export(const void* /*ptr*/) {
    return absl::FailedPreconditionError("this peer does not export CUDA IPC handles");
  }
  // kNccl: joins the session as join.client_rank (blocks until the server
  // has joined too, or the deadline).
  virtual absl::Status Join(const SessionJoin& /*join*/, absl::Time /*deadline*/) {
    return absl::FailedPreconditionError("this peer does not join transfer sessions");
  }
  // kNccl: `size` bytes to / from the server's rank, in the order the
  // request's payloads name them (k, then v).
  virtual absl::Status Send(const void* /*ptr*/, int64_t /*size*/, absl::Time /*deadline*/) {
    return absl::FailedPreconditionError("this peer does not send over sessions");
  }
  virtual absl::Status Recv(void* /*ptr*/, int64_t /*size*/, absl::Time /*deadline*/) {
    return absl::FailedPreconditionError("this peer does not receive over sessions");
  }
  // kNccl: leaves the joined session (aborting what is in flight).
  virtual void Leave() {}
};

}  // namespace kvq

#endif  // KVQ_CLIENT_DEVICE_PEER_H_
