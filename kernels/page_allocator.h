// Where pages come from. The core allocates from the heap; the service hands
// streams its pre-allocated pool through the same interface.
#ifndef KVQ_KERNELS_PAGE_ALLOCATOR_H_
#define KVQ_KERNELS_PAGE_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace kvq {

class PageAllocator {
 public:
  virtual ~PageAllocator() = default;
  // Returns kPageAlign-aligned memory of `bytes` holding one reference, or
  // RESOURCE_EXHAUSTED.
  virtual absl::StatusOr<uint8_t*> Allocate(size_t bytes) = 0;
  // Adds a reference to a block from Allocate(): streams that share a
  // prefix (Fork, prefix reuse) share its full pages.
  virtual void Retain(uint8_t* block, size_t bytes) = 0;
  // Drops one reference; the memory is reusable when none is left.
  virtual void Free(uint8_t* block, size_t bytes) = 0;
};

// Thread-safe aligned heap allocation; never exhausted short of the OS.
PageAllocator* HeapPageAllocator();

}  // namespace kvq

#endif  // KVQ_KERNELS_PAGE_ALLOCATOR_H_
