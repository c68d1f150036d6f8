// NcclTransport: the cross-node device payload path. OpenTransfer creates
// an ncclUniqueId and starts joining it as rank 0 of 2 (non-blocking); the
// client joins as rank 1 with the id from the reply; payloads then move
// with ncclSend/ncclRecv while gRPC carries descriptors only. A deadline
// that passes aborts the communicator (ncclCommAbort) and the session.
#ifndef KVQ_SERVICE_TRANSPORT_NCCL_TRANSPORT_H_
#define KVQ_SERVICE_TRANSPORT_NCCL_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/nccl_link.h"
#include "service/transport/kv_transport.h"

namespace kvq {

class NcclTransport : public KvTransport {
 public:
  explicit NcclTransport(int device) : device_(device) {}
  ~NcclTransport() override;

  TransportKind kind() const override { return TransportKind::kNccl; }
  absl::StatusOr<SessionDescriptor> OpenSession(absl::Time deadline) override;
  void CloseSession(absl::string_view session_id) override;
  absl::Status Receive(const PayloadRef& ref, absl::Span<uint8_t> dst,
                       absl::Time deadline) override;
  absl::Status Send(const PayloadRef& ref, absl::Span<const uint8_t> src,
                    absl::Time deadline) override;

 private:
  struct Session {
    std::unique_ptr<NcclLink> link;
    void* scratch = nullptr;  // Device staging for host buffers.
    size_t scratch_bytes = 0;
  };
  // The session (UNAVAILABLE once closed) and device memory of `bytes` for
  // a host buffer.
  absl::StatusOr<std::shared_ptr<Session>> Find(const PayloadRef& ref);
  absl::StatusOr<void*> Scratch(Session& s, size_t bytes);

  const int device_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  int next_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_TRANSPORT_NCCL_TRANSPORT_H_
