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

HeapUsage CurrentHeapUsage() {
  HeapUsage h;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  if (!kMallocIsGlibc) return h;
  const struct mallinfo2 mi = mallinfo2();
  h.in_use_bytes = mi.uordblks + mi.hblkhd;
  h.free_bytes = mi.fordblks;
#endif
  return h;
}

}  // namespace kvq
