#include "service/page_pool.h"

#include <cstdint>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvq {
namespace {

std::unique_ptr<PagePool> MakePool(size_t capacity, size_t slab) {
  absl::StatusOr<std::unique_ptr<PagePool>> p = PagePool::Create({capacity, slab});
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

// The VmFlags line of the /proc/self/smaps mapping that holds `p`.
std::string VmFlagsOf(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= a && a < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST(PagePoolTest, AsksForHugePagesUnlessTurnedOff) {
  // madvise(MADV_HUGEPAGE) marks the mapping "hg" whether or not the kernel
  // then finds huge pages to back it.
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) {
    GTEST_SKIP() << "this kernel has no transparent huge pages";
  }
  for (const bool huge : {true, false}) {
    PagePoolOptions options;
    options.capacity_bytes = size_t{8} << 20;
    options.huge_pages = huge;
    absl::StatusOr<std::unique_ptr<PagePool>> pool = PagePool::Create(options);
    ASSERT_TRUE(pool.ok()) << pool.status();
    absl::StatusOr<uint8_t*> block = (*pool)->Allocate(4096);
    ASSERT_TRUE(block.ok());
    const std::string flags = VmFlagsOf(*block);
    ASSERT_FALSE(flags.empty()) << "no smaps entry for the arena";
    EXPECT_EQ(flags.find(" hg") != std::string::npos, huge) << flags;
    (*pool)->Free(*block, 4096);
  }
}

TEST(PagePoolTest, RejectsBadOptions) {
  EXPECT_EQ(PagePool::Create({1000, 4096}).status().message(),
            "capacity_bytes 1000 is below one slab of 4096 bytes");
  EXPECT_EQ(PagePool::Create({1 << 20, 100}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PagePoolTest, FillsExactlyAndRefusesBeyondCapacity) {
  auto pool = MakePool(16 * 4096, 4096);
  std::set<uint8_t*> blocks;
  for (int i = 0; i < 16 * 4; ++i) {  // 4 slots of 1 KiB per slab.
    absl::StatusOr<uint8_t*> b = pool->Allocate(1000);
    ASSERT_TRUE(b.ok()) << i << ": " << b.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*b) % 64, 0u);
    EXPECT_TRUE(blocks.insert(*b).second) << "block handed out twice";
  }
  EXPECT_EQ(pool->Stats().used_bytes, 64u * 1024);
  EXPECT_FALSE(pool->CanAllocate(1000, 1));
  absl::StatusOr<uint8_t*> full = pool->Allocate(1000);
  ASSERT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("page pool exhausted"), absl::string_view::npos);
  for (uint8_t* b : blocks) pool->Free(b, 1000);
  const PagePoolStats st = pool->Stats();
  EXPECT_EQ(st.used_bytes, 0u);
  EXPECT_EQ(st.slabs_used, 0u);
  EXPECT_EQ(st.blocks_used, 0u);
}

TEST(PagePoolTest, FreedSlabsServeOtherSizes) {
  auto pool = MakePool(4 * 4096, 4096);
  std::vector<uint8_t*> small;
  for (int i = 0; i < 4 * 64; ++i) small.push_back(*pool->Allocate(64));
  EXPECT_FALSE(pool->Allocate(2048).ok());
  for (uint8_t* b : small) pool->Free(b, 64);
  // Every slab went back: two 2 KiB blocks per slab now fit in all four.
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(pool->Allocate(2048).ok()) << i;
}

TEST(PagePoolTest, LargeBlocksTakeContiguousSlabs) {
  auto pool = MakePool(8 * 4096, 4096);
  absl::StatusOr<uint8_t*> big = pool->Allocate(3 * 4096 + 1);  // Four slabs.
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(pool->Stats().slabs_used, 4u);
  std::fill(*big, *big + 3 * 4096 + 1, uint8_t{7});
  EXPECT_TRUE(pool->Allocate(4 * 4096).ok());
  EXPECT_FALSE(pool->Allocate(4096).ok());
  pool->Free(*big, 3 * 4096 + 1);
  EXPECT_TRUE(pool->Allocate(4096).ok());
}

TEST(PagePoolTest, SharedBlocksFreeOnTheLastReference) {
  auto pool = MakePool(4096, 4096);
  uint8_t* b = *pool->Allocate(512);
  pool->Retain(b, 512);
  EXPECT_EQ(pool->Stats().shared_blocks, 1u);
  pool->Free(b, 512);
  EXPECT_EQ(pool->Stats().used_bytes, 512u) << "one reference is still held";
  pool->Free(b, 512);
  EXPECT_EQ(pool->Stats().used_bytes, 0u);
  EXPECT_EQ(pool->Stats().shared_blocks, 0u);
}

}  // namespace
}  // namespace kvq
