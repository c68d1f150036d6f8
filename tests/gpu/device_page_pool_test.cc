// The device page pool's allocator contract on a real device: exhaustion,
// reference counts, copies that round-trip, and a KvStream whose pages live
// in it. Skipped, with the reason, where this machine has no CUDA device.
#include "kernels/cuda/device_page_pool.h"

#include <cstdio>
#include <memory>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/device_info.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

constexpr size_t kPage = 64 << 10;

class DevicePagePoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the device page pool needs one";
  }
  std::unique_ptr<DevicePagePool> MakePool(size_t pages, PageAllocator* host = nullptr) {
    DevicePagePoolOptions o;
    o.capacity_bytes = pages * kPage;
    o.page_bytes = kPage;
    o.staging_bytes = 16 << 10;  // Smaller than a page: copies take several chunks.
    absl::StatusOr<std::unique_ptr<DevicePagePool>> p = DevicePagePool::Create(o, host);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
};

TEST_F(DevicePagePoolTest, ExhaustionAnswersResourceExhausted) {
  std::unique_ptr<DevicePagePool> pool = MakePool(4);
  ASSERT_NE(pool, nullptr);
  std::vector<uint8_t*> blocks;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<uint8_t*> b = pool->Allocate(kPage);
    ASSERT_TRUE(b.ok()) << b.status();
    blocks.push_back(*b);
  }
  absl::StatusOr<uint8_t*> more = pool->Allocate(100);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(more.status().message(),
            "device page pool on device 0 is full: 4 pages of 65536 bytes in use");
  EXPECT_EQ(pool->Allocate(kPage + 1).status(),
            absl::InvalidArgumentError(
                "device page pool: a block of 65537 bytes is larger than its page_bytes, 65536"));
  pool->Free(blocks[2], kPage);
  absl::StatusOr<uint8_t*> again = pool->Allocate(kPage);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, blocks[2]) << "the freed slot is the one reused";
  EXPECT_EQ(pool->Stats().pages_used, 4u);
}

TEST_F(DevicePagePoolTest, ReferenceCountsKeepSharedPagesLive) {
  std::unique_ptr<DevicePagePool> pool = MakePool(2);
  ASSERT_NE(pool, nullptr);
  uint8_t* a = *pool->Allocate(kPage);
  pool->Retain(a, kPage);
  EXPECT_EQ(pool->Stats().shared_pages, 1u);
  pool->Free(a, kPage);
  EXPECT_EQ(pool->Stats().pages_used, 1u) << "one reference is left";
  EXPECT_EQ(pool->Stats().shared_pages, 0u);
  uint8_t* b = *pool->Allocate(kPage);
  EXPECT_NE(a, b);
  EXPECT_EQ(pool->Allocate(kPage).status().code(), absl::StatusCode::kResourceExhausted);
  pool->Free(a, kPage);
  EXPECT_EQ(pool->Stats().pages_used, 1u);
  EXPECT_TRUE(pool->Allocate(kPage).ok());
}

TEST_F(DevicePagePoolTest, CopiesRoundTrip) {
  std::unique_ptr<DevicePagePool> pool = MakePool(3);
  ASSERT_NE(pool, nullptr);
  EXPECT_FALSE(pool->host_accessible());
  uint8_t* a = *pool->Allocate(kPage);
  uint8_t* b = *pool->Allocate(kPage);
  std::vector<uint8_t> in(kPage), out(kPage);
  std::iota(in.begin(), in.end(), uint8_t{7});
  ASSERT_TRUE(pool->WriteBlock(a, 0, in.data(), kPage).ok());
  ASSERT_TRUE(pool->CopyBlock(b, a, kPage).ok());
  ASSERT_TRUE(pool->ZeroBlock(a, 100, 1000).ok());
  ASSERT_TRUE(pool->ReadBlock(b, 0, kPage, out.data()).ok());
  EXPECT_EQ(out, in);
  std::vector<uint8_t> part(3000);
  ASSERT_TRUE(pool->ReadBlock(a, 0, part.size(), part.data()).ok());
  for (size_t i = 0; i < part.size(); ++i) {
    const uint8_t want = i >= 100 && i < 1100 ? 0 : in[i];
    ASSERT_EQ(part[i], want) << "byte " << i;
  }
  // A write at an offset lands there only.
  const uint8_t mark[3] = {1, 2, 3};
  ASSERT_TRUE(pool->WriteBlock(b, kPage - 3, mark, 3).ok());
  ASSERT_TRUE(pool->ReadBlock(b, kPage - 5, 5, part.data()).ok());
  EXPECT_EQ(std::vector<uint8_t>(part.begin(), part.begin() + 5),
            (std::vector<uint8_t>{in[kPage - 5], in[kPage - 4], 1, 2, 3}));
}

