// The CUDA backend: KvStreams whose pages live in a DevicePagePool
// (kernels/cuda/device_page_pool.h), quantized, read and attended over by
// the kernels of cuda_quantize.cu and cuda_attention.cu.
//
// Each calling thread enqueues on its own per-thread default stream
// (cudaStreamPerThread), so concurrent RPCs overlap on the device and one
// thread's work is ordered without locks. What a call sends to the device
// (rows to quantize, block tables, the fp16 sink and tail, queries) is
// packed into one host buffer and crosses in one copy into device scratch
// that the thread reuses across calls; results come back in one copy.
// Quantize calls only enqueue: the first error of a thread is kept until
// Synchronize(), which KvStream calls before an append or a read returns
// (kernels/backend.h), so a device error fails that call and the append is
// undone. Reads and Attend wait for their results, which the host needs.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/crq_transform.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/crq_device_statistics.h"
#include "kernels/cuda/cuda_crq.h"
#include "kernels/cuda/cuda_quantize.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_info.h"
#include "kernels/cuda/kernel_timing.h"
#include "kernels/cuda/launch_timer.h"
#include "kernels/cuda/stream_view_host.h"
#include "kernels/kv_stream.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

const cudaStream_t kStream = cudaStreamPerThread;

// Device memory one thread reuses across calls; it only grows.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  absl::StatusOr<uint8_t*> Get(size_t bytes) {
    if (bytes <= capacity_) return ptr_;
    // Work this thread queued may still read the old buffer.
    KVQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(kStream), "cudaStreamSynchronize");
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    const size_t want = std::max(bytes, 2 * capacity_);
    capacity_ = 0;
    void* p = nullptr;
    KVQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, want), "cudaMalloc (device scratch)");
    ptr_ = static_cast<uint8_t*>(p);
    capacity_ = want;
    return ptr_;
  }

 private:
  uint8_t* ptr_ = nullptr;
  size_t capacity_ = 0;
};

// Bytes bound for the device, each piece at an aligned offset of one
// buffer, and room reserved after them that is not uploaded (outputs,
// workspace).
class Staging {
 public:
  static constexpr size_t kAlign = 256;

  size_t Add(const void* data, size_t bytes) {
    const size_t at = Align(host_.size());
    host_.resize(at + bytes);
    if (bytes > 0) std::memcpy(host_.data() + at, data, bytes);
    return at;
  }
  template <class T>
  size_t Add(const std::vector<T>& v) {
    return Add(v.data(), v.size() * sizeof(T));
  }
  // Room after every Add(); call once all data is added.
  size_t Reserve(size_t bytes) {
    const size_t at = Align(host_.size() + reserved_);
    reserved_ = at + bytes - host_.size();
    return at;
  }
  uint8_t* host_at(size_t offset) { return host_.data() + offset; }
  size_t upload_bytes() const { return host_.size(); }
  size_t total_bytes() const { return host_.size() + reserved_; }
  const uint8_t* host() const { return host_.data(); }

 private:
  static size_t Align(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
  std::vector<uint8_t> host_;
  size_t reserved_ = 0;
};

thread_local Scratch t_scratch;
// The first device error since this thread's last Synchronize().
thread_local absl::Status t_error;

void Record(const absl::Status& st) {
  if (!st.ok() && t_error.ok()) t_error = st;
}

absl::Status CheckDevicePages(const KvStream& s) {
  if (s.allocator() == nullptr || s.allocator()->host_accessible()) {
    return absl::FailedPreconditionError(
        "the cuda backend serves streams whose pages live in device memory (a DevicePagePool); "
        "this stream's pages are host memory");
  }
  // The kernels read pages in 16-byte loads (DevicePagePool slots start on
  // kPageAlign); the layout must keep every section on that grid.
  return s.layout().CheckVectorLoads();
}

// The device's SM count, queried once: the attention splits fill it.
absl::StatusOr<int> MultiprocessorCount() {
  static std::atomic<int> cached{0};
  if (const int n = cached.load(std::memory_order_relaxed); n > 0) return n;
  int device = 0, n = 0;
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  KVQ_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
                           "cudaDeviceGetAttribute(MultiProcessorCount)");
  cached.store(n, std::memory_order_relaxed);
  return n;
}

