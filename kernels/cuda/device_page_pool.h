// DevicePagePool: a device's KV pages, as a PageAllocator.
//
// One cudaMalloc at start (capacity_bytes, or capacity_fraction of the
// device's free memory), cut into fixed-size page slots on a free list:
// no device allocation per request, and no fragmentation, since every
// block takes one slot. Slots are reference counted (Retain / Free) so
// that forks and reused prefixes share full pages, as in the host pool.
//
// The host cannot address the pages (host_accessible() is false, HostAlias
// nullptr). The copy operations are cudaMemcpy on the calling thread's
// per-thread stream, synchronised before they return; transfers to and
// from host memory go through a small pool of pinned (cudaHostAlloc)
// staging buffers, which the DMA engine reads and writes directly, so a
// copy does not first bounce through a driver buffer and gRPC threads can
// move payloads while kernels run. Streams' host blocks (AllocateHost: the
// fp16 sink and tail, the header, nuq levels) come from `host`, which the
// service points at its host PagePool so that they stay counted.
//
// Thread-safe. Errors come through kvq::CudaStatus.
#ifndef KVQ_KERNELS_CUDA_DEVICE_PAGE_POOL_H_
#define KVQ_KERNELS_CUDA_DEVICE_PAGE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/page_allocator.h"

namespace kvq {

struct DevicePagePoolOptions {
  int device = 0;
  // Bytes of device memory to reserve; 0: capacity_fraction of the free
  // device memory at start.
  size_t capacity_bytes = 0;
  double capacity_fraction = 0.0;
  // Every block takes one slot of this many bytes (rounded up to
  // kPageAlign): at least the largest page size the server stores.
  size_t page_bytes = 0;
  // Pinned staging buffers for host <-> device copies, and their size.
  int staging_buffers = 4;
  size_t staging_bytes = size_t{1} << 20;
};

struct DevicePagePoolStats {
  size_t capacity_bytes = 0;  // Reserved device memory (whole slots).
  size_t page_bytes = 0;      // Slot size.
  size_t pages_total = 0;
  size_t pages_used = 0;      // Slots holding a live block.
  size_t shared_pages = 0;    // Live slots with more than one reference.
};

class DevicePagePool final : public PageAllocator {
 public:
  // INVALID_ARGUMENT for a page size of 0, a fraction outside (0, 1], or a
  // capacity below one page (messages name the option and the limit);
  // FAILED_PRECONDITION without the device; RESOURCE_EXHAUSTED when the
  // device memory or the pinned buffers cannot be had. `host` (the heap
  // when null) serves AllocateHost and must outlive the pool.
  static absl::StatusOr<std::unique_ptr<DevicePagePool>> Create(
      const DevicePagePoolOptions& options, PageAllocator* host = nullptr);
  ~DevicePagePool() override;
  DevicePagePool(const DevicePagePool&) = delete;
  DevicePagePool& operator=(const DevicePagePool&) = delete;

  // INVALID_ARGUMENT above page_bytes; RESOURCE_EXHAUSTED when every slot
  // is taken.
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
  uint8_t* HostAlias(const uint8_t* block) override {
    (void)block;
    return nullptr;
  }

  absl::StatusOr<uint8_t*> AllocateHost(size_t bytes) override;
  void FreeHost(uint8_t* block, size_t bytes) override;

  // Page checksums, one word per slot beside the arena (host memory).
  bool keeps_checksums() const override { return true; }
  void SetChecksums(absl::Span<const uint8_t* const> blocks,
                    absl::Span<const uint64_t> sums) override;
  void GetChecksums(absl::Span<const uint8_t* const> blocks,
                    absl::Span<uint64_t> sums) const override;

  int device() const { return device_; }
  DevicePagePoolStats Stats() const;

 private:
  DevicePagePool(int device, uint8_t* base, size_t slots, size_t slot_bytes, PageAllocator* host);
  // The slot of a live block; slots_ when `block` is not one.
  size_t SlotOf(const uint8_t* block) const;
  // A pinned buffer of staging_bytes_ (waits for one when all are in use).
  uint8_t* TakeStaging();
  void ReturnStaging(uint8_t* buffer);
  // Host <-> device in chunks of the staging buffer.
  absl::Status StagedCopy(uint8_t* device_ptr, const uint8_t* host_in, uint8_t* host_out,
                          size_t bytes);

  const int device_;
  uint8_t* const base_;
  const size_t slots_;
  const size_t slot_bytes_;
  PageAllocator* const host_;
  size_t staging_bytes_ = 0;

  mutable absl::Mutex mu_;
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mu_);   // Free slot indices.
  std::vector<uint32_t> refs_ ABSL_GUARDED_BY(mu_);   // Per slot; 0: free.
  std::vector<uint64_t> sums_ ABSL_GUARDED_BY(mu_);   // Per slot; 0: unsealed.
  size_t shared_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Mutex staging_mu_;
  std::vector<uint8_t*> staging_all_;                           // Every pinned buffer.
  std::vector<uint8_t*> staging_free_ ABSL_GUARDED_BY(staging_mu_);
};

// Device-to-device cudaMemcpy bandwidth of device `device` in GB/s (1e9
// bytes per second, counting the bytes copied once): the median of
// `repeats` copies of `bytes` bytes, after one warm-up copy.
absl::StatusOr<double> MeasureDeviceCopyBandwidth(int device, size_t bytes, int repeats);

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_DEVICE_PAGE_POOL_H_
