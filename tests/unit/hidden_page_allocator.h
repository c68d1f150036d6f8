// HiddenPageAllocator: pages the host cannot address, for testing the code
// that must never touch page bytes directly (kernels/page_allocator.h).
//
// The pages live in one memfd mapped twice: the addresses Allocate() hands
// out are a PROT_NONE mapping, so any direct read or write of page bytes
// faults, while the copy operations and HostAlias() (what the cuda_host
// backend, standing in for a device, addresses pages through) use a second,
// read-write mapping of the same memory. Host blocks (AllocateHost) are
// plain heap memory. Thread-safe; it must outlive its streams.
#ifndef KVQ_TESTS_UNIT_HIDDEN_PAGE_ALLOCATOR_H_
#define KVQ_TESTS_UNIT_HIDDEN_PAGE_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/page_allocator.h"

namespace kvq {
namespace testutil {

class HiddenPageAllocator final : public PageAllocator {
 public:
  // Reserves `capacity_bytes` of address space (memory is used only as
  // pages are written); Allocate() answers RESOURCE_EXHAUSTED beyond it.
  explicit HiddenPageAllocator(size_t capacity_bytes = size_t{1} << 30);
  ~HiddenPageAllocator() override;
  HiddenPageAllocator(const HiddenPageAllocator&) = delete;
  HiddenPageAllocator& operator=(const HiddenPageAllocator&) = delete;

  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override;
  void Retain(uint8_t* block, size_t bytes) override;
  void Free(uint8_t* block, size_t bytes) override;

  bool host_accessible() const override { return false; }
  absl::Status ReadBlock(const uint8_t* block, size_t offset, size_t bytes,
                         uint8_t* out) override;
  absl::Status WriteBlock(uint8_t* block, size_t offset, const uint8_t* data,
                          size_t bytes) override;
  absl::Status ZeroBlock(uint8_t* block, size_t offset, size_t bytes) override;
  absl::Status CopyBlock(uint8_t* dst, const uint8_t* src, size_t bytes) override;
  // The read-write alias of a hidden block; any other pointer (host memory
  // such as a received message's pages) unchanged.
  uint8_t* HostAlias(const uint8_t* block) override;

  // Checksums beside each hidden block, as the device pool keeps them.
  bool keeps_checksums() const override { return true; }
  void SetChecksums(absl::Span<const uint8_t* const> blocks,
                    absl::Span<const uint64_t> sums) override;
  void GetChecksums(absl::Span<const uint8_t* const> blocks,
                    absl::Span<uint64_t> sums) const override;

  absl::StatusOr<uint8_t*> AllocateHost(size_t bytes) override;
  void FreeHost(uint8_t* block, size_t bytes) override;

  // Bytes of live hidden blocks plus host blocks, as requested.
  size_t live_bytes() const;
  // Live hidden blocks plus host blocks.
  int live_blocks() const;
  // Calls that named a block this allocator does not hold (or a range
  // outside it): Free, Retain, FreeHost and the copy operations.
  int bad_calls() const;
  // TestAllocator's name for it, so a test may take either.
  int bad_frees() const { return bad_calls(); }

 private:
  // The alias of [block + offset, + bytes); nullptr (counted in
  // bad_calls_) unless that is inside a live hidden block.
  uint8_t* Checked(const uint8_t* block, size_t offset, size_t bytes);

  int fd_ = -1;
  size_t capacity_ = 0;
  uint8_t* hidden_ = nullptr;  // PROT_NONE.
  uint8_t* alias_ = nullptr;   // Read-write, the same memory.
  mutable absl::Mutex mu_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // Bump offset into the arena.
  absl::flat_hash_map<size_t, std::vector<size_t>> free_ ABSL_GUARDED_BY(mu_);
  struct Block {
    size_t bytes = 0;
    int refs = 0;
    uint64_t checksum = 0;
  };
  absl::flat_hash_map<size_t, Block> live_ ABSL_GUARDED_BY(mu_);  // By offset.
  absl::flat_hash_map<uint8_t*, size_t> host_ ABSL_GUARDED_BY(mu_);
  size_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int bad_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

// One allocator for every hidden-page stream of a test binary.
HiddenPageAllocator* SharedHiddenPages();

}  // namespace testutil
}  // namespace kvq

#endif  // KVQ_TESTS_UNIT_HIDDEN_PAGE_ALLOCATOR_H_
