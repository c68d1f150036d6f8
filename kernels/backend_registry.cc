// BackendByName: every backend this build has, by the name flags and tests
// use. It sits in its own library above the backends (kernels/CMakeLists.txt)
// so that the CUDA backend can depend on the core without a cycle.
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cuda/host_program_backend.h"
#include "kernels/quoted.h"
#if KVQ_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace kvq {

absl::string_view CompiledBackendNames() {
#if KVQ_HAVE_CUDA
  return "ref, cpu, cuda_host, cuda";
#else
  return "ref, cpu, cuda_host";
#endif
}

absl::StatusOr<const KernelBackend*> BackendByName(absl::string_view name) {
  if (name == "ref") return &RefBackend();
  if (name == "cpu") return &CpuBackend();
  if (name == "cuda_host") return &CudaHostBackend();
#if KVQ_HAVE_CUDA
  if (name == "cuda") return CudaBackend();
#else
  if (name == "cuda") {
    return absl::UnimplementedError(
        "backend \"cuda\": this build has no CUDA backend (configure with nvcc on PATH "
        "and -DKVQ_WITH_CUDA=ON)");
  }
#endif
  return absl::InvalidArgumentError(
      absl::StrCat("backend ", Quoted(name), " is not one of ", CompiledBackendNames()));
}

}  // namespace kvq
