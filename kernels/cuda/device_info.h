// What CUDA devices this process can use, for --backend=auto and for tests
// that need a GPU to skip themselves with a reason when there is none.
#ifndef KVQ_KERNELS_CUDA_DEVICE_INFO_H_
#define KVQ_KERNELS_CUDA_DEVICE_INFO_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace kvq {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int sm_major = 0;
  int sm_minor = 0;
  int multiprocessors = 0;
  size_t total_bytes = 0;
  size_t free_bytes = 0;
};

// Number of usable devices; 0 (not an error) when the driver reports none.
int CudaDeviceCount();
// FAILED_PRECONDITION naming the ordinal and the count when out of range.
absl::StatusOr<DeviceInfo> QueryCudaDevice(int ordinal);
// The current device's opt-in shared memory per block
// (cudaDevAttrMaxSharedMemoryPerBlockOptin), queried once: the attention
// kernels size their page buffers to it.
absl::StatusOr<int> MaxSharedMemoryPerBlock();

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_DEVICE_INFO_H_
