// CountingPageAllocator: a PageAllocator that forwards to another one and
// counts the bytes its callers hold, so a benchmark can report what a stream
// really allocated instead of what the stream says it allocated.
#ifndef KVQ_BENCH_COUNTING_ALLOCATOR_H_
#define KVQ_BENCH_COUNTING_ALLOCATOR_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kernels/page_allocator.h"

namespace kvq {

class CountingPageAllocator final : public PageAllocator {
 public:
  explicit CountingPageAllocator(PageAllocator* base = HeapPageAllocator()) : base_(base) {}

  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override {
    absl::StatusOr<uint8_t*> p = base_->Allocate(bytes);
    if (p.ok()) {
      in_use_ += bytes;
      ++blocks_;
    }
    return p;
  }
  // A shared block counts once: only the last Free releases its bytes.
  void Retain(uint8_t* block, size_t bytes) override {
    {
      absl::MutexLock lock(&mu_);
      ++extra_refs_[block];
    }
    base_->Retain(block, bytes);
  }
  void Free(uint8_t* block, size_t bytes) override {
    bool last = true;
    {
      absl::MutexLock lock(&mu_);
      if (auto it = extra_refs_.find(block); it != extra_refs_.end()) {
        last = false;
        if (--it->second == 0) extra_refs_.erase(it);
      }
    }
    if (last) {
      in_use_ -= bytes;
      --blocks_;
    }
    base_->Free(block, bytes);
  }

  // Where the blocks live and how they are reached: the base's answers
  // (a device pool's pages are counted like the heap's).
  bool host_accessible() const override { return base_->host_accessible(); }
  absl::Status ReadBlock(const uint8_t* block, size_t offset, size_t bytes,
                         uint8_t* out) override {
    return base_->ReadBlock(block, offset, bytes, out);
  }
  absl::Status WriteBlock(uint8_t* block, size_t offset, const uint8_t* data,
                          size_t bytes) override {
    return base_->WriteBlock(block, offset, data, bytes);
  }
  absl::Status ZeroBlock(uint8_t* block, size_t offset, size_t bytes) override {
    return base_->ZeroBlock(block, offset, bytes);
  }
  absl::Status CopyBlock(uint8_t* dst, const uint8_t* src, size_t bytes) override {
    return base_->CopyBlock(dst, src, bytes);
  }
  uint8_t* HostAlias(const uint8_t* block) override { return base_->HostAlias(block); }
  // A stream's host blocks (header, fp16 sink and tail) count too.
  absl::StatusOr<uint8_t*> AllocateHost(size_t bytes) override {
    absl::StatusOr<uint8_t*> p = base_->AllocateHost(bytes);
    if (p.ok()) {
      in_use_ += bytes;
      ++blocks_;
    }
    return p;
  }
  void FreeHost(uint8_t* block, size_t bytes) override {
    in_use_ -= bytes;
    --blocks_;
    base_->FreeHost(block, bytes);
  }

  // Bytes requested by blocks not yet freed.
  size_t bytes_in_use() const { return in_use_.load(); }
  int64_t blocks_in_use() const { return blocks_.load(); }

 private:
  PageAllocator* base_;
  absl::Mutex mu_;
  absl::flat_hash_map<uint8_t*, int> extra_refs_;  // References beyond the first.
  std::atomic<size_t> in_use_{0};
  std::atomic<int64_t> blocks_{0};
};

}  // namespace kvq

#endif  // KVQ_BENCH_COUNTING_ALLOCATOR_H_
