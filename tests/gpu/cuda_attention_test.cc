// The fused decode attention kernels (kernels/cuda/cuda_attention.h) on a
// device against the host: for every scheme of the typed suites, results
// close to the reference backend's on the same pages and within the error
// contract (kernels/backend.h) against attention over the original K/V;
// several tasks, causal rows and sub-ranges in one launch; 32k-token
// contexts split into 128 partials and merged, at GQA 1, 4 and 8. Skips,
// saying why, without a device.
#include "kernels/cuda/cuda_attention.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/hd/attention_hd.h"
#include "kernels/cuda/device_info.h"
#include "kernels/cuda/stream_view_host.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"
#include "tests/gpu/device_buffer.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::DeviceBuffer;
using testutil::Upload;

// A KvStream's pages, fp16 rows, levels and rotation copied to the device,
// and the DeviceStreamView over them (what the service's device residency
// builds for pages that live in the device pool).
struct DeviceStream {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  DeviceStreamView view;
  bool failed = false;  // An allocation or copy failed.

  const void* Keep(std::unique_ptr<DeviceBuffer> b) {
    if (b == nullptr) {
      failed = true;
      return nullptr;
    }
    buffers.push_back(std::move(b));
    return buffers.back()->ptr;
  }
};

bool MakeDeviceStream(const KvStream& s, DeviceStream* out) {
  DeviceStreamView& v = out->view;
  v = ViewWithoutPointers(s);
  const PageLayout& L = s.layout();
  const int d = s.head_dim();
  const int pages = s.PagesFor(s.quantized_tokens());
  std::vector<uint8_t> bytes(static_cast<size_t>(pages) * L.page_bytes);
  for (int p = 0; p < pages; ++p) std::copy_n(s.page(p), L.page_bytes, &bytes[p * L.page_bytes]);
  const uint8_t* base = static_cast<const uint8_t*>(out->Keep(Upload(bytes)));
  if (base == nullptr) return false;
  std::vector<const uint8_t*> pointers(std::max(pages, 1));
  for (int p = 0; p < pages; ++p) pointers[p] = base + static_cast<size_t>(p) * L.page_bytes;
  v.pages = static_cast<const uint8_t* const*>(out->Keep(Upload(pointers)));
  auto rows = [&](const uint16_t* first, int n) {
    return static_cast<const uint16_t*>(out->Keep(Upload(first, static_cast<size_t>(n) * d * 2)));
  };
  v.sink_k = rows(s.sink_row(Side::kKey, 0), v.sink_tokens);
  v.sink_v = rows(s.sink_row(Side::kValue, 0), v.sink_tokens);
  v.tail_k = rows(s.tail_row(Side::kKey, 0), v.tail_tokens);
  v.tail_v = rows(s.tail_row(Side::kValue, 0), v.tail_tokens);
  for (Side side : {Side::kKey, Side::kValue}) {
    const std::vector<float> levels = LevelsAsFloats(s, side);
    if (levels.empty()) continue;
    hd::SideExtras& e = side == Side::kKey ? v.key_extras : v.value_extras;
    e.levels = static_cast<const float*>(out->Keep(Upload(levels)));
  }
  if (s.rotation()) {
    v.rotation_signs = static_cast<const float*>(out->Keep(Upload(s.rotation()->signs())));
  }
  return !out->failed;
}

// One task's host buffers (AttentionTask addressing).
struct HostTask {
  int begin = 0, end = 0, num_queries = 1;
  std::vector<float> q, out, lse;
  std::vector<int32_t> positions;

  // Poisoned outputs: the kernels must overwrite every element.
  HostTask(int b, int e, int nq, int group, int d, uint64_t seed)
      : begin(b), end(e), num_queries(nq),
        q(testutil::MakeGaussian(static_cast<size_t>(nq) * group * d, seed)),
        out(q.size(), 7.0f), lse(static_cast<size_t>(nq) * group, 7.0f) {}
};

