// The client's CUDA sides of the device payload paths (client/device_peer.h):
// CudaIpcPeer exports device allocations as IPC handles; NcclPeer joins an
// OpenTransfer session as the client rank and sends / receives device
// memory. Pass one as AppendOptions::device.peer / FetchOptions::device.peer.
#ifndef KVQ_CLIENT_CUDA_DEVICE_PEERS_H_
#define KVQ_CLIENT_CUDA_DEVICE_PEERS_H_

#include <memory>

#include "client/device_peer.h"

namespace kvq {

class NcclLink;

class CudaIpcPeer : public DevicePeer {
 public:
  explicit CudaIpcPeer(int device) : device_(device) {}
  PayloadTransport kind() const override { return PayloadTransport::kCudaIpc; }
  // `ptr` may point anywhere inside a cudaMalloc allocation: the handle
  // names the allocation and the offset says where in it.
  absl::StatusOr<IpcExport> Export(const void* ptr) override;

 private:
  int device_;
};

class NcclPeer : public DevicePeer {
 public:
  explicit NcclPeer(int device);
  ~NcclPeer() override;
  PayloadTransport kind() const override { return PayloadTransport::kNccl; }
  absl::Status Join(const SessionJoin& join, absl::Time deadline) override;
  absl::Status Send(const void* ptr, int64_t size, absl::Time deadline) override;
  absl::Status Recv(void* ptr, int64_t size, absl::Time deadline) override;
  void Leave() override;

 private:
  int device_;
  int server_rank_ = 0;
  std::unique_ptr<NcclLink> link_;
};

}  // namespace kvq

#endif  // KVQ_CLIENT_CUDA_DEVICE_PEERS_H_
