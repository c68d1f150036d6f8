#include "kernels/malloc_tuning.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kvq {

absl::Status RetainMessageBuffers() {
#if defined(__GLIBC__)
  constexpr int kMmapThreshold = 32 << 20;  // glibc's maximum on 64-bit.
  constexpr int kTrimThreshold = 64 << 20;
  if (mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1 ||
      mallopt(M_TRIM_THRESHOLD, kTrimThreshold) != 1) {
    return absl::InternalError("mallopt refused the mmap / trim thresholds");
  }
  return absl::OkStatus();
#else
  return absl::UnimplementedError("malloc tuning needs glibc");
#endif
}

}  // namespace kvq
