// Placeholder while the SIMD backend is written: forwards to the reference.
#include "kernels/backend.h"

namespace kvq {
const KernelBackend& CpuBackend() { return RefBackend(); }
}  // namespace kvq
