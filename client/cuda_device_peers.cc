#include "client/cuda_device_peers.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#ifdef KVQ_HAVE_NCCL
#include "kernels/cuda/nccl_link.h"
#endif

namespace kvq {

absl::StatusOr<IpcExport> CudaIpcPeer::Export(const void* ptr) {
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  // The handle names the whole allocation: find its base.
  // The driver's cuMemGetAddressRange through the runtime's entry point
  // table, so nothing links libcuda (absent where no driver is installed).
  static PFN_cuMemGetAddressRange_v3020 range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 3020, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn);
  }();
  if (range == nullptr) return absl::FailedPreconditionError("no CUDA driver: cannot export");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (CUresult r = range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)); r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        "device pointer is not inside a cudaMalloc allocation of this process");
  }
  cudaIpcMemHandle_t h;
  KVQ_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)),
                           "cudaIpcGetMemHandle");
  IpcExport e;
  e.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  e.offset = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(ptr) - base);
  e.device = device_;
  return e;
}

#ifndef KVQ_HAVE_NCCL
class NcclLink {};  // Built without NCCL: NcclPeer refuses to join.
#endif

NcclPeer::NcclPeer(int device) : device_(device) {}
NcclPeer::~NcclPeer() = default;

#ifdef KVQ_HAVE_NCCL

absl::Status NcclPeer::Join(const SessionJoin& join, absl::Time deadline) {
  link_.reset();
  absl::StatusOr<std::unique_ptr<NcclLink>> link =
      NcclLink::Start(join.nccl_unique_id, join.world_size, join.client_rank, device_);
  if (!link.ok()) return link.status();
  link_ = *std::move(link);
  server_rank_ = join.server_rank;
  return link_->WaitReady(deadline);
}

absl::Status NcclPeer::Send(const void* ptr, int64_t size, absl::Time deadline) {
  if (link_ == nullptr) return absl::FailedPreconditionError("no transfer session joined");
  return link_->Send(ptr, size, server_rank_, deadline, "send");
}

absl::Status NcclPeer::Recv(void* ptr, int64_t size, absl::Time deadline) {
  if (link_ == nullptr) return absl::FailedPreconditionError("no transfer session joined");
  return link_->Recv(ptr, size, server_rank_, deadline, "recv");
}

void NcclPeer::Leave() { link_.reset(); }
#else
absl::Status NcclPeer::Join(const SessionJoin&, absl::Time) {
  return absl::FailedPreconditionError("this client was built without NCCL (KVQ_WITH_NCCL=OFF)");
}
absl::Status NcclPeer::Send(const void*, int64_t, absl::Time) { return Join({}, {}); }
absl::Status NcclPeer::Recv(void*, int64_t, absl::Time) { return Join({}, {}); }
void NcclPeer::Leave() {}
#endif

}  // namespace kvq
