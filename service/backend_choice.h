// Which kernel backend kvq-server runs, and where its pages live.
//
// --backend=auto picks "cuda" when this build has the CUDA backend, the
// process sees a CUDA device and the backend starts; "cpu" otherwise, with
// the reason logged. --backend=cuda without any of those fails at start
// with FAILED_PRECONDITION naming the flag. With "cuda" the default
// tenant's pages live in a DevicePagePool (kernels/cuda/device_page_pool.h)
// sized by --device_capacity_bytes / --device_capacity_fraction.
#ifndef KVQ_SERVICE_BACKEND_CHOICE_H_
#define KVQ_SERVICE_BACKEND_CHOICE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/page_allocator.h"
#include "service/page_pool.h"

namespace kvq {

// What the choice depends on, gathered by ProbeBackends() (or set by tests).
struct BackendFacts {
  bool cuda_built = false;  // This build has the CUDA backend (KVQ_WITH_CUDA).
  int cuda_devices = 0;     // kvq::CudaDeviceCount().
  // BackendByName("cuda")'s answer when a device exists (the backend may
  // still refuse, e.g. before its kernels are built).
  absl::Status cuda_backend = absl::UnavailableError("not probed");
};

struct BackendChoice {
  std::string name;    // "cpu", "ref" or "cuda".
  std::string reason;  // One line for the start-up log.
};

// The backend for --backend=`flag` (auto, cpu, ref or cuda).
// FAILED_PRECONDITION naming --backend when "cuda" cannot run here.
absl::StatusOr<BackendChoice> ChooseBackend(absl::string_view flag, const BackendFacts& facts);

// This process's facts: the build, the devices it sees, and the CUDA
// backend's answer (probed only when there is a device).
BackendFacts ProbeBackends();

struct DevicePoolConfig {
  int64_t capacity_bytes = 0;       // 0: capacity_fraction of free device memory.
  double capacity_fraction = 0.8;
  int64_t page_bytes = 128 << 10;   // Slot size: the largest page stored.
};

// A DevicePagePool on device 0 whose streams' host blocks come from `host`;
// UNIMPLEMENTED in a build without the CUDA backend.
absl::StatusOr<std::shared_ptr<PageAllocator>> MakeDevicePagePool(const DevicePoolConfig& config,
                                                                  PagePool* host);

}  // namespace kvq

#endif  // KVQ_SERVICE_BACKEND_CHOICE_H_
