#include "kernels/page_allocator.h"

#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"
#include "kernels/page_layout.h"

namespace kvq {
namespace {

class HeapAllocator final : public PageAllocator {
 public:
  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override {
    const size_t rounded = (bytes + kPageAlign - 1) / kPageAlign * kPageAlign;
    void* p = std::aligned_alloc(kPageAlign, rounded == 0 ? kPageAlign : rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("heap allocation of ", bytes, " bytes failed"));
    }
    return static_cast<uint8_t*>(p);
  }
  void Free(uint8_t* block, size_t) override { std::free(block); }
};

}  // namespace

PageAllocator* HeapPageAllocator() {
  static HeapAllocator* allocator = new HeapAllocator();
  return allocator;
}

}  // namespace kvq