// Copies `staging`'s data to the front of this thread's scratch, which
// holds staging.total_bytes(); returns the scratch's device address.
absl::StatusOr<uint8_t*> Upload(const Staging& staging) {
  KVQ_ASSIGN_OR_RETURN(uint8_t * base, t_scratch.Get(staging.total_bytes()));
  if (staging.upload_bytes() > 0) {
    KVQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(base, staging.host(), staging.upload_bytes(),
                                             cudaMemcpyHostToDevice, kStream),
                             "cudaMemcpyAsync (to the device)");
  }
  return base;
}

// One side's nuq levels on their way to the device: added to the staging
// buffer, then, once its device address is known, the side's extras.
class StagedLevels {
 public:
  StagedLevels(const KvStream& s, Side side, Staging& staging) : s_(s), side_(side) {
    const std::vector<float> levels = LevelsAsFloats(s, side);
    has_levels_ = !levels.empty();
    at_ = staging.Add(levels);
  }
  hd::SideExtras ExtrasAt(const uint8_t* base) const {
    return ExtrasFor(s_, side_, has_levels_ ? reinterpret_cast<const float*>(base + at_) : nullptr);
  }

 private:
  const KvStream& s_;
  Side side_;
  bool has_levels_ = false;
  size_t at_ = 0;
};

// crq's Lloyd-Max codebooks ride in the call's upload (212 bytes).
size_t AddCodebooks(Staging& staging) {
  return staging.Add(&CrqCodebooks(), sizeof(hd::CrqCodebooks));
}
const hd::CrqCodebooks* CodebooksAt(const uint8_t* base, size_t at) {
  return reinterpret_cast<const hd::CrqCodebooks*>(base + at);
}

absl::Status QuantizeOnDevice(const KvStream& s, Side side, const void* rows, size_t row_bytes,
                              DeviceRowType type, int n, uint8_t* page, int row0) {
  KVQ_RETURN_IF_ERROR(CheckDevicePages(s));
  Staging staging;
  const size_t rows_at = staging.Add(rows, static_cast<size_t>(n) * s.head_dim() * row_bytes);
  const StagedLevels levels(s, side, staging);
  const size_t codebooks_at = s.crq() != nullptr ? AddCodebooks(staging) : 0;
  KVQ_ASSIGN_OR_RETURN(uint8_t * base, Upload(staging));
  QuantizeJob job;
  job.page = page;
  job.rows = base + rows_at;
  job.extras = levels.ExtrasAt(base);
  job.row0 = row0;
  job.n = n;
  const DeviceQuantSide quant_side = DeviceQuantSideOf(s.spec(), s.layout(), side);
  if (s.crq() != nullptr) {
    // Rows arrive as coded coordinates (KvStream ran CrqTransform::Forward).
    return LaunchCrqQuantizeRows(quant_side, CodebooksAt(base, codebooks_at), {&job, 1}, kStream);
  }
  return LaunchQuantizeRows(quant_side, type, {&job, 1}, kStream);
}

