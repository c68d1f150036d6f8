// The one place a cudaError_t becomes an absl::Status.
#ifndef KVQ_KERNELS_CUDA_CUDA_STATUS_H_
#define KVQ_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvq {

// OK for cudaSuccess. Otherwise the code that says what a caller can do:
// RESOURCE_EXHAUSTED for out of memory, FAILED_PRECONDITION when there is no
// usable device or driver, INTERNAL for everything else (a kernel fault
// leaves the context unusable: the request fails and the server says so).
// The message names `what` and CUDA's own name and text for the error.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

}  // namespace kvq

#define KVQ_CUDA_RETURN_IF_ERROR(expr, what)                      \
  do {                                                            \
    if (cudaError_t kvq_cuda_error_ = (expr); kvq_cuda_error_ != cudaSuccess) \
      return ::kvq::CudaStatus(kvq_cuda_error_, what);            \
  } while (0)

#endif  // KVQ_KERNELS_CUDA_CUDA_STATUS_H_
