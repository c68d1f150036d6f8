#include "service/transport/cuda_ipc_transport.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cuda/cuda_status.h"

namespace kvq {

CudaIpcTransport::CudaIpcTransport(int device, int cached_handles)
    : device_(device), cached_handles_(cached_handles) {}

CudaIpcTransport::~CudaIpcTransport() {
  absl::MutexLock lock(&mu_);
  (void)cudaSetDevice(device_);
  for (auto& [handle, ptr] : opened_) (void)cudaIpcCloseMemHandle(ptr);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

absl::StatusOr<SessionDescriptor> CudaIpcTransport::OpenSession(absl::Time) {
  return absl::FailedPreconditionError(
      "cuda_ipc payloads need no session: name the handles in the request");
}

absl::StatusOr<uint8_t*> CudaIpcTransport::Open(const PayloadRef& ref) {
  if (ref.ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(ref.field, ".cuda_ipc.handle has ",
                                                   ref.ipc_handle.size(),
                                                   " bytes; a CUDA IPC handle has ",
                                                   sizeof(cudaIpcMemHandle_t)));
  }
  if (auto it = opened_.find(ref.ipc_handle); it != opened_.end()) {
    return static_cast<uint8_t*>(it->second);
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, ref.ipc_handle.data(), sizeof(h));
  void* ptr = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        ref.field, ".cuda_ipc.handle cannot be opened on this node (", cudaGetErrorString(e),
        "): not exported here, or its process has exited"));
  }
  if (static_cast<int>(order_.size()) >= cached_handles_) {
    (void)cudaIpcCloseMemHandle(opened_[order_.front()]);
    opened_.erase(order_.front());
    order_.pop_front();
  }
  opened_[ref.ipc_handle] = ptr;
  order_.push_back(ref.ipc_handle);
  return static_cast<uint8_t*>(ptr);
}

absl::Status CudaIpcTransport::Copy(void* dst, const void* src, size_t bytes,
                                    absl::Time deadline, absl::string_view field) {
  if (stream_ == nullptr) {
    KVQ_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                             "cudaStreamCreate");
  }
  // cudaMemcpyDefault: unified addressing tells device from host memory.
  KVQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_),
                           absl::StrCat(field, ": cudaMemcpyAsync"));
  bool late = false;
  while (true) {
    const cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) return CudaStatus(e, absl::StrCat(field, ": copy"));
    // A copy cannot be aborted and `dst` must outlive it: finish it, then
    // report the deadline it missed.
    if (!late && absl::Now() >= deadline) late = true;
    absl::SleepFor(absl::Microseconds(20));
  }
  if (late) {
    return absl::DeadlineExceededError(
        absl::StrCat(field, ": the copy did not finish before the deadline"));
  }
  return absl::OkStatus();
}

absl::Status CudaIpcTransport::Receive(const PayloadRef& ref, absl::Span<uint8_t> dst,
                                       absl::Time deadline) {
  if (absl::Status st = CheckPayloadRef(kind(), ref, dst.size()); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  absl::StatusOr<uint8_t*> base = Open(ref);
  if (!base.ok()) return base.status();
  return Copy(dst.data(), *base + ref.offset, dst.size(), deadline, ref.field);
}

absl::Status CudaIpcTransport::Send(const PayloadRef& ref, absl::Span<const uint8_t> src,
                                    absl::Time deadline) {
  if (absl::Status st = CheckPayloadRef(kind(), ref, src.size()); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  absl::StatusOr<uint8_t*> base = Open(ref);
  if (!base.ok()) return base.status();
  return Copy(*base + ref.offset, src.data(), src.size(), deadline, ref.field);
}

}  // namespace kvq