absl::Status DequantizeOnDevice(const KvStream& s, Side side, const uint8_t* page, int row0,
                                int n, DeviceRowType type, size_t row_bytes, void* out,
                                size_t out_stride) {
  KVQ_RETURN_IF_ERROR(CheckDevicePages(s));
  const int d = s.head_dim();
  Staging staging;
  const StagedLevels levels(s, side, staging);
  const size_t codebooks_at = s.crq() != nullptr ? AddCodebooks(staging) : 0;
  const size_t out_at = staging.Reserve(static_cast<size_t>(n) * d * row_bytes);
  KVQ_ASSIGN_OR_RETURN(uint8_t * base, Upload(staging));
  DequantizeJob job;
  job.page = page;
  job.out = base + out_at;
  job.extras = levels.ExtrasAt(base);
  job.row0 = row0;
  job.n = n;
  const DeviceQuantSide quant_side = DeviceQuantSideOf(s.spec(), s.layout(), side);
  KVQ_RETURN_IF_ERROR(
      s.crq() != nullptr
          ? LaunchCrqDequantizeRows(quant_side, type, CodebooksAt(base, codebooks_at), {&job, 1},
                                    kStream)
          : LaunchDequantizeRows(quant_side, type, {&job, 1}, kStream));
  // The caller reads `out` when this returns.
  KVQ_CUDA_RETURN_IF_ERROR(
      cudaMemcpy2DAsync(out, out_stride * row_bytes, base + out_at, d * row_bytes, d * row_bytes,
                        n, cudaMemcpyDeviceToHost, kStream),
      "cudaMemcpy2DAsync (rows to the host)");
  KVQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(kStream), "cudaStreamSynchronize");
  return absl::OkStatus();
}

// Where one task's pieces lie in the staging buffer.
struct TaskOffsets {
  size_t pages = 0, sink_k = 0, sink_v = 0, tail_k = 0, tail_v = 0;
  size_t signs = 0, q = 0, positions = 0;
  size_t qr = 0;  // crq: the rows' H (s_k q).
  const float* crq_statistics = nullptr;  // crq: device, CrqDeviceStatistics.
  size_t out = 0, lse = 0;
  bool has_positions = false;
  int key_end = 0;
  int rows = 0;
};

// Kernel-only timing of an attention launch (TimeDeviceAttention): the
// launch repeated between CUDA events once its inputs are on the device.
struct LaunchTiming {
  int warmup = 0;
  int reps = 0;
  std::vector<double> ms;
};

