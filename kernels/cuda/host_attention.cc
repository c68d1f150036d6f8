// SCAFFOLD: replaced by the attention per-element programs.
#include "kernels/cpu/ref_kernels.h"
#include "kernels/cuda/host_program_backend.h"

namespace kvq {

absl::Status HostAttend(absl::Span<const AttentionTask> tasks, const AttentionOptions& options) {
  for (const AttentionTask& task : tasks) AttendRef(task, options);
  return absl::OkStatus();
}

}  // namespace kvq
