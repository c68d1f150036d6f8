// The device quantize and dequantize kernels (kernels/cuda/cuda_quantize.h)
// against the reference: for every scheme of the typed suites, pages
// written on the device from fp32 and fp16 rows equal QuantizeRowsRef's
// bytes, and rows read back (fp32 and fp16) equal DequantizeRowsRef's, with
// several jobs (pages, row ranges) in one launch. Skips without a device;
// the job checks need none.
#include "kernels/cuda/cuda_quantize.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/ref_kernels.h"
#include "kernels/cuda/device_info.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"
#include "tests/gpu/device_buffer.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::DeviceBuffer;

class CudaQuantizeTest : public ::testing::TestWithParam<testutil::SchemeCase> {};

// One job's rows: [row0, row0 + n) of page `page`.
struct Range {
  int page, row0, n;
};

TEST_P(CudaQuantizeTest, PagesAndRowsEqualReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the device kernels are not run";
  const StreamConfig config = GetParam().Config();
  absl::StatusOr<std::unique_ptr<KvStream>> made = testutil::TryMakeStream(config, &RefBackend());
  ASSERT_TRUE(made.ok()) << made.status();
  KvStream& s = **made;
  // A few tokens so that fp8 streams have their scales.
  const int d = config.head_dim;
  ASSERT_TRUE(testutil::AppendRows(s, testutil::MakeKeys(4, d, 1), testutil::MakeValues(4, d, 1),
                                   0, 4)
                  .ok());
  const PageLayout& L = s.layout();
  const int pt = L.page_tokens;
  const int g = L.block_tokens;
  const std::vector<Range> ranges = {{0, 0, pt}, {1, g < pt ? g : 0, g < pt ? pt - g : pt}, {2, 0, g}};
  const int pages = 3;
  for (Side side : {Side::kKey, Side::kValue}) {
    SCOPED_TRACE(side == Side::kKey ? "keys" : "values");
    // Rows as the stream's quantizer sees them (kivi: fp16 values).
    std::vector<float> rows(static_cast<size_t>(pages) * pt * d);
    for (int p = 0; p < pages; ++p) {
      const std::vector<float> x = side == Side::kKey ? testutil::MakeKeys(pt, d, 10 + p)
                                                      : testutil::MakeValues(pt, d, 10 + p);
      for (size_t i = 0; i < x.size(); ++i) {
        rows[static_cast<size_t>(p) * pt * d + i] = RoundToHalf(x[i]);
      }
    }
    std::vector<uint16_t> rows16(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) rows16[i] = FloatToHalf(rows[i]);
    std::vector<uint8_t> want(static_cast<size_t>(pages) * L.page_bytes, 0);
    for (const Range& r : ranges) {
      QuantizeRowsRef(s, side, rows.data() + (static_cast<size_t>(r.page) * pt + r.row0) * d, r.n,
                      want.data() + r.page * L.page_bytes, r.row0);
    }
    std::vector<float> levels;
    if (config.spec.nuq) {
      const int per = 1 << L.side(side).bits;
      for (int c = 0; c < d; ++c) {
        for (int i = 0; i < per; ++i) levels.push_back(HalfToFloat(s.levels(side, c)[i]));
      }
    }
    DeviceBuffer d_levels(levels.size() * sizeof(float));
    DeviceBuffer d_rows(rows.size() * sizeof(float)), d_rows16(rows16.size() * 2);
    DeviceBuffer d_pages(want.size());
    DeviceBuffer d_out(rows.size() * sizeof(float)), d_out16(rows.size() * 2);
    ASSERT_CUDA(cudaMemcpy(d_levels.ptr, levels.data(), levels.size() * sizeof(float),
                           cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(d_rows.ptr, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(d_rows16.ptr, rows16.data(), rows16.size() * 2, cudaMemcpyHostToDevice));
    hd::SideExtras extras;
    extras.levels = config.spec.nuq ? d_levels.as<float>() : nullptr;
    extras.fp8_scale = s.fp8_scale(side);
    const DeviceQuantSide qs = DeviceQuantSideOf(config.spec, L, side);
    for (DeviceRowType type : {DeviceRowType::kFloat32, DeviceRowType::kFloat16}) {
      SCOPED_TRACE(type == DeviceRowType::kFloat32 ? "fp32 rows" : "fp16 rows");
      ASSERT_CUDA(cudaMemset(d_pages.ptr, 0, want.size()));
      std::vector<QuantizeJob> jobs;
      for (const Range& r : ranges) {
        const size_t first = (static_cast<size_t>(r.page) * pt + r.row0) * d;
        QuantizeJob job;
        job.page = d_pages.as<uint8_t>() + r.page * L.page_bytes;
        job.rows = type == DeviceRowType::kFloat32 ? static_cast<const void*>(d_rows.as<float>() + first)
                                                   : static_cast<const void*>(d_rows16.as<uint16_t>() + first);
        job.extras = extras;
        job.row0 = r.row0;
        job.n = r.n;
        jobs.push_back(job);
      }
      ASSERT_TRUE(LaunchQuantizeRows(qs, type, jobs, nullptr).ok());
      ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<uint8_t> got(want.size());
      ASSERT_CUDA(cudaMemcpy(got.data(), d_pages.ptr, got.size(), cudaMemcpyDeviceToHost));
      for (int p = 0; p < pages; ++p) {
        EXPECT_EQ(std::memcmp(got.data() + p * L.page_bytes, want.data() + p * L.page_bytes,
                              L.page_bytes),
                  0)
            << "page " << p << " differs from the reference's";
      }
    }
    // Read the reference's pages back, every job's rows, both output types.
    ASSERT_CUDA(cudaMemcpy(d_pages.ptr, want.data(), want.size(), cudaMemcpyHostToDevice));
    for (DeviceRowType type : {DeviceRowType::kFloat32, DeviceRowType::kFloat16}) {
      std::vector<DequantizeJob> jobs;
      for (const Range& r : ranges) {
        const size_t first = (static_cast<size_t>(r.page) * pt + r.row0) * d;
        DequantizeJob job;
        job.page = d_pages.as<uint8_t>() + r.page * L.page_bytes;
        job.out = type == DeviceRowType::kFloat32 ? static_cast<void*>(d_out.as<float>() + first)
                                                  : static_cast<void*>(d_out16.as<uint16_t>() + first);
        job.extras = extras;
        job.row0 = r.row0;
        job.n = r.n;
        jobs.push_back(job);
      }
      ASSERT_TRUE(LaunchDequantizeRows(qs, type, jobs, nullptr).ok());
      ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<float> out(rows.size());
      std::vector<uint16_t> out16(rows.size());
      if (type == DeviceRowType::kFloat32) {
        ASSERT_CUDA(cudaMemcpy(out.data(), d_out.ptr, out.size() * 4, cudaMemcpyDeviceToHost));
      } else {
        ASSERT_CUDA(cudaMemcpy(out16.data(), d_out16.ptr, out16.size() * 2, cudaMemcpyDeviceToHost));
      }
      for (const Range& r : ranges) {
        const size_t first = (static_cast<size_t>(r.page) * pt + r.row0) * d;
        std::vector<float> ref(static_cast<size_t>(r.n) * d);
        DequantizeRowsRef(s, side, want.data() + r.page * L.page_bytes, r.row0, r.n, ref.data());
        for (size_t i = 0; i < ref.size(); ++i) {
          if (type == DeviceRowType::kFloat32) {
            ASSERT_EQ(FloatBits(out[first + i]), FloatBits(ref[i])) << "page " << r.page << " element " << i;
          } else {
            ASSERT_EQ(out16[first + i], FloatToHalf(ref[i])) << "page " << r.page << " element " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllSchemes, CudaQuantizeTest,
                         ::testing::ValuesIn(testutil::AllSchemeCases()),
                         [](const ::testing::TestParamInfo<testutil::SchemeCase>& info) {
                           return info.param.Label();
                         });

// Bad jobs are refused before anything is enqueued, naming the job and the
// field; these checks run on the host and need no device.
TEST(CudaQuantizeJobsTest, BadJobsNameTheJobAndTheField) {
  const QuantSpec spec = *QuantSpec::Parse("kivi4");
  const PageLayout L = *PageLayout::Make(spec, 64);
  const DeviceQuantSide side = DeviceQuantSideOf(spec, L, Side::kKey);
  alignas(16) uint8_t page_bytes[32] = {};
  alignas(16) float row[8] = {};
  uint8_t* page_byte = page_bytes;
  QuantizeJob good;
  good.page = page_byte;
  good.rows = row;
  good.row0 = 0;
  good.n = 32;
  EXPECT_TRUE(ValidateQuantizeJobs(side, {good}).ok());
  QuantizeJob partial = good;
  partial.n = 8;
  absl::Status st = ValidateQuantizeJobs(side, {good, partial});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "job 1: row0 0 and n 8 must be multiples of the block (32 rows)");
  QuantizeJob outside = good;
  outside.row0 = 32;
  st = ValidateQuantizeJobs(side, {outside});
  EXPECT_EQ(st.message(), "job 0: rows [32, 64) must be a non-empty range inside the page's 32 rows");
  QuantizeJob misaligned = good;
  misaligned.rows = row + 1;
  EXPECT_EQ(ValidateQuantizeJobs(side, {misaligned}).message(),
            "job 0: rows must be 16-byte aligned (the kernels load 16 bytes)");
  misaligned = good;
  misaligned.page = page_byte + 8;
  EXPECT_EQ(ValidateQuantizeJobs(side, {misaligned}).message(),
            "job 0: page must be 16-byte aligned (the kernels load 16 bytes)");
  QuantizeJob no_rows = good;
  no_rows.rows = nullptr;
  EXPECT_EQ(ValidateQuantizeJobs(side, {no_rows}).message(), "job 0: rows is null");
  const QuantSpec nuq = *QuantSpec::Parse("kivi2:nuq");
  const PageLayout LN = *PageLayout::Make(nuq, 64);
  EXPECT_EQ(ValidateQuantizeJobs(DeviceQuantSideOf(nuq, LN, Side::kValue), {good}).message(),
            "job 0: extras.levels is null for nuq");
  const QuantSpec fp8 = *QuantSpec::Parse("fp8_e4m3");
  const PageLayout LF = *PageLayout::Make(fp8, 64);
  DequantizeJob read;
  read.page = page_byte;
  read.out = row;
  read.n = 1;
  read.extras.fp8_scale = 0.0f;
  EXPECT_EQ(ValidateDequantizeJobs(DeviceQuantSideOf(fp8, LF, Side::kKey), {read}).message(),
            "job 0: extras.fp8_scale must be finite and > 0, got 0");
  read.extras.fp8_scale = 1.0f;
  read.out_stride = 10;
  EXPECT_EQ(ValidateDequantizeJobs(DeviceQuantSideOf(fp8, LF, Side::kKey), {read}).message(),
            "job 0: out_stride 10 is below head_dim 64");
}

// The kernels are compiled for head_dim 64, 96, 128 and 256 (a template
// parameter); any other head_dim is refused, naming the field and the
// choices, before anything is enqueued. Runs on the host, no device.
TEST(CudaQuantizeJobsTest, HeadDimsTheKernelsAreNotCompiledForAreRefused) {
  const QuantSpec spec = *QuantSpec::Parse("kivi4:g16");  // Groups that divide every head_dim.
  for (int d : {64, 96, 128, 256}) {
    absl::StatusOr<PageLayout> L = PageLayout::Make(spec, d);
    ASSERT_TRUE(L.ok()) << L.status();
    const DeviceQuantSide side = DeviceQuantSideOf(spec, *L, Side::kKey);
    EXPECT_TRUE(ValidateQuantizeJobs(side, {}).ok()) << d;
    EXPECT_TRUE(ValidateDequantizeJobs(side, {}).ok()) << d;
  }
  for (int d : {16, 32, 48, 80, 112, 160, 240}) {
    SCOPED_TRACE(d);
    absl::StatusOr<PageLayout> L = PageLayout::Make(spec, d);
    ASSERT_TRUE(L.ok()) << L.status();
    const DeviceQuantSide side = DeviceQuantSideOf(spec, *L, Side::kKey);
    const std::string want =
        absl::StrCat("layout.head_dim must be one of 64, 96, 128, 256, got ", d);
    for (const absl::Status& st :
         {ValidateQuantizeJobs(side, {}), ValidateDequantizeJobs(side, {}),
          LaunchQuantizeRows(side, DeviceRowType::kFloat32, {}, nullptr),
          LaunchDequantizeRows(side, DeviceRowType::kFloat16, {}, nullptr)}) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(st.message(), want);
    }
  }
}

}  // namespace
}  // namespace kvq
