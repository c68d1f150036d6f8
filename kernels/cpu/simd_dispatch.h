// Which compiled SIMD target the cpu backend's kernels run.
//
// Highway compiles every kernel for several x86 targets (simd_targets.h:
// AVX3 = AVX-512, AVX2, and the portable baseline) and dispatches at run
// time to the best one the CPU supports. Pinning a lower one lets tests
// cover every code path on one machine, benchmarks compare targets in A/B
// runs, and an operator rule out a target (KVQ_SIMD_TARGET=AVX2 kvq-server).
#ifndef KVQ_KERNELS_CPU_SIMD_DISPATCH_H_
#define KVQ_KERNELS_CPU_SIMD_DISPATCH_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvq {
namespace cpu {

// Targets compiled into this binary that this CPU runs, best first, by
// Highway's names ("AVX3_DL", "AVX3", "AVX2", "EMU128" or "SCALAR").
std::vector<std::string> AvailableSimdTargets();

// The target the kernels dispatch to now.
std::string ActiveSimdTarget();

// Dispatches to `name` (case-insensitive) from now on; "" or "best" returns
// to the best available target. NOT_FOUND names the available targets when
// `name` is not one of them. Not thread-safe against running kernels: call
// it before any work starts.
absl::Status PinSimdTarget(absl::string_view name);

// Applies the environment variable KVQ_SIMD_TARGET once per process, if set
// (CpuBackend() calls it). An unavailable name leaves the best target and
// returns the error for the caller to report.
absl::Status PinSimdTargetFromEnv();

}  // namespace cpu
}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_SIMD_DISPATCH_H_
