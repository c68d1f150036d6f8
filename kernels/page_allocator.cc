#include "kernels/page_allocator.h"

#include <atomic>
#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"
#include "kernels/page_layout.h"

namespace kvq {
namespace {

// Each block is preceded by kPageAlign bytes holding its reference count, so
// the block itself stays aligned.
std::atomic<int>* Count(uint8_t* block) {
  return reinterpret_cast<std::atomic<int>*>(block - kPageAlign);
}

size_t RoundedBytes(size_t bytes) { return (bytes + kPageAlign - 1) / kPageAlign * kPageAlign; }

absl::StatusOr<uint8_t*> AllocateCounted(size_t bytes) {
  void* p = std::aligned_alloc(kPageAlign, RoundedBytes(bytes) + kPageAlign);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("heap allocation of ", bytes, " bytes failed"));
  }
  new (p) std::atomic<int>(1);
  return static_cast<uint8_t*>(p) + kPageAlign;
}

void FreeCounted(uint8_t* block) { std::free(block - kPageAlign); }

// Drops one reference; true when it was the last.
bool Release(uint8_t* block) {
  return Count(block)->fetch_sub(1, std::memory_order_acq_rel) == 1;
}

class HeapAllocator final : public PageAllocator {
 public:
  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override { return AllocateCounted(bytes); }
  void Retain(uint8_t* block, size_t) override {
    Count(block)->fetch_add(1, std::memory_order_relaxed);
  }
  void Free(uint8_t* block, size_t) override {
    if (Release(block)) FreeCounted(block);
  }
};

}  // namespace

RecyclingPageAllocator::RecyclingPageAllocator(size_t max_cached_bytes)
    : max_cached_bytes_(max_cached_bytes) {}

RecyclingPageAllocator::~RecyclingPageAllocator() {
  absl::MutexLock lock(&mu_);
  for (auto& [bytes, blocks] : free_) {
    for (uint8_t* b : blocks) FreeCounted(b);
  }
}

absl::StatusOr<uint8_t*> RecyclingPageAllocator::Allocate(size_t bytes) {
  const size_t rounded = RoundedBytes(bytes);
  {
    absl::MutexLock lock(&mu_);
    auto it = free_.find(rounded);
    if (it != free_.end() && !it->second.empty()) {
      uint8_t* b = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= rounded;
      Count(b)->store(1, std::memory_order_relaxed);
      return b;
    }
  }
  return AllocateCounted(bytes);
}

void RecyclingPageAllocator::Retain(uint8_t* block, size_t) {
  Count(block)->fetch_add(1, std::memory_order_relaxed);
}

void RecyclingPageAllocator::Free(uint8_t* block, size_t bytes) {
  if (!Release(block)) return;
  const size_t rounded = RoundedBytes(bytes);
  {
    absl::MutexLock lock(&mu_);
    if (cached_bytes_ + rounded <= max_cached_bytes_) {
      free_[rounded].push_back(block);
      cached_bytes_ += rounded;
      return;
    }
  }
  FreeCounted(block);
}

size_t RecyclingPageAllocator::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

PageAllocator* HeapPageAllocator() {
  static HeapAllocator* allocator = new HeapAllocator();
  return allocator;
}

}  // namespace kvq
