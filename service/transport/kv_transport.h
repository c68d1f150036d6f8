// KvTransport: the server's side of a path that moves K/V bytes between a
// client's GPU memory and the server without carrying them in gRPC
// messages (docs/TRANSPORT.md). gRPC carries descriptors only (PayloadRef);
// an implementation moves the bytes: CUDA IPC (same node), NCCL (across
// nodes), or the in-process fake the CPU tests use.
//
// Plain C++ and absl only, so the CUDA implementations beside it (their own
// target, kvq_cuda_transport) and the service can both include it without
// the service library depending on CUDA.
#ifndef KVQ_SERVICE_TRANSPORT_KV_TRANSPORT_H_
#define KVQ_SERVICE_TRANSPORT_KV_TRANSPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvq {

enum class TransportKind { kCudaIpc, kNccl };

// "cuda_ipc" or "nccl": the transport= option of the clients.
inline absl::string_view TransportKindName(TransportKind kind) {
  return kind == TransportKind::kCudaIpc ? "cuda_ipc" : "nccl";
}

// Where one payload's bytes are, as a request names them. `field` ("k",
// "v") prefixes every error about it.
struct PayloadRef {
  std::string field;
  // kCudaIpc: the exporter's cudaIpcMemHandle_t bytes and the payload's
  // offset inside that allocation.
  std::string ipc_handle;
  int64_t offset = 0;
  // kNccl: the open session the bytes travel over.
  std::string session_id;
  int64_t size = 0;  // Bytes; must equal the destination's or source's size.
};

// What a client needs to join a session (OpenTransferResponse).
struct SessionDescriptor {
  std::string session_id;
  std::string nccl_unique_id;  // The ncclUniqueId's bytes.
  int world_size = 2;
  int server_rank = 0;
  int client_rank = 1;
};

// Errors every implementation reports the same way:
//   DEADLINE_EXCEEDED  the peer did not deliver (or take) the bytes in time
//   UNAVAILABLE        the peer is gone (its process, its session)
//   INVALID_ARGUMENT   a bad handle, offset or size (the message names the
//                      field and the bound)
//   FAILED_PRECONDITION the transport cannot serve this kind of request
// After any error the destination's contents are unspecified: callers
// receive into staging memory and store nothing on failure.
class KvTransport {
 public:
  virtual ~KvTransport() = default;

  virtual TransportKind kind() const = 0;

  // A new session and the server's membership of it (kNccl). The server
  // side joins in the background; transfers wait for the client until
  // their deadline.
  virtual absl::StatusOr<SessionDescriptor> OpenSession(absl::Time deadline) = 0;
  // Ends a session: its communicator is aborted and its memory freed. A
  // transfer still running on it fails with UNAVAILABLE.
  virtual void CloseSession(absl::string_view session_id) = 0;

  // Copies ref.size bytes from the peer into `dst` (dst.size() == ref.size).
  virtual absl::Status Receive(const PayloadRef& ref, absl::Span<uint8_t> dst,
                               absl::Time deadline) = 0;
  // Copies `src` (src.size() == ref.size) to the peer.
  virtual absl::Status Send(const PayloadRef& ref, absl::Span<const uint8_t> src,
                            absl::Time deadline) = 0;
};

// The checks every Receive/Send starts with: a size that matches the
// buffer, and a reference of the transport's kind. Inline: the CUDA
// library uses it without linking the service.
inline absl::Status CheckPayloadRef(TransportKind kind, const PayloadRef& ref,
                                    size_t buffer_bytes) {
  if (ref.size < 0 || static_cast<uint64_t>(ref.size) != buffer_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(ref.field, ".size = ", ref.size,
                                                   " must be ", buffer_bytes,
                                                   " (the request's shape and dtype)"));
  }
  if (ref.offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(ref.field, ".offset = ", ref.offset, " must be >= 0"));
  }
  if (kind == TransportKind::kCudaIpc && ref.ipc_handle.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(ref.field, ".cuda_ipc.handle is empty"));
  }
  if (kind == TransportKind::kNccl && ref.session_id.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(ref.field, ".transfer.session_id is empty"));
  }
  return absl::OkStatus();
}

}  // namespace kvq

#endif  // KVQ_SERVICE_TRANSPORT_KV_TRANSPORT_H_