// Runs `tasks` on the device over `s` (one launch) into each task's out/lse.
void RunOnDevice(const KvStream& s, int group, std::vector<HostTask>& tasks) {
  DeviceStream ds;
  ASSERT_TRUE(MakeDeviceStream(s, &ds)) << "copying the stream to the device";
  const int d = s.head_dim();
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  std::vector<DeviceAttentionTask> device_tasks;
  DecodeAttentionShape shape;
  shape.num_tasks = static_cast<int>(tasks.size());
  shape.head_dim = d;
  shape.group_size = group;
  shape.softmax_scale = 1.0f / std::sqrt(static_cast<float>(d));
  shape.tensor_cores = UseTensorCores(s.layout());
  const absl::StatusOr<DeviceInfo> info = QueryCudaDevice(0);
  ASSERT_TRUE(info.ok()) << info.status();
  shape.sm_count = info->multiprocessors;
  shape.max_page_tokens = s.layout().page_tokens;
  shape.max_page_bytes = static_cast<int>(s.layout().page_bytes);
  // A device copy of `v`, kept until the end of the run; null on failure.
  auto copy = [&keep](const auto& v) {
    keep.push_back(Upload(v));
    return keep.back() ? keep.back()->ptr : nullptr;
  };
  for (HostTask& h : tasks) {
    DeviceAttentionTask t;
    t.stream = ds.view;
    t.key_begin = h.begin;
    t.key_end = h.end;
    t.num_queries = h.num_queries;
    t.q = static_cast<const float*>(copy(h.q));
    t.q_stride = group * d;
    if (!h.positions.empty()) t.q_positions = static_cast<const int32_t*>(copy(h.positions));
    t.out = static_cast<float*>(copy(h.out));
    t.out_stride = group * d;
    t.lse = static_cast<float*>(copy(h.lse));
    t.lse_stride = group;
    for (const auto& b : keep) ASSERT_NE(b, nullptr) << "device allocation";
    device_tasks.push_back(t);
    shape.max_rows = std::max(shape.max_rows, h.num_queries * group);
    shape.max_keys = std::max(shape.max_keys, h.end - h.begin);
  }
  std::unique_ptr<DeviceBuffer> dtasks = Upload(device_tasks);
  ASSERT_NE(dtasks, nullptr);
  const size_t ws_bytes = DecodeAttentionWorkspaceBytes(shape);
  DeviceBuffer workspace(ws_bytes);
  ASSERT_NE(workspace.ptr, nullptr);
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreate(&stream));
  const absl::Status st = LaunchDecodeAttention(dtasks->as<DeviceAttentionTask>(), shape,
                                                workspace.ptr, ws_bytes, stream);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_CUDA(cudaStreamDestroy(stream));
  for (size_t i = 0; i < tasks.size(); ++i) {
    ASSERT_CUDA(cudaMemcpy(tasks[i].out.data(), device_tasks[i].out, tasks[i].out.size() * 4,
                           cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(tasks[i].lse.data(), device_tasks[i].lse, tasks[i].lse.size() * 4,
                           cudaMemcpyDeviceToHost));
  }
}

// The same task on a host backend.
AttentionTask HostAttentionTask(const KvStream& s, int group, HostTask& h, std::vector<float>* out,
                                std::vector<float>* lse) {
  out->assign(h.out.size(), 0.0f);
  lse->assign(h.lse.size(), 0.0f);
  AttentionTask t;
  t.stream = &s;
  t.key_begin = h.begin;
  t.key_end = h.end;
  t.num_queries = h.num_queries;
  t.q = h.q.data();
  t.q_stride = group * s.head_dim();
  t.q_positions = h.positions.empty() ? nullptr : h.positions.data();
  t.out = out->data();
  t.out_stride = group * s.head_dim();
  t.lse = lse->data();
  t.lse_stride = group;
  return t;
}

double ValueRms(const std::vector<float>& v) {
  double sum = 0.0;
  for (float x : v) sum += static_cast<double>(x) * x;
  return std::sqrt(sum / std::max<size_t>(v.size(), 1));
}

// Worst output error (relative, floored at `floor`) and |lse| error of
// `got` against fp64 attention over keys/values, for each row of `h`.
struct Errors {
  double out = 0.0, lse = 0.0;
};
Errors ErrorsAgainst(const HostTask& h, int group, int d, const std::vector<float>& out,
                     const std::vector<float>& lse, const std::vector<float>& keys,
                     const std::vector<float>& values, double floor) {
  Errors e;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int i = 0; i < h.num_queries; ++i) {
    const int end = h.positions.empty() ? h.end : std::min(h.end, h.positions[i] + 1);
    for (int g = 0; g < group; ++g) {
      const size_t r = static_cast<size_t>(i) * group + g;
      const testutil::Attention64 truth = testutil::ReferenceAttention(
          &h.q[r * d], keys.data(), values.data(), h.begin, end, d, scale);
      e.out = std::max(e.out, testutil::RelativeError(&out[r * d], truth.out, floor));
      const double le = std::isinf(truth.lse) ? (lse[r] == truth.lse ? 0.0 : INFINITY)
                                              : std::fabs(lse[r] - truth.lse);
      e.lse = std::max(e.lse, le);
    }
  }
  return e;
}

class CudaAttentionTest : public ::testing::TestWithParam<testutil::SchemeCase> {};

