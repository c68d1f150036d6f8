// PagePool: the one pre-allocated memory pool a kvq server stores KV in.
//
// The pool reserves `capacity_bytes` once at start-up and never calls malloc
// on the append path. It is a slab allocator: the arena is cut into slabs of
// `slab_bytes`; a slab serves blocks of one size (a stream's page size or its
// aux block size, rounded up to kPageAlign), and blocks larger than a slab
// take a run of whole slabs. A server holds a handful of layouts, so a
// handful of size classes: free slots are reused exactly, with no external
// fragmentation inside a class, and a slab whose blocks are all free goes
// back to the shared free list for any class.
//
// Blocks are reference counted (PageAllocator::Retain) so that forks and
// reused prefixes share full pages.
#ifndef KVQ_SERVICE_PAGE_POOL_H_
#define KVQ_SERVICE_PAGE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kernels/page_allocator.h"

namespace kvq {

struct PagePoolOptions {
  size_t capacity_bytes = size_t{1} << 30;
  size_t slab_bytes = size_t{1} << 20;
  // Ask the kernel for transparent huge pages on the arena (madvise; Linux
  // grants them only on request under its default "madvise" policy). An
  // Attend streams every page of its sequences' KV, 96 MiB per call at 32
  // fp16 sequences of 4k tokens: with 4 KiB pages that is 24k page walks a
  // call (docs/BENCHMARKS.md, section 7).
  bool huge_pages = true;
};

struct PagePoolStats {
  size_t capacity_bytes = 0;   // Arena size (whole slabs).
  size_t used_bytes = 0;       // Bytes of live blocks (as requested, rounded to kPageAlign).
  size_t slab_bytes = 0;
  size_t slabs_total = 0;
  size_t slabs_used = 0;       // Slabs holding at least one live block.
  size_t blocks_used = 0;      // Live blocks (pages and aux blocks).
  size_t shared_blocks = 0;    // Live blocks with more than one reference.
  // Page checksums (service/page_checksum.h): 8 bytes per slot of every
  // slab in use, kept beside the arena (not inside capacity_bytes).
  size_t checksum_bytes = 0;
  size_t sealed_blocks = 0;    // Live blocks that carry a checksum.
};

class PagePool final : public PageAllocator {
 public:
  // INVALID_ARGUMENT for a capacity below one slab or a slab size that is
  // not a multiple of kPageAlign; RESOURCE_EXHAUSTED if the arena cannot be
  // reserved.
  static absl::StatusOr<std::unique_ptr<PagePool>> Create(const PagePoolOptions& options);
  ~PagePool() override;

  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override;
  void Retain(uint8_t* block, size_t bytes) override;
  void Free(uint8_t* block, size_t bytes) override;
  // Free that says whether it dropped the block's last reference (the
  // memory went back to the pool), for per-tenant accounting.
  bool FreeLast(uint8_t* block, size_t bytes);

  // Whether `count` blocks of `bytes` each could be allocated now.
  bool CanAllocate(size_t bytes, size_t count) const;
  PagePoolStats Stats() const;

  // Checksums of sealed blocks (service/page_checksum.h), kept in the slab
  // metadata beside each slot, never inside the block: 0 means unsealed. A
  // block's checksum is cleared when its last reference goes, so a reused
  // slot starts unsealed. One lock for a whole list; every block must be a
  // live block of this pool.
  bool keeps_checksums() const override { return true; }
  void SetChecksums(absl::Span<const uint8_t* const> blocks,
                    absl::Span<const uint64_t> sums) override;
  void GetChecksums(absl::Span<const uint8_t* const> blocks,
                    absl::Span<uint64_t> sums) const override;

 private:
  struct Slab {
    size_t slot_bytes = 0;       // 0: free slab. For a large run: the run's bytes.
    uint32_t run_slabs = 0;      // > 0 on the first slab of a large run.
    std::vector<uint32_t> free;  // Free slot indices (small classes).
    uint32_t live = 0;
    std::vector<uint64_t> checksums;  // Per slot (one for a large run); 0: unsealed.
  };

  PagePool(uint8_t* arena, size_t slabs, size_t slab_bytes);
  static size_t SlotBytes(size_t bytes);
  size_t SlabOf(const uint8_t* block) const;
  uint8_t* SlabBase(size_t slab) const { return arena_ + slab * slab_bytes_; }
  // Takes `n` contiguous free slabs; returns the first or slabs_.size().
  size_t TakeSlabs(size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseBlock(uint8_t* block, size_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where a live block's checksum word is: (slab, index in its checksums).
  std::pair<size_t, size_t> ChecksumSlot(const uint8_t* block) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetChecksum(const uint8_t* block, uint64_t sum) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sizes a slab's checksum words for `slots` slots (0: frees them).
  void SizeChecksums(Slab& slab, size_t slots) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  uint8_t* const arena_;
  const size_t slab_bytes_;
  mutable absl::Mutex mu_;
  std::vector<Slab> slabs_ ABSL_GUARDED_BY(mu_);
  // Slabs of each small class that have a free slot.
  absl::flat_hash_map<size_t, std::vector<size_t>> open_slabs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint8_t*, uint32_t> extra_refs_ ABSL_GUARDED_BY(mu_);
  size_t free_slabs_ ABSL_GUARDED_BY(mu_) = 0;
  size_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t blocks_used_ ABSL_GUARDED_BY(mu_) = 0;
  size_t checksum_words_ ABSL_GUARDED_BY(mu_) = 0;
  size_t sealed_blocks_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_PAGE_POOL_H_
