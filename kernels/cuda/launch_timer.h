// CUDA-event timing of repeated launches on one stream (kernel_timing.h's
// functions and the backend's timed attention launch share it).
#ifndef KVQ_KERNELS_CUDA_LAUNCH_TIMER_H_
#define KVQ_KERNELS_CUDA_LAUNCH_TIMER_H_

#include <cuda_runtime_api.h>

#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"

namespace kvq {

// Calls `launch` `warmup` times untimed, then `reps` times with a CUDA event
// recorded on `stream` before the first and after each; waits for the last
// and returns the `reps` intervals in milliseconds. The first error of a
// launch or of the CUDA runtime is returned.
absl::StatusOr<std::vector<double>> TimeLaunches(cudaStream_t stream, int warmup, int reps,
                                                 absl::FunctionRef<absl::Status()> launch);

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_LAUNCH_TIMER_H_
