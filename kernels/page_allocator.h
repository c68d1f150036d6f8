// Where pages come from. The core allocates from the heap; the service hands
// streams its pre-allocated pool through the same interface.
#ifndef KVQ_KERNELS_PAGE_ALLOCATOR_H_
#define KVQ_KERNELS_PAGE_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

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

// Heap pages that are kept for reuse when their last reference goes: for
// code that builds and drops short-lived streams in a loop (a client
// quantizing a prompt layer by layer, or expanding fetched pages). Fresh
// heap memory costs a page fault and a kernel zero-fill per 4 KiB, which
// measured as much as the quantization itself; a reused block costs
// neither. Keeps at most `max_cached_bytes` of free blocks; thread-safe. It
// must outlive every stream that allocated from it.
class RecyclingPageAllocator final : public PageAllocator {
 public:
  explicit RecyclingPageAllocator(size_t max_cached_bytes = size_t{256} << 20);
  ~RecyclingPageAllocator() override;
  RecyclingPageAllocator(const RecyclingPageAllocator&) = delete;
  RecyclingPageAllocator& operator=(const RecyclingPageAllocator&) = delete;

  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override;
  void Retain(uint8_t* block, size_t bytes) override;
  void Free(uint8_t* block, size_t bytes) override;

  // Bytes of free blocks held for reuse.
  size_t cached_bytes() const;

 private:
  const size_t max_cached_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<size_t, std::vector<uint8_t*>> free_ ABSL_GUARDED_BY(mu_);
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvq

#endif  // KVQ_KERNELS_PAGE_ALLOCATOR_H_
