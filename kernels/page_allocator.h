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
  // Returns kPageAlign-aligned memory of `bytes`, or RESOURCE_EXHAUSTED.
  virtual absl::StatusOr<uint8_t*> Allocate(size_t bytes) = 0;
  virtual void Free(uint8_t* block, size_t bytes) = 0;
};

// Thread-safe aligned heap allocation; never exhausted short of the OS.
PageAllocator* HeapPageAllocator();

}  // namespace kvq

#endif  // KVQ_KERNELS_PAGE_ALLOCATOR_H_
