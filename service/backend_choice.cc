#include "service/backend_choice.h"

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#if KVQ_HAVE_CUDA
#include "kernels/cuda/device_info.h"
#include "kernels/cuda/device_page_pool.h"
#endif

namespace kvq {

absl::StatusOr<BackendChoice> ChooseBackend(absl::string_view flag, const BackendFacts& facts) {
  // Why "cuda" cannot run here, or empty when it can.
  std::string no_cuda;
  if (!facts.cuda_built) {
    no_cuda = "this build has no CUDA backend (configure with nvcc on PATH and -DKVQ_WITH_CUDA=ON)";
  } else if (facts.cuda_devices == 0) {
    no_cuda = "this process sees no CUDA device";
  } else if (!facts.cuda_backend.ok()) {
    no_cuda = absl::StrCat("the CUDA backend did not start: ", facts.cuda_backend.message());
  }
  if (flag == "auto") {
    if (no_cuda.empty()) {
      return BackendChoice{"cuda", absl::StrCat("--backend=auto: cuda (", facts.cuda_devices,
                                                 facts.cuda_devices == 1 ? " device" : " devices",
                                                 " visible; pages in device memory)")};
    }
    return BackendChoice{"cpu", absl::StrCat("--backend=auto: cpu, because ", no_cuda)};
  }
  if (flag == "cuda") {
    if (!no_cuda.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--backend=cuda: ", no_cuda, "; use --backend=cpu or --backend=auto"));
    }
    return BackendChoice{"cuda", "--backend=cuda"};
  }
  if (flag == "cpu" || flag == "ref") {
    return BackendChoice{std::string(flag), absl::StrCat("--backend=", flag)};
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--backend=", flag, ": must be auto, cpu, ref or cuda"));
}

BackendFacts ProbeBackends() {
  BackendFacts f;
#if KVQ_HAVE_CUDA
  f.cuda_built = true;
  f.cuda_devices = CudaDeviceCount();
  if (f.cuda_devices > 0) f.cuda_backend = BackendByName("cuda").status();
#endif
  return f;
}

absl::StatusOr<std::shared_ptr<PageAllocator>> MakeDevicePagePool(const DevicePoolConfig& config,
                                                                  PagePool* host) {
#if KVQ_HAVE_CUDA
  DevicePagePoolOptions o;
  o.device = 0;
  o.capacity_bytes = static_cast<size_t>(config.capacity_bytes);
  o.capacity_fraction = config.capacity_fraction;
  o.page_bytes = static_cast<size_t>(config.page_bytes);
  absl::StatusOr<std::unique_ptr<DevicePagePool>> pool = DevicePagePool::Create(o, host);
  if (!pool.ok()) return pool.status();
  return std::shared_ptr<PageAllocator>(std::move(*pool));
#else
  (void)config, (void)host;
  return absl::UnimplementedError("this build has no CUDA backend: no device page pool");
#endif
}

}  // namespace kvq
