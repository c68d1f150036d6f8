// CudaIpcTransport: the same-node device payload path. A client exports its
// device allocation (cudaIpcGetMemHandle) and names it in the request; the
// server opens the handle once (cudaIpcOpenMemHandle, cached) and copies
// with cudaMemcpyAsync straight between the two (device to device when the
// destination is device memory, device to host for a host page pool).
#ifndef KVQ_SERVICE_TRANSPORT_CUDA_IPC_TRANSPORT_H_
#define KVQ_SERVICE_TRANSPORT_CUDA_IPC_TRANSPORT_H_

#include <cuda_runtime_api.h>

#include <deque>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "service/transport/kv_transport.h"

namespace kvq {

class CudaIpcTransport : public KvTransport {
 public:
  // Copies run on `device`; at most `cached_handles` opened handles stay
  // mapped (the oldest is closed first).
  explicit CudaIpcTransport(int device, int cached_handles = 256);
  ~CudaIpcTransport() override;

  TransportKind kind() const override { return TransportKind::kCudaIpc; }
  absl::StatusOr<SessionDescriptor> OpenSession(absl::Time deadline) override;
  void CloseSession(absl::string_view) override {}
  absl::Status Receive(const PayloadRef& ref, absl::Span<uint8_t> dst,
                       absl::Time deadline) override;
  absl::Status Send(const PayloadRef& ref, absl::Span<const uint8_t> src,
                    absl::Time deadline) override;

 private:
  // The mapped base of the allocation `ref` names.
  absl::StatusOr<uint8_t*> Open(const PayloadRef& ref);
  absl::Status Copy(void* dst, const void* src, size_t bytes, absl::Time deadline,
                    absl::string_view field);

  const int device_;
  const int cached_handles_;
  absl::Mutex mu_;  // One copy at a time on stream_; guards the cache.
  cudaStream_t stream_ = nullptr;
  absl::flat_hash_map<std::string, void*> opened_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);  // Oldest first.
};

}  // namespace kvq

#endif  // KVQ_SERVICE_TRANSPORT_CUDA_IPC_TRANSPORT_H_
