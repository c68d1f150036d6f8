// glibc malloc settings for a process that moves ~1 MiB messages: the
// server, and clients that append or fetch whole prompts.
//
// By default glibc serves every allocation above its mmap threshold (128 KiB
// at start, raised as mapped blocks are freed) with a fresh mmap and returns
// it with munmap on free, and trims the heap top above 128 KiB. gRPC
// allocates each received and sent message buffer fresh, so a bulk append or
// fetch paid a map, first-touch page faults (the kernel zeroing 256 pages)
// and an unmap per message: measured, a fifth of kvq-server's CPU time in
// FetchDequant and a third in Append (docs/BENCHMARKS.md, section 7), and
// an eighth of a kivi4 round trip in the client (the same section).
#ifndef KVQ_KERNELS_MALLOC_TUNING_H_
#define KVQ_KERNELS_MALLOC_TUNING_H_

#include <cstddef>

#include "absl/status/status.h"

namespace kvq {

// Allocations below 32 MiB (glibc's largest mmap threshold) come from the
// heap, and up to 64 MiB of freed heap top stays mapped for reuse, so
// message buffers recycle without page faults. A no-op error where malloc
// is not glibc's.
absl::Status RetainMessageBuffers();

// glibc's heap, for telling memory in use from freed memory kept mapped.
struct HeapUsage {
  size_t in_use_bytes = 0;  // Allocated: arena chunks plus mmapped ones.
  size_t free_bytes = 0;    // Freed but still mapped in the arenas.
};
// The whole process's heap now (mallinfo2: walks every arena under its
// lock, so for scrapes, not hot paths); zeros where malloc is not glibc's.
HeapUsage CurrentHeapUsage();

// False in a build whose allocator replaces glibc's (KVQ_SANITIZE=address):
// glibc's settings and counters then describe memory nobody allocates from.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kMallocIsGlibc = false;
#else
inline constexpr bool kMallocIsGlibc = true;
#endif

}  // namespace kvq

#endif  // KVQ_KERNELS_MALLOC_TUNING_H_
