#include "kernels/cuda/crq_device_statistics.h"

#include <utility>

#include "kernels/cuda/cuda_status.h"
#include "kernels/status_macros.h"

namespace kvq {

std::vector<float> CrqDeviceStatisticsOf(const CrqTransform& t) {
  const HeadCalibration& cal = t.calibration();
  std::vector<float> out;
  for (const std::vector<float>* v :
       {&cal.key_mean, &cal.value_mean, &cal.value_scale, &t.rotation().signs()}) {
    out.insert(out.end(), v->begin(), v->end());
  }
  return out;
}

CrqDeviceStatistics& CrqDeviceStatistics::Get() {
  static CrqDeviceStatistics* cache = new CrqDeviceStatistics();
  return *cache;
}

absl::StatusOr<const float*> CrqDeviceStatistics::For(const CrqTransform& t,
                                                      cudaStream_t stream) {
  std::vector<float> host = CrqDeviceStatisticsOf(t);
  absl::MutexLock lock(&mu_);
  Entry& e = entries_[&t];
  if (e.device != nullptr && e.host == host) return e.device;
  if (e.device == nullptr || e.host.size() != host.size()) {
    if (e.device != nullptr) cudaFree(e.device);  // Synchronizes: no kernel still reads it.
    e.device = nullptr;
    e.host.clear();
    void* p = nullptr;
    KVQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, host.size() * sizeof(float)),
                             "cudaMalloc (crq statistics)");
    e.device = static_cast<float*>(p);
  }
  KVQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(e.device, host.data(), host.size() * sizeof(float),
                                           cudaMemcpyHostToDevice, stream),
                           "cudaMemcpyAsync (crq statistics)");
  KVQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  e.host = std::move(host);
  return e.device;
}

}  // namespace kvq
