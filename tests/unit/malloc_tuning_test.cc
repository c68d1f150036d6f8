// After RetainMessageBuffers() a message-sized allocation comes from the
// heap (no mmap per message) and its memory stays mapped after free.
#include "kernels/malloc_tuning.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"

namespace kvq {
namespace {

void* volatile sink;  // Keeps the compiler from eliding the allocations.

TEST(MallocTuningTest, MessageSizedBlocksComeFromTheHeapAndStay) {
  if (!kMallocIsGlibc) GTEST_SKIP() << "the sanitizer's allocator replaces glibc's malloc";
  ASSERT_TRUE(RetainMessageBuffers().ok());
  const size_t mapped_before = mallinfo2().hblks;
  for (int i = 0; i < 8; ++i) {
    void* p = std::malloc(size_t{1} << 20);
    sink = p;
    ASSERT_NE(p, nullptr);
    std::memset(p, i, size_t{1} << 20);
    EXPECT_EQ(mallinfo2().hblks, mapped_before) << "a 1 MiB block was mmapped";
    std::free(p);
  }
  // Freed, the block stays in the heap for the next message.
  EXPECT_GE(mallinfo2().fordblks, size_t{1} << 20);
}

}  // namespace
}  // namespace kvq