// fp16 pages need no kernel (KvStream copies rows in and out through the
// allocator), so a stream over the device pool runs with the host backend.
TEST_F(DevicePagePoolTest, Fp16StreamStoresAndReadsBackExactly) {
  std::unique_ptr<DevicePagePool> pool = MakePool(64);
  ASSERT_NE(pool, nullptr);
  StreamConfig config = testutil::SchemeCase{"fp16", 128, {}, ""}.Config();
  absl::StatusOr<std::unique_ptr<KvStream>> s = KvStream::Create(config, &RefBackend(), pool.get());
  ASSERT_TRUE(s.ok()) << s.status();
  const int n = 300, d = 128;
  std::vector<uint16_t> k(static_cast<size_t>(n) * d), v(k.size());
  const std::vector<float> kf = testutil::MakeKeys(n, d, 1), vf = testutil::MakeValues(n, d, 2);
  FloatToRow(kf.data(), n * d, DType::kFloat16, k.data());
  FloatToRow(vf.data(), n * d, DType::kFloat16, v.data());
  ASSERT_TRUE((*s)->Append({k.data(), DType::kFloat16, n, d, 0}, {v.data(), DType::kFloat16, n, d, 0})
                  .ok());
  std::vector<uint16_t> ko(k.size()), vo(v.size());
  ReadOptions ro;
  ro.dtype = DType::kFloat16;
  ASSERT_TRUE((*s)->Read(0, n, ro, {ko.data(), DType::kFloat16, n, d, 0},
                         {vo.data(), DType::kFloat16, n, d, 0})
                  .ok());
  EXPECT_EQ(ko, k);
  EXPECT_EQ(vo, v);
  // Raw pages out and into a second stream; a fork shares the full pages.
  const int q = (*s)->quantized_tokens();
  std::vector<uint8_t> pages(static_cast<size_t>((*s)->PagesFor(q)) * (*s)->layout().page_bytes);
  ASSERT_TRUE((*s)->CopyPages(0, q, pages.data()).ok());
  std::unique_ptr<KvStream> t = *KvStream::Create(config, &RefBackend(), pool.get());
  ASSERT_TRUE(t->AppendPages(pages.data(), q).ok());
  std::vector<uint16_t> kt(k.size());
  ASSERT_TRUE(t->Read(0, q, ro, {kt.data(), DType::kFloat16, q, d, 0}, {}).ok());
  EXPECT_EQ(kt, k);
  const size_t used = pool->Stats().pages_used;
  absl::StatusOr<std::unique_ptr<KvStream>> f = (*s)->Fork(n);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_LE(pool->Stats().pages_used, used + 1) << "full pages are shared, not copied";
  std::vector<uint16_t> kf2(k.size());
  ASSERT_TRUE((*f)->Read(0, n, ro, {kf2.data(), DType::kFloat16, n, d, 0}, {}).ok());
  EXPECT_EQ(kf2, k);
}

// Not a check: the figure gpu_check.sh reports (median of 5 copies of 1 GiB).
TEST_F(DevicePagePoolTest, DeviceToDeviceCopyBandwidth) {
  absl::StatusOr<double> gbps = MeasureDeviceCopyBandwidth(0, size_t{1} << 30, 5);
  ASSERT_TRUE(gbps.ok()) << gbps.status();
  EXPECT_GT(*gbps, 0.0);
  std::printf("d2d_copy_gbps=%.1f\n", *gbps);
}

}  // namespace
}  // namespace kvq
