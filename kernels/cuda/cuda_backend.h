// The CUDA backend: pages in device memory, kernels on the device.
#ifndef KVQ_KERNELS_CUDA_CUDA_BACKEND_H_
#define KVQ_KERNELS_CUDA_CUDA_BACKEND_H_

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvq {

// The backend of device 0; FAILED_PRECONDITION when this process sees no
// CUDA device (the message says so, for --backend=cuda to print).
absl::StatusOr<const KernelBackend*> CudaBackend();

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_CUDA_BACKEND_H_