// One launch: tasks of one head_dim and one kernel kind (crq, tensor cores
// or neither); timed when `timing` is set.
absl::Status AttendLaunch(absl::Span<const AttentionTask> all, const std::vector<int>& which,
                          const AttentionOptions& options, LaunchTiming* timing = nullptr) {
  const int group = options.group_size;
  const int d = all[which.front()].stream->head_dim();
  const bool crq = all[which.front()].stream->crq() != nullptr;
  Staging staging;
  // The task array first: its device address is the scratch's.
  const size_t task_bytes = crq ? sizeof(DeviceCrqTask) : sizeof(DeviceAttentionTask);
  const size_t tasks_at = staging.Add(std::vector<uint8_t>(which.size() * task_bytes));
  const size_t codebooks_at = crq ? AddCodebooks(staging) : 0;
  std::vector<TaskOffsets> at(which.size());
  std::vector<StagedLevels> levels;  // Key then value of each task.
  levels.reserve(2 * which.size());
  DecodeAttentionShape shape;
  shape.num_tasks = static_cast<int>(which.size());
  shape.head_dim = d;
  shape.group_size = group;
  shape.softmax_scale = SoftmaxScale(options, d);
  shape.tensor_cores = !crq && UseTensorCores(all[which.front()].stream->layout());
  KVQ_ASSIGN_OR_RETURN(shape.sm_count, MultiprocessorCount());
  for (size_t i = 0; i < which.size(); ++i) {
    const AttentionTask& t = all[which[i]];
    const KvStream& s = *t.stream;
    KVQ_RETURN_IF_ERROR(CheckDevicePages(s));
    TaskOffsets& o = at[i];
    std::vector<const uint8_t*> pages(s.PagesFor(s.quantized_tokens()));
    for (size_t p = 0; p < pages.size(); ++p) pages[p] = s.page(static_cast<int>(p));
    o.pages = staging.Add(pages);
    const size_t row_bytes = static_cast<size_t>(d) * 2;
    o.sink_k = staging.Add(s.sink_row(Side::kKey, 0), s.sink_tokens() * row_bytes);
    o.sink_v = staging.Add(s.sink_row(Side::kValue, 0), s.sink_tokens() * row_bytes);
    o.tail_k = staging.Add(s.tail_row(Side::kKey, 0), s.tail_tokens() * row_bytes);
    o.tail_v = staging.Add(s.tail_row(Side::kValue, 0), s.tail_tokens() * row_bytes);
    levels.emplace_back(s, Side::kKey, staging);  // levels[2 * i]
    levels.emplace_back(s, Side::kValue, staging);
    if (s.rotation()) o.signs = staging.Add(s.rotation()->signs());
    // Queries compacted to [query][group][d]; outputs come back the same way.
    o.rows = t.num_queries * group;
    std::vector<float> q(static_cast<size_t>(o.rows) * d);
    for (int qi = 0; qi < t.num_queries; ++qi) {
      std::copy_n(t.q + static_cast<size_t>(qi) * t.q_stride, static_cast<size_t>(group) * d,
                  q.begin() + static_cast<size_t>(qi) * group * d);
    }
    if (crq) {
      // Each row transformed once (CrqTransform::AttentionQuery): the
      // softmax scale is folded into q.
      std::vector<float> qr(q.size());
      for (int r = 0; r < o.rows; ++r) {
        const size_t at = static_cast<size_t>(r) * d;
        s.crq()->AttentionQuery(q.data() + at, shape.softmax_scale, q.data() + at, qr.data() + at);
      }
      o.qr = staging.Add(qr);
      KVQ_ASSIGN_OR_RETURN(o.crq_statistics, CrqDeviceStatistics::Get().For(*s.crq(), kStream));
    }
    o.q = staging.Add(q);
    o.has_positions = t.q_positions != nullptr;
    if (o.has_positions) o.positions = staging.Add(t.q_positions, t.num_queries * sizeof(int32_t));
    o.key_end = t.key_end == -1 ? s.num_tokens() : t.key_end;
    shape.max_rows = std::max(shape.max_rows, o.rows);
    shape.max_keys = std::max(shape.max_keys, o.key_end - t.key_begin);
    shape.max_page_tokens = std::max(shape.max_page_tokens, s.layout().page_tokens);
    shape.max_page_bytes = std::max(shape.max_page_bytes, static_cast<int>(s.layout().page_bytes));
  }
  // Outputs, then the workspace: reserved, not uploaded.
  size_t out_begin = 0, out_end = 0;
  for (size_t i = 0; i < which.size(); ++i) {
    at[i].out = staging.Reserve(static_cast<size_t>(at[i].rows) * d * sizeof(float));
    at[i].lse = staging.Reserve(static_cast<size_t>(at[i].rows) * sizeof(float));
    if (i == 0) out_begin = at[i].out;
    out_end = at[i].lse + static_cast<size_t>(at[i].rows) * sizeof(float);
  }
  const size_t workspace_bytes = DecodeAttentionWorkspaceBytes(shape);
  const size_t workspace_at = staging.Reserve(workspace_bytes);
  KVQ_ASSIGN_OR_RETURN(uint8_t * base, t_scratch.Get(staging.total_bytes()));
  // Now that the device address is known, the task array can be written.
  uint8_t* tasks = staging.host_at(tasks_at);
  for (size_t i = 0; i < which.size(); ++i) {
    const AttentionTask& t = all[which[i]];
    const KvStream& s = *t.stream;
    const TaskOffsets& o = at[i];
    DeviceAttentionTask dt;
    dt.stream = ViewWithoutPointers(s);
    DeviceStreamView& v = dt.stream;
    v.pages = reinterpret_cast<const uint8_t* const*>(base + o.pages);
    v.sink_k = reinterpret_cast<const uint16_t*>(base + o.sink_k);
    v.sink_v = reinterpret_cast<const uint16_t*>(base + o.sink_v);
    v.tail_k = reinterpret_cast<const uint16_t*>(base + o.tail_k);
    v.tail_v = reinterpret_cast<const uint16_t*>(base + o.tail_v);
    v.key_extras = levels[2 * i].ExtrasAt(base);
    v.value_extras = levels[2 * i + 1].ExtrasAt(base);
    if (s.rotation()) v.rotation_signs = reinterpret_cast<const float*>(base + o.signs);
    dt.key_begin = t.key_begin;
    dt.key_end = o.key_end;
    dt.num_queries = t.num_queries;
    dt.q = reinterpret_cast<const float*>(base + o.q);
    dt.q_stride = group * d;
    dt.q_positions =
        o.has_positions ? reinterpret_cast<const int32_t*>(base + o.positions) : nullptr;
    dt.out = reinterpret_cast<float*>(base + o.out);
    dt.out_stride = group * d;
    dt.lse = reinterpret_cast<float*>(base + o.lse);
    dt.lse_stride = group;
    if (crq) {
      DeviceCrqTask ct;
      ct.task = dt;
      ct.qr = reinterpret_cast<const float*>(base + o.qr);
      ct.calibration = o.crq_statistics;
      std::memcpy(tasks + i * task_bytes, &ct, sizeof(ct));
    } else {
      std::memcpy(tasks + i * task_bytes, &dt, sizeof(dt));
    }
  }
  KVQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(base, staging.host(), staging.upload_bytes(),
                                           cudaMemcpyHostToDevice, kStream),
                           "cudaMemcpyAsync (attention inputs to the device)");
  auto launch = [&] {
    if (crq) {
      return LaunchCrqAttention(reinterpret_cast<const DeviceCrqTask*>(base), shape,
                                CodebooksAt(base, codebooks_at), base + workspace_at,
                                workspace_bytes, kStream);
    }
    return LaunchDecodeAttention(reinterpret_cast<const DeviceAttentionTask*>(base), shape,
                                 base + workspace_at, workspace_bytes, kStream);
  };
  if (timing == nullptr) {
    KVQ_RETURN_IF_ERROR(launch());
  } else {
    KVQ_ASSIGN_OR_RETURN(timing->ms, TimeLaunches(kStream, timing->warmup, timing->reps, launch));
  }
  std::vector<uint8_t> results(out_end - out_begin);
  KVQ_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(results.data(), base + out_begin, results.size(),
                                           cudaMemcpyDeviceToHost, kStream),
                           "cudaMemcpyAsync (attention results to the host)");
  KVQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(kStream), "cudaStreamSynchronize (attention)");
  for (size_t i = 0; i < which.size(); ++i) {
    const AttentionTask& t = all[which[i]];
    const float* out = reinterpret_cast<const float*>(results.data() + (at[i].out - out_begin));
    const float* lse = reinterpret_cast<const float*>(results.data() + (at[i].lse - out_begin));
    for (int qi = 0; qi < t.num_queries; ++qi) {
      std::copy_n(out + static_cast<size_t>(qi) * group * d, static_cast<size_t>(group) * d,
                  t.out + static_cast<size_t>(qi) * t.out_stride);
      std::copy_n(lse + static_cast<size_t>(qi) * group, group,
                  t.lse + static_cast<size_t>(qi) * t.lse_stride);
    }
  }
  return absl::OkStatus();
}

