#include "kernels/cuda/device_info.h"

#include <cuda_runtime_api.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace kvq {

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // Clear the sticky "no device" error.
    return 0;
  }
  return count;
}

absl::StatusOr<DeviceInfo> QueryCudaDevice(int ordinal) {
  const int count = CudaDeviceCount();
  if (ordinal < 0 || ordinal >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", ordinal, " does not exist (this process sees ", count,
                     count == 1 ? " device)" : " devices)"));
  }
  cudaDeviceProp prop;
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
  DeviceInfo info;
  info.ordinal = ordinal;
  info.name = prop.name;
  info.sm_major = prop.major;
  info.sm_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal), "cudaSetDevice");
  KVQ_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo");
  return info;
}

absl::StatusOr<int> MaxSharedMemoryPerBlock() {
  static std::atomic<int> cached{0};
  if (int v = cached.load(std::memory_order_relaxed); v > 0) return v;
  int device = 0, bytes = 0;
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  KVQ_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
      "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  cached.store(bytes, std::memory_order_relaxed);
  return bytes;
}

}  // namespace kvq
