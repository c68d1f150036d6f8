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
class HeapAllocator final : public PageAllocator {
 public:
  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override {
    const size_t rounded = (bytes + kPageAlign - 1) / kPageAlign * kPageAlign;
    void* p = std::aligned_alloc(kPageAlign, rounded + kPageAlign);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("heap allocation of ", bytes, " bytes failed"));
    }
    new (p) std::atomic<int>(1);
    return static_cast<uint8_t*>(p) + kPageAlign;
  }
  void Retain(uint8_t* block, size_t) override {
    Count(block)->fetch_add(1, std::memory_order_relaxed);
  }
  void Free(uint8_t* block, size_t) override {
    if (Count(block)->fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::free(block - kPageAlign);
    }
  }

 private:
  static std::atomic<int>* Count(uint8_t* block) {
    return reinterpret_cast<std::atomic<int>*>(block - kPageAlign);
  }
};

}  // namespace

PageAllocator* HeapPageAllocator() {
  static HeapAllocator* allocator = new HeapAllocator();
  return allocator;
}

}  // namespace kvq