class CudaBackendImpl final : public KernelBackend {
 public:
  absl::string_view name() const override { return "cuda"; }

  bool enqueues() const override { return true; }

  void QuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                    int row0) const override {
    Record(QuantizeOnDevice(s, side, rows, sizeof(float), DeviceRowType::kFloat32, n, page, row0));
  }

  bool QuantizeRowsHalf(const KvStream& s, Side side, const uint16_t* rows, int n, uint8_t* page,
                        int row0) const override {
    if (s.crq() != nullptr) return false;  // crq codes float rows (coded coordinates).
    Record(QuantizeOnDevice(s, side, rows, sizeof(uint16_t), DeviceRowType::kFloat16, n, page,
                            row0));
    return true;
  }

  void DequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                      float* out) const override {
    Record(DequantizeOnDevice(s, side, page, row0, n, DeviceRowType::kFloat32, sizeof(float), out,
                              s.head_dim()));
  }

  bool DequantizeRowsHalf(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                          uint16_t* out, size_t stride) const override {
    if (s.crq() != nullptr) return false;  // KvStream reads crq rows as floats.
    Record(DequantizeOnDevice(s, side, page, row0, n, DeviceRowType::kFloat16, sizeof(uint16_t),
                              out, stride));
    return true;
  }

  absl::Status Synchronize() const override {
    Record(CudaStatus(cudaStreamSynchronize(kStream), "cudaStreamSynchronize"));
    absl::Status st = std::move(t_error);
    t_error = absl::OkStatus();
    return st;
  }

  absl::Status Attend(absl::Span<const AttentionTask> tasks,
                      const AttentionOptions& options) const override {
    KVQ_RETURN_IF_ERROR(ValidateAttention(tasks, options));
    for (const AttentionTask& t : tasks) {
      if (t.stream->crq() != nullptr && !CrqKernelTakesHeadDim(t.stream->head_dim())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the cuda backend's crq attention takes head_dim 64, 128 or 256; got ",
            t.stream->head_dim()));
      }
      if (!DecodeAttentionTakesHeadDim(t.stream->head_dim())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the cuda backend's attention takes head_dim 64, 96, 128 or 256; got ",
            t.stream->head_dim()));
      }
    }
    if (options.group_size > kMaxAttentionGroup) {
      return absl::InvalidArgumentError(
          absl::StrCat("the cuda backend's attention takes group_size up to ", kMaxAttentionGroup,
                       "; got ", options.group_size));
    }
    // One launch per head_dim and kernel kind (crq, tensor cores or not).
    std::map<std::tuple<int, bool, bool>, std::vector<int>> launches;
    for (size_t i = 0; i < tasks.size(); ++i) {
      const KvStream& s = *tasks[i].stream;
      launches[{s.head_dim(), s.crq() != nullptr, UseTensorCores(s.layout())}].push_back(
          static_cast<int>(i));
    }
    for (const auto& [kind, which] : launches) {
      if (absl::Status st = AttendLaunch(tasks, which, options); !st.ok()) return st;
    }
    return CheckAttentionResults(tasks, options);
  }
};

}  // namespace

