// TimeLaunches and TimeDeviceQuantize; TimeDeviceAttention lives in
// cuda_backend.cc beside the staging it reuses.
#include "kernels/cuda/kernel_timing.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_quantize.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_timer.h"
#include "kernels/cuda/stream_view_host.h"
#include "kernels/numeric.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

// Device memory freed when the scope ends.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::Status Allocate(size_t bytes, const char* what) {
    return CudaStatus(cudaMalloc(&ptr_, bytes), what);
  }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

// CUDA events destroyed when the scope ends.
class Events {
 public:
  explicit Events(size_t n) : events_(n, nullptr) {}
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  ~Events() {
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  absl::Status Create() {
    for (cudaEvent_t& e : events_) {
      KVQ_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e), "cudaEventCreate");
    }
    return absl::OkStatus();
  }
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

}  // namespace

absl::StatusOr<std::vector<double>> TimeLaunches(cudaStream_t stream, int warmup, int reps,
                                                 absl::FunctionRef<absl::Status()> launch) {
  if (reps < 1 || warmup < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timed launches: reps (", reps, ") must be >= 1 and warmup (", warmup,
                     ") >= 0"));
  }
  for (int i = 0; i < warmup; ++i) KVQ_RETURN_IF_ERROR(launch());
  Events events(static_cast<size_t>(reps) + 1);
  KVQ_RETURN_IF_ERROR(events.Create());
  KVQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(events[0], stream), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) {
    KVQ_RETURN_IF_ERROR(launch());
    KVQ_CUDA_RETURN_IF_ERROR(cudaEventRecord(events[i + 1], stream), "cudaEventRecord");
  }
  KVQ_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events[reps]), "cudaEventSynchronize");
  std::vector<double> ms(reps);
  for (int i = 0; i < reps; ++i) {
    float t = 0.0f;
    KVQ_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t, events[i], events[i + 1]),
                             "cudaEventElapsedTime");
    ms[i] = t;
  }
  return ms;
}

absl::StatusOr<std::vector<double>> TimeDeviceQuantize(const KvStream& like, Side side,
                                                       int tokens, int copies, int warmup,
                                                       int reps) {
  const PageLayout& layout = like.layout();
  const int page_tokens = layout.page_tokens;
  if (tokens <= 0 || tokens % page_tokens != 0 || copies < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("timed quantize: tokens (", tokens, ") must be a positive multiple of the ",
                     "layout's page_tokens (", page_tokens, ") and copies (", copies,
                     ") >= 1"));
  }
  const int d = like.head_dim();
  const size_t row_bytes = static_cast<size_t>(d) * sizeof(uint16_t);
  const size_t copy_bytes = static_cast<size_t>(tokens) * row_bytes;
  const int pages_per_copy = tokens / page_tokens;
  const size_t pages = static_cast<size_t>(copies) * pages_per_copy;

  // One copy's rows on the host, N(0, 1) as fp16; every device copy is its
  // own buffer, so no launch reads another copy's rows from the L2.
  std::vector<uint16_t> host(static_cast<size_t>(tokens) * d);
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal;
  for (uint16_t& h : host) h = FloatToHalf(normal(rng));

  DeviceMemory rows, out, levels;
  KVQ_RETURN_IF_ERROR(rows.Allocate(copy_bytes * copies, "cudaMalloc (timed quantize rows)"));
  KVQ_RETURN_IF_ERROR(
      out.Allocate(pages * layout.page_bytes, "cudaMalloc (timed quantize pages)"));
  for (int c = 0; c < copies; ++c) {
    KVQ_CUDA_RETURN_IF_ERROR(cudaMemcpy(rows.get() + c * copy_bytes, host.data(), copy_bytes,
                                        cudaMemcpyHostToDevice),
                             "cudaMemcpy (timed quantize rows)");
  }
  const std::vector<float> host_levels = LevelsAsFloats(like, side);
  if (!host_levels.empty()) {
    const size_t bytes = host_levels.size() * sizeof(float);
    KVQ_RETURN_IF_ERROR(levels.Allocate(bytes, "cudaMalloc (timed quantize levels)"));
    KVQ_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(levels.get(), host_levels.data(), bytes, cudaMemcpyHostToDevice),
        "cudaMemcpy (timed quantize levels)");
  }
  const hd::SideExtras extras = ExtrasFor(
      like, side, host_levels.empty() ? nullptr : reinterpret_cast<const float*>(levels.get()));

  std::vector<QuantizeJob> jobs(pages);
  for (size_t p = 0; p < pages; ++p) {
    QuantizeJob& job = jobs[p];
    job.page = out.get() + p * layout.page_bytes;
    job.rows = rows.get() + p * page_tokens * row_bytes;  // Copies lie end to end.
    job.extras = extras;
    job.row0 = 0;
    job.n = page_tokens;
  }
  const DeviceQuantSide quant_side = DeviceQuantSideOf(like.spec(), layout, side);
  KVQ_RETURN_IF_ERROR(ValidateQuantizeJobs(quant_side, jobs));
  const cudaStream_t stream = cudaStreamPerThread;
  return TimeLaunches(stream, warmup, reps, [&] {
    return LaunchQuantizeRows(quant_side, DeviceRowType::kFloat16, jobs, stream);
  });
}

}  // namespace kvq