// Every scheme: three tasks in one launch (every key; a causal chunk; a
// sub-range from mid-page), against the reference on the same pages and
// against the original K/V under the contract.
TEST_P(CudaAttentionTest, MatchesReferenceWithinContract) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the attention kernels are not run";
  const StreamConfig config = GetParam().Config();
  const int d = config.head_dim;
  const QuantSpec& spec = config.spec;
  const int n = spec.is_kivi() ? std::max(spec.sink + 3 * spec.flush_tokens() + 7, 600) : 600;
  const std::vector<float> k = testutil::MakeKeys(n, d, 41), v = testutil::MakeValues(n, d, 41);
  std::unique_ptr<KvStream> s = testutil::MakeStream({"ref", GetParam()});
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(testutil::AppendRows(*s, k, v, 0, n).ok());
  for (int group : {1, 4, 8, 32}) {
    SCOPED_TRACE(absl::StrCat("GQA ", group));
    std::vector<HostTask> tasks;
    tasks.emplace_back(0, n, 2, group, d, 100 + group);
    tasks.emplace_back(0, n, 4, group, d, 200 + group);
    tasks.back().positions = {3, n / 2, n - 2, n - 1};
    tasks.emplace_back(s->page_base() + 5, n - 3, 1, group, d, 300 + group);
    RunOnDevice(*s, group, tasks);

    std::vector<float> keys = k;  // Original keys, post-RoPE.
    if (s->rope()) {
      for (int t = 0; t < n; ++t) s->rope()->Apply(&keys[static_cast<size_t>(t) * d], t);
    }
    const std::vector<float> kd = testutil::ReadSide(*s, Side::kKey, 0, n, true);
    const std::vector<float> vd = testutil::ReadSide(*s, Side::kValue, 0, n, true);
    const double floor = ValueRms(v);
    // fp16 tensor-core operands (queries, keys, values, probabilities) add
    // about 2^-11 relative per operand; fp32 paths sum in another order.
    const double own_tol = UseTensorCores(s->layout()) ? 1e-2 : 1e-4;
    for (size_t i = 0; i < tasks.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("task ", i));
      HostTask& h = tasks[i];
      std::vector<float> ref_out, ref_lse;
      const AttentionTask rt = HostAttentionTask(*s, group, h, &ref_out, &ref_lse);
      AttentionOptions options;
      options.group_size = group;
      ASSERT_TRUE(RefBackend().Attend({&rt, 1}, options).ok());
      const Errors own = ErrorsAgainst(h, group, d, h.out, h.lse, kd, vd, ValueRms(vd));
      EXPECT_LE(own.out, own_tol) << "against the stream's own dequantized K/V";
      EXPECT_LE(own.lse, 10 * own_tol);
      const Errors got = ErrorsAgainst(h, group, d, h.out, h.lse, keys, v, floor);
      const Errors ref = ErrorsAgainst(h, group, d, ref_out, ref_lse, keys, v, floor);
      EXPECT_LE(got.out, 1.10 * ref.out + 1e-5) << "contract, output (ref " << ref.out << ")";
      EXPECT_LE(got.lse, 1.10 * ref.lse + 1e-5) << "contract, lse (ref " << ref.lse << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllSchemes, CudaAttentionTest,
                         ::testing::ValuesIn(testutil::AllSchemeCases()),
                         [](const ::testing::TestParamInfo<testutil::SchemeCase>& info) {
                           return info.param.Label();
                         });

// 32k keys: 128 splits merged by the second kernel, at GQA 1, 4 and 8,
// against the cpu backend (itself within the reference's tolerances) and
// under the contract against the original K/V.
TEST(CudaAttentionLongContextTest, SplitAndMergedAt32k) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the attention kernels are not run";
  constexpr int n = 32768;
  for (const char* scheme : {"fp16", "kivi4", "kivi2:pre_rope"}) {
    SCOPED_TRACE(scheme);
    testutil::SchemeCase sc{scheme, 128, {}, ""};
    const std::vector<float> k = testutil::MakeKeys(n, 128, 51), v = testutil::MakeValues(n, 128, 51);
    std::unique_ptr<KvStream> s = testutil::MakeStream({"cpu", sc});
    ASSERT_NE(s, nullptr);
    ASSERT_TRUE(testutil::AppendRows(*s, k, v, 0, n).ok());
    std::vector<float> keys = k;
    if (s->rope()) {
      for (int t = 0; t < n; ++t) s->rope()->Apply(&keys[static_cast<size_t>(t) * 128], t);
    }
    for (int group : {1, 4, 8}) {
      SCOPED_TRACE(absl::StrCat("GQA ", group));
      std::vector<HostTask> tasks;
      tasks.emplace_back(0, n, 1, group, 128, 600 + group);
      RunOnDevice(*s, group, tasks);
      std::vector<float> ref_out, ref_lse;
      const AttentionTask rt = HostAttentionTask(*s, group, tasks[0], &ref_out, &ref_lse);
      AttentionOptions options;
      options.group_size = group;
      ASSERT_TRUE(CpuBackend().Attend({&rt, 1}, options).ok());
      const double floor = ValueRms(v);
      const Errors got = ErrorsAgainst(tasks[0], group, 128, tasks[0].out, tasks[0].lse, keys, v, floor);
      const Errors ref = ErrorsAgainst(tasks[0], group, 128, ref_out, ref_lse, keys, v, floor);
      EXPECT_LE(got.out, 1.10 * ref.out + 1e-5) << "output (cpu " << ref.out << ")";
      EXPECT_LE(got.lse, 1.10 * ref.lse + 1e-5) << "lse (cpu " << ref.lse << ")";
    }
  }
}