absl::StatusOr<std::vector<double>> TimeDeviceAttention(absl::Span<const AttentionTask> tasks,
                                                        const AttentionOptions& options,
                                                        int warmup, int reps) {
  KVQ_RETURN_IF_ERROR(ValidateAttention(tasks, options));
  if (tasks.empty()) return absl::InvalidArgumentError("timed attention: no tasks");
  const KvStream& first = *tasks.front().stream;
  std::vector<int> which;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const KvStream& s = *tasks[i].stream;
    if (s.head_dim() != first.head_dim() || (s.crq() != nullptr) != (first.crq() != nullptr) ||
        UseTensorCores(s.layout()) != UseTensorCores(first.layout())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "timed attention: task ", i, " needs another launch than task 0 (head_dim ",
          s.head_dim(), " vs ", first.head_dim(), ", or another kernel kind)"));
    }
    which.push_back(static_cast<int>(i));
  }
  LaunchTiming timing{warmup, reps, {}};
  KVQ_RETURN_IF_ERROR(AttendLaunch(tasks, which, options, &timing));
  return std::move(timing.ms);
}

absl::StatusOr<const KernelBackend*> CudaBackend() {
  absl::StatusOr<DeviceInfo> info = QueryCudaDevice(0);
  if (!info.ok()) return info.status();
  static const CudaBackendImpl* backend = new CudaBackendImpl();
  return backend;
}

}  // namespace kvq
