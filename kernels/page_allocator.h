// Where pages come from. The core allocates from the heap; the service hands
// streams its pre-allocated pool through the same interface.
#ifndef KVQ_KERNELS_PAGE_ALLOCATOR_H_
#define KVQ_KERNELS_PAGE_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

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

  // --- Page memory. Code outside a KernelBackend touches page bytes only
  // through these, so pages may live where the host cannot address them
  // (device memory): such an allocator answers host_accessible() false and
  // overrides every operation below. The defaults are plain memory. ---

  // Whether host code may read and write blocks through their pointers.
  // Readers that hand out page pointers without copying (fetches, page
  // checksums) do so only when this is true, and stage a copy otherwise.
  virtual bool host_accessible() const { return true; }
  // Each returns the device's error (INTERNAL, or what kvq::CudaStatus
  // makes of it) where the memory is a device's; plain memory never fails.
  // Copies `bytes` bytes at `offset` in `block` to host memory `out`.
  virtual absl::Status ReadBlock(const uint8_t* block, size_t offset, size_t bytes,
                                 uint8_t* out) {
    std::memcpy(out, block + offset, bytes);
    return absl::OkStatus();
  }
  // Copies `bytes` host bytes from `data` to `offset` in `block`.
  virtual absl::Status WriteBlock(uint8_t* block, size_t offset, const uint8_t* data,
                                  size_t bytes) {
    std::memcpy(block + offset, data, bytes);
    return absl::OkStatus();
  }
  // Sets `bytes` bytes at `offset` in `block` to zero.
  virtual absl::Status ZeroBlock(uint8_t* block, size_t offset, size_t bytes) {
    std::memset(block + offset, 0, bytes);
    return absl::OkStatus();
  }
  // Copies `bytes` bytes from the start of block `src` to the start of `dst`.
  virtual absl::Status CopyBlock(uint8_t* dst, const uint8_t* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  // The address at which host code may read and write `block`: the block
  // itself for host memory, a second mapping of the same memory for a test
  // allocator that hides its blocks, nullptr where there is none (device
  // memory). Only host-side stand-ins for device kernels use it.
  virtual uint8_t* HostAlias(const uint8_t* block) { return const_cast<uint8_t*>(block); }

  // A block host code reads and writes directly (a stream's header, nuq
  // levels and fp16 sink and tail rows), never shared (Retain). From
  // Allocate() by default; an allocator whose blocks the host cannot
  // address returns host memory here.
  virtual absl::StatusOr<uint8_t*> AllocateHost(size_t bytes) { return Allocate(bytes); }
  virtual void FreeHost(uint8_t* block, size_t bytes) { Free(block, bytes); }

  // --- Page checksums (service/page_checksum.h): one word per live block,
  // kept beside the block, never in it, and 0 again when the block's last
  // reference goes. An allocator that keeps them answers true; the default
  // keeps none (Set ignores, Get answers 0s). ---
  virtual bool keeps_checksums() const { return false; }
  virtual void SetChecksums(absl::Span<const uint8_t* const> blocks,
                            absl::Span<const uint64_t> sums) {
    (void)blocks, (void)sums;
  }
  virtual void GetChecksums(absl::Span<const uint8_t* const> blocks,
                            absl::Span<uint64_t> sums) const {
    (void)blocks;
    for (uint64_t& s : sums) s = 0;
  }
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