// Shapes the kernels do not take fail before anything is enqueued (no
// device needed: this runs wherever the CUDA backend builds).
TEST(CudaAttentionShapeTest, RejectsShapesOutsideTheKernelsLimits) {
  DecodeAttentionShape shape;
  shape.num_tasks = 1;
  shape.head_dim = 128;
  shape.group_size = 4;
  shape.softmax_scale = 0.1f;
  shape.max_rows = 4;
  shape.max_keys = 1000;
  shape.sm_count = 132;
  shape.max_page_tokens = 32;
  shape.max_page_bytes = 4096;
  alignas(16) float dummy[4] = {};
  auto launch = [&](const DecodeAttentionShape& s, size_t ws) {
    return LaunchDecodeAttention(nullptr, s, dummy, ws, nullptr);
  };
  // One task of one row tile wants 264 blocks: splits of the 256-key
  // minimum, the first from the page start before key_begin.
  EXPECT_EQ(DecodeAttentionSplitTokens(shape), 256);
  EXPECT_EQ(DecodeAttentionSplits(shape), 5);
  const size_t ws = DecodeAttentionWorkspaceBytes(shape);
  EXPECT_EQ(ws, size_t{1} * 5 * 4 * 129 * 4) << "5 splits x 4 rows x (128 + 1) floats";
  for (int d : {8, 32, 80, 160, 264}) {
    DecodeAttentionShape bad = shape;
    bad.head_dim = d;
    const absl::Status st = launch(bad, ws);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(), absl::StrCat("head_dim must be one of 64, 96, 128, 256, got ", d));
  }
  for (int d : {64, 96, 128, 256}) EXPECT_TRUE(DecodeAttentionTakesHeadDim(d)) << d;
  DecodeAttentionShape bad = shape;
  bad.group_size = 65;
  EXPECT_EQ(launch(bad, ws).message(), "group_size must be in [1, 64], got 65");
  bad = shape;
  bad.sm_count = 0;
  EXPECT_EQ(launch(bad, ws).message(),
            "sm_count (0) and max_page_tokens (32) must be >= 1 and max_page_bytes (4096) a "
            "non-negative multiple of 16");
  bad = shape;
  bad.max_page_bytes = 4100;
  EXPECT_EQ(launch(bad, ws).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(launch(shape, ws - 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(launch(shape, ws - 1).message(),
            absl::StrCat("workspace must hold ", ws, " bytes, got ", ws - 1));
}

// Splits fill the device: a lone long task is cut into many splits, a
// batch that already has two blocks per SM into as few as the page-start
// rule allows, and never more than the merge kernel takes.
TEST(CudaAttentionShapeTest, SplitsSizedFromTheBatchAndTheSmCount) {
  DecodeAttentionShape shape;
  shape.head_dim = 128;
  shape.sm_count = 132;
  shape.max_page_tokens = 32;
  shape.max_keys = 32768;
  shape.num_tasks = 1;
  shape.max_rows = 8;
  EXPECT_EQ(DecodeAttentionSplitTokens(shape), 256);
  EXPECT_EQ(DecodeAttentionSplits(shape), 129);
  shape.num_tasks = 512;
  EXPECT_EQ(DecodeAttentionSplitTokens(shape), 32768);
  EXPECT_EQ(DecodeAttentionSplits(shape), 2);
  shape.num_tasks = 33;  // 33 blocks: 8 splits each reach 264.
  EXPECT_EQ(DecodeAttentionSplitTokens(shape), 4096);
  shape.num_tasks = 1;
  shape.max_keys = 1 << 22;
  EXPECT_LE(DecodeAttentionSplits(shape), 1024);
  EXPECT_EQ(DecodeAttentionSplitTokens(shape) % 32, 0);
}

}  // namespace
}  // namespace kvq
