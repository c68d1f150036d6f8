// RecyclingPageAllocator: freed blocks come back for the next allocation of
// their size, references count, and the cache respects its cap.
#include "kernels/page_allocator.h"

#include <cstdint>

#include "gtest/gtest.h"
#include "kernels/page_layout.h"

namespace kvq {
namespace {

TEST(RecyclingPageAllocatorTest, AFreedBlockIsReusedForItsSize) {
  RecyclingPageAllocator pages;
  absl::StatusOr<uint8_t*> a = pages.Allocate(5000);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*a) % kPageAlign, 0u);
  (*a)[4999] = 7;  // The whole size is usable.
  pages.Free(*a, 5000);
  EXPECT_GT(pages.cached_bytes(), 0u);
  absl::StatusOr<uint8_t*> other = pages.Allocate(100000);  // Another size: fresh.
  ASSERT_TRUE(other.ok());
  EXPECT_NE(*other, *a);
  absl::StatusOr<uint8_t*> b = pages.Allocate(5000);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, *a);
  EXPECT_EQ(pages.cached_bytes(), 0u);
  pages.Free(*b, 5000);
  pages.Free(*other, 100000);
}

TEST(RecyclingPageAllocatorTest, ABlockReturnsOnlyWhenItsLastReferenceGoes) {
  RecyclingPageAllocator pages;
  absl::StatusOr<uint8_t*> a = pages.Allocate(4096);
  ASSERT_TRUE(a.ok());
  pages.Retain(*a, 4096);  // Shared, as a forked prefix shares its pages.
  pages.Free(*a, 4096);
  EXPECT_EQ(pages.cached_bytes(), 0u);
  absl::StatusOr<uint8_t*> b = pages.Allocate(4096);
  ASSERT_TRUE(b.ok());
  EXPECT_NE(*b, *a);  // Still held.
  pages.Free(*a, 4096);
  EXPECT_EQ(pages.cached_bytes(), 4096u);
  absl::StatusOr<uint8_t*> c = pages.Allocate(4096);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, *a);
  pages.Free(*b, 4096);
  pages.Free(*c, 4096);
}

TEST(RecyclingPageAllocatorTest, KeepsNoMoreThanItsCap) {
  RecyclingPageAllocator pages(8192);
  uint8_t* blocks[3];
  for (uint8_t*& b : blocks) b = *pages.Allocate(4096);
  for (uint8_t* b : blocks) pages.Free(b, 4096);  // The third goes back to the heap.
  EXPECT_EQ(pages.cached_bytes(), 8192u);
  RecyclingPageAllocator none(0);
  none.Free(*none.Allocate(4096), 4096);
  EXPECT_EQ(none.cached_bytes(), 0u);
}

}  // namespace
}  // namespace kvq
