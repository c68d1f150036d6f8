// Each crq head's statistics on the device, uploaded once: the cuda
// backend's crq attention reads them from here rather than sending them
// with every call (DeviceCrqTask::calibration).
#ifndef KVQ_KERNELS_CUDA_CRQ_DEVICE_STATISTICS_H_
#define KVQ_KERNELS_CUDA_CRQ_DEVICE_STATISTICS_H_

#include <cuda_runtime_api.h>

#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/crq_transform.h"

namespace kvq {

// The [4][head_dim] block the crq split kernel reads: key_mean,
// value_mean, value_scale, the Hadamard signs.
std::vector<float> CrqDeviceStatisticsOf(const CrqTransform& t);

class CrqDeviceStatistics {
 public:
  // The process's cache (device memory of the current device).
  static CrqDeviceStatistics& Get();

  // Device address of t's block. The first call for a transform uploads
  // it (on `stream`, waited for, so no caller sees a half-written block);
  // later calls compare the host copy and reuse it, so a transform that
  // reuses a dead one's address gets its own statistics. Blocks live until
  // the process ends (4 x head_dim floats per transform address).
  absl::StatusOr<const float*> For(const CrqTransform& t, cudaStream_t stream);

 private:
  struct Entry {
    std::vector<float> host;
    float* device = nullptr;
  };
  absl::Mutex mu_;
  std::map<const CrqTransform*, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_CRQ_DEVICE_STATISTICS_H_
