// crq's device kernels (cuda_crq.h); docs/CUDA.md "crq" has the design.
//
//   CrqQuantizeKernel, grid (row groups, jobs), 128 threads: a block stages
//   kCrqRows input rows in shared memory with 16-byte loads, then a thread
//   per row runs hd::CrqStoreRow (the sums in coordinate order that
//   cuda_host runs, so the bytes are the same), its code scratch in shared
//   memory.
//   CrqDequantizeKernel: the rows' code bytes staged with 16-byte loads,
//   a thread per element (hd::CrqDequant).
//   CrqSplitKernel<D>, grid (splits, row tiles, tasks): the split kernel of
//   cuda_attention.cu's shape (BlockWorkOf / WalkKeys: pages staged by
//   cp.async, 32-key tiles) with coded-space arithmetic. A coded key's
//   score is q . R_t mu_k + g_t (qr . level[code]): the tile holds the mean
//   key mu_k turned by RoPE to each key's position and the key's Lloyd-Max
//   levels; an fp16 sink / tail key is turned by RoPE and meets q. Values
//   accumulate in two sums, coded (gain x level, rotated basis) and fp16
//   (original basis); at the end the block rotates the coded sum back
//   (Walsh-Hadamard stages in parallel) and writes the chunk's output
//   mu_v * coded share + s_v * H^T(coded) + fp16, normalized, and its lse.
//   CrqMergeKernel: the partials merged by lse (MergeRow).
#include "kernels/cuda/cuda_crq.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_info.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

constexpr int kThreads = kAttentionThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kRowTile = kAttentionRowTile;
constexpr int kKeyTile = kAttentionKeyTile;
constexpr int kRowsPerWarp = kRowTile / kWarps;
constexpr int kMinBlocks = 1;  // Shared memory, not registers, bounds residency.
constexpr int kMaxSplits = 1024;
constexpr int kCrqRows = 16;       // Rows per quantize / dequantize block.
constexpr int kJobsPerLaunch = 64;  // Jobs a launch carries in its parameters.

// The codebooks copied into shared memory by the block's threads.
__device__ __forceinline__ void LoadCodebooks(const hd::CrqCodebooks* from, hd::CrqCodebooks* to) {
  const float* src = reinterpret_cast<const float*>(from);
  float* dst = reinterpret_cast<float*>(to);
  constexpr int kFloats = sizeof(hd::CrqCodebooks) / sizeof(float);
  for (int i = threadIdx.x; i < kFloats; i += blockDim.x) dst[i] = src[i];
}

// `bytes` (a multiple of 16, 16-byte aligned both ends) of read-only global
// memory into shared memory, a 16-byte load per thread and step.
__device__ __forceinline__ void StageVectors(const void* src, int bytes, void* dst) {
  const uint4* from = static_cast<const uint4*>(src);
  uint4* to = static_cast<uint4*>(dst);
  for (int i = threadIdx.x; i < bytes / kDeviceVector; i += blockDim.x) to[i] = __ldg(from + i);
}

template <class Job>
struct CrqBatch {
  DeviceQuantSide side;
  const hd::CrqCodebooks* codebooks = nullptr;
  int count = 0;
  Job jobs[kJobsPerLaunch];
};

template <int D>
__global__ void __launch_bounds__(kThreads)
    CrqQuantizeKernel(const __grid_constant__ CrqBatch<QuantizeJob> batch) {
  __shared__ hd::CrqCodebooks cb;
  __shared__ __align__(16) float rows_s[kCrqRows * D];
  __shared__ uint8_t codes_s[kCrqRows * D];
  const SideLayout& S = batch.side.layout.side(batch.side.side);
  LoadCodebooks(batch.codebooks, &cb);
  for (int j = blockIdx.y; j < batch.count; j += gridDim.y) {
    const QuantizeJob& job = batch.jobs[j];
    const int first = blockIdx.x * kCrqRows;
    if (first >= job.n) continue;
    const int n = min(kCrqRows, job.n - first);
    StageVectors(static_cast<const float*>(job.rows) + static_cast<size_t>(first) * D,
                 n * D * static_cast<int>(sizeof(float)), rows_s);
    __syncthreads();
    if (threadIdx.x < n) {
      const int r = threadIdx.x, row = job.row0 + first + r;
      hd::CrqStoreRow(rows_s + r * D, D, S.half_bits, cb, codes_s + r * D,
                      PageLayout::CodeRow(job.page, S, row),
                      reinterpret_cast<uint8_t*>(PageLayout::Gain(job.page, S, row)));
    }
    __syncthreads();
  }
}

__device__ __forceinline__ void StoreElement(float* out, float x) { *out = x; }
__device__ __forceinline__ void StoreElement(uint16_t* out, float x) { *out = hd::FloatToHalf(x); }

template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    CrqDequantizeKernel(const __grid_constant__ CrqBatch<DequantizeJob> batch) {
  constexpr int kMaxRowBytes = D / 2;  // 4 bits on both halves.
  __shared__ hd::CrqCodebooks cb;
  __shared__ __align__(16) uint8_t codes[kCrqRows * kMaxRowBytes + 2 * kDeviceVector];
  __shared__ float gains[kCrqRows];
  const SideLayout& S = batch.side.layout.side(batch.side.side);
  const int rb = static_cast<int>(S.code_row_bytes);
  LoadCodebooks(batch.codebooks, &cb);
  for (int j = blockIdx.y; j < batch.count; j += gridDim.y) {
    const DequantizeJob& job = batch.jobs[j];
    const int first = blockIdx.x * kCrqRows;
    if (first >= job.n) continue;
    const int n = min(kCrqRows, job.n - first);
    const int row0 = job.row0 + first;
    // The aligned window around the rows' codes stays inside the page
    // (PageLayout::CheckVectorLoads).
    const uint8_t* src = PageLayout::CodeRow(job.page, S, row0);
    const uintptr_t lo = reinterpret_cast<uintptr_t>(src) & ~uintptr_t{kDeviceVector - 1};
    const uintptr_t hi = (reinterpret_cast<uintptr_t>(src) + static_cast<uintptr_t>(n) * rb +
                          kDeviceVector - 1) & ~uintptr_t{kDeviceVector - 1};
    StageVectors(reinterpret_cast<const void*>(lo), static_cast<int>(hi - lo), codes);
    if (threadIdx.x < n) {
      gains[threadIdx.x] = hd::HalfToFloat(*PageLayout::Gain(job.page, S, row0 + threadIdx.x));
    }
    __syncthreads();
    const uint8_t* staged = codes + (reinterpret_cast<uintptr_t>(src) - lo);
    const int stride = job.out_stride > 0 ? job.out_stride : D;
    T* out = static_cast<T*>(job.out) + static_cast<size_t>(first) * stride;
    for (int e = threadIdx.x; e < n * D; e += blockDim.x) {
      const int r = e / D, c = e % D;
      StoreElement(out + static_cast<size_t>(r) * stride + c,
                   hd::CrqDequant(staged + r * rb, D, S.half_bits, gains[r], cb, c));
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------
// Attention.
// ---------------------------------------------------------------------------
struct CrqLaunch {
  const DeviceCrqTask* tasks;
  const hd::CrqCodebooks* codebooks;
  int group_size;
  int split_tokens;
  int splits;
  int max_rows;
  int page_buffer;
  int page_buffers;
  float* partial_out;
  float* partial_lse;
};

template <int D>
struct CrqSmem {
  static constexpr int kKeyStride = D + 1;  // Padded: the score loop reads along key rows.
  hd::CrqCodebooks cb;
  double inv_freq[D / 2];
  float q[kRowTile * D];
  float qr[kRowTile * D];
  float k_tile[kKeyTile * kKeyStride];  // RoPE'd keys: mu_k (coded) or the fp16 key.
  float c_tile[kKeyTile * kKeyStride];  // Coded keys' levels.
  float v_tile[kKeyTile * D];           // gain x level (coded) or the fp16 value.
  float acc[kRowTile * D];              // fp16 values, original basis.
  float acc_coded[kRowTile * D];        // Coded values, rotated basis.
  float key_gain[kKeyTile];
  float value_gain[kKeyTile];
  float p_s[kRowTile * kKeyTile];
  float rescale_s[kRowTile];
  float max_s[kRowTile];
  float sum_s[kRowTile];
  float coded_s[kRowTile];
  int visible_s[kRowTile];
};

// The block's query rows (task.q and qr) into shared memory, 16 bytes per
// load; rows past nrows zero.
template <int D>
__device__ void LoadCrqQueries(const DeviceCrqTask& ct, int row0, int nrows, CrqSmem<D>* s) {
  constexpr int kQuads = D / 4;
  for (int e = threadIdx.x; e < kRowTile * kQuads; e += kThreads) {
    const int r = e / kQuads, c4 = e % kQuads;
    float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f), qr = q;
    if (r < nrows) {
      const size_t at = static_cast<size_t>(row0 + r) * D + 4 * c4;
      q = *reinterpret_cast<const float4*>(ct.task.q + at);
      qr = *reinterpret_cast<const float4*>(ct.qr + at);
    }
    *reinterpret_cast<float4*>(s->q + r * D + 4 * c4) = q;
    *reinterpret_cast<float4*>(s->qr + r * D + 4 * c4) = qr;
  }
}

// One tile's keys and values: coded (page set) or fp16 sink / tail rows.
template <int D>
__device__ void LoadCrqTile(const DeviceCrqTask& ct, const uint8_t* page, int row0, int t0, int n,
                            CrqSmem<D>* s) {
  const DeviceStreamView& v = ct.task.stream;
  const PageLayout& L = v.layout;
  constexpr int ks = CrqSmem<D>::kKeyStride;
  if (page != nullptr) {
    for (int j = threadIdx.x; j < n; j += kThreads) {
      s->key_gain[j] = hd::HalfToFloat(*PageLayout::Gain(page, L.key, row0 + j));
      s->value_gain[j] = hd::HalfToFloat(*PageLayout::Gain(page, L.value, row0 + j));
    }
    __syncthreads();
    const float* key_mean = ct.calibration;
    for (int e = threadIdx.x; e < n * D; e += kThreads) {
      const int j = e / D, c = e % D;
      s->k_tile[j * ks + c] = key_mean[c];
      s->c_tile[j * ks + c] = hd::CrqDequant(PageLayout::CodeRow(page, L.key, row0 + j), D,
                                             L.key.half_bits, 1.0f, s->cb, c);
      s->v_tile[e] = hd::CrqDequant(PageLayout::CodeRow(page, L.value, row0 + j), D,
                                    L.value.half_bits, s->value_gain[j], s->cb, c);
    }
  } else {
    const bool sink = t0 < v.sink_tokens;
    const size_t first = sink ? t0 : t0 - v.sink_tokens - v.quantized_tokens;
    const uint16_t* k = (sink ? v.sink_k : v.tail_k) + first * D;
    const uint16_t* vv = (sink ? v.sink_v : v.tail_v) + first * D;
    for (int e = threadIdx.x; e < n * D; e += kThreads) {
      const int j = e / D, c = e % D;
      s->k_tile[j * ks + c] = hd::HalfToFloat(k[e]);
      s->v_tile[e] = hd::HalfToFloat(vv[e]);
    }
  }
  __syncthreads();
  // RoPE of the tile's keys to their positions, a thread per pair.
  const int pairs = v.rope.rotary_dim / 2;
  for (int e = threadIdx.x; e < n * pairs; e += kThreads) {
    const int j = e / pairs, i = e % pairs;
    float c, sn;
    RopeCosSinOf(s->inv_freq[i], t0 + j, &c, &sn);
    float* row = s->k_tile + j * ks;
    const int a = hd::RopeFirst(v.rope, i), b = hd::RopeSecond(v.rope, i);
    hd::RotatePair(row[a], row[b], c, sn, &row[a], &row[b]);
  }
  __syncthreads();
}

template <int D>
__global__ void __launch_bounds__(kThreads, kMinBlocks) CrqSplitKernel(const CrqLaunch p) {
  const DeviceCrqTask& ct = p.tasks[blockIdx.z];
  const DeviceAttentionTask& t = ct.task;
  BlockWork w;
  if (!BlockWorkOf(p, t, &w) || !PagesFit(p, t, w, D)) return;
  const DeviceStreamView& v = t.stream;
  constexpr int ks = CrqSmem<D>::kKeyStride;
  extern __shared__ __align__(16) unsigned char smem[];
  uint8_t* buffers = smem;
  auto* s =
      reinterpret_cast<CrqSmem<D>*>(smem + static_cast<size_t>(p.page_buffers) * p.page_buffer);
  LoadCodebooks(p.codebooks, &s->cb);
  for (int i = threadIdx.x; i < v.rope.rotary_dim / 2; i += kThreads) {
    s->inv_freq[i] = hd::RopeInvFreq(v.rope, i) / static_cast<double>(v.rope.linear_factor);
  }
  if (threadIdx.x < kRowTile) {
    s->visible_s[threadIdx.x] =
        threadIdx.x < w.nrows ? VisibleEnd(t, p.group_size, w.row0 + threadIdx.x) : w.s0;
  }
  for (int e = threadIdx.x; e < kRowTile * D; e += kThreads) s->acc[e] = s->acc_coded[e] = 0.0f;
  LoadCrqQueries<D>(ct, w.row0, w.nrows, s);
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Per row of this warp: running max, sum, and the coded keys' share of it.
  float m[kRowsPerWarp], l[kRowsPerWarp], lc[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = hd::NegInf();
    l[rr] = lc[rr] = 0.0f;
  }

  WalkKeys(p, v, w, buffers, [&](int t0, int n, const uint8_t* page, int row0) {
    const bool coded = page != nullptr;
    LoadCrqTile<D>(ct, page, row0, t0, n, s);
    for (int e = threadIdx.x; e < kRowTile * kKeyTile; e += kThreads) {
      const int r = e / kKeyTile, j = e % kKeyTile;
      float score = hd::NegInf();
      if (r < w.nrows && j < n && t0 + j < s->visible_s[r]) {
        score = hd::Dot(s->q + r * D, s->k_tile + j * ks, D);
        if (coded) score += s->key_gain[j] * hd::Dot(s->qr + r * D, s->c_tile + j * ks, D);
      }
      s->p_s[e] = score;
    }
    __syncthreads();
    // The online softmax (cuda_attention.cu's SoftmaxTile), a warp per
    // kRowsPerWarp rows and a lane per key.
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const float sc = s->p_s[r * kKeyTile + lane];
      const float new_max = hd::Max(m[rr], WarpMax(sc));
      float wgt = 0.0f, rescale = 1.0f;
      if (new_max != hd::NegInf()) {
        rescale = hd::Exp(m[rr] - new_max);
        wgt = hd::Exp(sc - new_max);
        m[rr] = new_max;
      }
      const float tile_sum = WarpSum(wgt);
      l[rr] = l[rr] * rescale + tile_sum;
      lc[rr] = lc[rr] * rescale + (coded ? tile_sum : 0.0f);
      s->p_s[r * kKeyTile + lane] = wgt;
      if (lane == 0) s->rescale_s[r] = rescale;
    }
    __syncthreads();
    float* to = coded ? s->acc_coded : s->acc;
    for (int e = threadIdx.x; e < kRowTile * D; e += kThreads) {
      const int r = e / D, c = e % D;
      const float rescale = s->rescale_s[r];
      float a = to[e] * rescale;
      for (int j = 0; j < n; ++j) a += s->p_s[r * kKeyTile + j] * s->v_tile[j * D + c];
      to[e] = a;
      if (coded) {
        s->acc[e] *= rescale;
      } else {
        s->acc_coded[e] *= rescale;
      }
    }
    __syncthreads();
  });

  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      s->max_s[warp * kRowsPerWarp + rr] = m[rr];
      s->sum_s[warp * kRowsPerWarp + rr] = l[rr];
      s->coded_s[warp * kRowsPerWarp + rr] = lc[rr];
    }
  }
  __syncthreads();
  if (threadIdx.x < kRowTile) {
    hd::SoftmaxState st;
    st.max = s->max_s[threadIdx.x];
    st.sum = s->sum_s[threadIdx.x];
    if (threadIdx.x < w.nrows) {
      p.partial_lse[PartialRow(p, blockIdx.z, blockIdx.x, w.row0 + threadIdx.x)] =
          hd::SoftmaxLse(st);
    }
    s->rescale_s[threadIdx.x] = hd::SoftmaxOutScale(st);  // 1 / sum, or 0.
  }
  __syncthreads();
  for (int e = threadIdx.x; e < kRowTile * D; e += kThreads) s->acc_coded[e] *= s->rescale_s[e / D];
  __syncthreads();
  WalshHadamardRows<D, kThreads>(s->acc_coded, w.nrows);
  const float* value_mean = ct.calibration + D;
  const float* value_scale = ct.calibration + 2 * D;
  const float* signs = ct.calibration + 3 * D;
  const float norm = hd::HadamardNorm(D);
  for (int e = threadIdx.x; e < w.nrows * D; e += kThreads) {
    const int r = e / D, c = e % D;
    const float inv = s->rescale_s[r];
    const float coded = s->acc_coded[e] * (norm * signs[c]);
    p.partial_out[PartialRow(p, blockIdx.z, blockIdx.x, w.row0 + r) * D + c] =
        s->acc[e] * inv + value_mean[c] * (s->coded_s[r] * inv) + value_scale[c] * coded;
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads) CrqMergeKernel(const CrqLaunch p) {
  const int row = blockIdx.x;
  const DeviceAttentionTask& t = p.tasks[blockIdx.y].task;
  if (row >= t.num_queries * p.group_size) return;
  MergeRow<D, kThreads, kMaxSplits>(p, t, blockIdx.y, row);
}

// ---------------------------------------------------------------------------
// Launch.
// ---------------------------------------------------------------------------
template <class F>
decltype(auto) WithCrqHeadDim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    default:
      return f(std::integral_constant<int, 256>{});
  }
}

absl::Status CheckCrqHeadDim(int head_dim) {
  if (CrqKernelTakesHeadDim(head_dim)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("head_dim must be 64, 128 or 256 for crq on the device, got ", head_dim));
}

template <class Job, class Kernel>
absl::Status LaunchCrqBatches(const DeviceQuantSide& side, const hd::CrqCodebooks* codebooks,
                              absl::Span<const Job> jobs, Kernel kernel, cudaStream_t stream,
                              const char* what) {
  if (codebooks == nullptr) return absl::InvalidArgumentError("codebooks is null");
  for (size_t first = 0; first < jobs.size(); first += kJobsPerLaunch) {
    CrqBatch<Job> batch;
    batch.side = side;
    batch.codebooks = codebooks;
    batch.count = static_cast<int>(std::min<size_t>(kJobsPerLaunch, jobs.size() - first));
    int groups = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.jobs[i] = jobs[first + i];
      groups = std::max(groups, (batch.jobs[i].n + kCrqRows - 1) / kCrqRows);
    }
    kernel<<<dim3(groups, batch.count), kThreads, 0, stream>>>(batch);
    KVQ_CUDA_RETURN_IF_ERROR(cudaGetLastError(), what);
  }
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchCrqFor(const DecodeAttentionShape& shape, CrqLaunch p, cudaStream_t stream) {
  KVQ_ASSIGN_OR_RETURN(const int max_smem, MaxSharedMemoryPerBlock());
  size_t smem = 0;
  for (p.page_buffers = 2; p.page_buffers >= 1; --p.page_buffers) {
    smem = static_cast<size_t>(p.page_buffer) * p.page_buffers + sizeof(CrqSmem<D>);
    if (smem <= static_cast<size_t>(max_smem)) break;
  }
  if (p.page_buffers == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_page_bytes ", shape.max_page_bytes, " needs ", smem,
        " bytes of shared memory per block for crq with head_dim ", D, "; the device has ",
        max_smem));
  }
  const dim3 grid(p.splits, (shape.max_rows + kRowTile - 1) / kRowTile, shape.num_tasks);
  KVQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(CrqSplitKernel<D>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem)),
                           "crq attention: shared memory");
  CrqSplitKernel<D><<<grid, kThreads, smem, stream>>>(p);
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "crq attention split kernel launch");
  CrqMergeKernel<D><<<dim3(shape.max_rows, shape.num_tasks), kThreads, 0, stream>>>(p);
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "crq attention merge kernel launch");
  return absl::OkStatus();
}

}  // namespace

bool CrqKernelTakesHeadDim(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

absl::Status LaunchCrqQuantizeRows(const DeviceQuantSide& side, const hd::CrqCodebooks* codebooks,
                                   absl::Span<const QuantizeJob> jobs, cudaStream_t stream) {
  KVQ_RETURN_IF_ERROR(CheckCrqHeadDim(side.layout.head_dim));
  KVQ_RETURN_IF_ERROR(ValidateQuantizeJobs(side, jobs));
  return WithCrqHeadDim(side.layout.head_dim, [&](auto dim) {
    return LaunchCrqBatches(side, codebooks, jobs, CrqQuantizeKernel<decltype(dim)::value>, stream,
                            "crq quantize launch");
  });
}

absl::Status LaunchCrqDequantizeRows(const DeviceQuantSide& side, DeviceRowType output,
                                     const hd::CrqCodebooks* codebooks,
                                     absl::Span<const DequantizeJob> jobs, cudaStream_t stream) {
  KVQ_RETURN_IF_ERROR(CheckCrqHeadDim(side.layout.head_dim));
  KVQ_RETURN_IF_ERROR(ValidateDequantizeJobs(side, jobs));
  const bool f32 = output == DeviceRowType::kFloat32;
  return WithCrqHeadDim(side.layout.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    return LaunchCrqBatches(side, codebooks, jobs,
                            f32 ? CrqDequantizeKernel<float, D> : CrqDequantizeKernel<uint16_t, D>,
                            stream, "crq dequantize launch");
  });
}

absl::Status LaunchCrqAttention(const DeviceCrqTask* tasks, const DecodeAttentionShape& shape,
                                const hd::CrqCodebooks* codebooks, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  if (shape.num_tasks == 0) return absl::OkStatus();
  KVQ_RETURN_IF_ERROR(CheckCrqHeadDim(shape.head_dim));
  if (shape.num_tasks < 0 || shape.num_tasks > 65535 || shape.max_rows < 1 ||
      shape.max_rows > 65535 || shape.max_keys < 0 || shape.sm_count < 1 ||
      shape.max_page_tokens < 1 || shape.max_page_bytes < 0 ||
      shape.max_page_bytes % kDeviceVector != 0 || shape.tensor_cores) {
    return absl::InvalidArgumentError(absl::StrCat(
        "crq attention shape: num_tasks ", shape.num_tasks, " and max_rows ", shape.max_rows,
        " must be in [1, 65535], max_keys ", shape.max_keys, " >= 0, sm_count ", shape.sm_count,
        " and max_page_tokens ", shape.max_page_tokens, " >= 1, max_page_bytes ",
        shape.max_page_bytes, " a multiple of ", kDeviceVector, ", tensor_cores false"));
  }
  if (shape.group_size < 1 || shape.group_size > kMaxAttentionGroup) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group_size must be in [1, ", kMaxAttentionGroup, "], got ", shape.group_size));
  }
  const size_t need = DecodeAttentionWorkspaceBytes(shape);
  if (workspace == nullptr || workspace_bytes < need ||
      reinterpret_cast<uintptr_t>(workspace) % kDeviceVector != 0) {
    return absl::InvalidArgumentError(absl::StrCat("workspace must hold ", need, " bytes, ",
                                                   kDeviceVector, "-byte aligned; got ",
                                                   workspace_bytes));
  }
  if (codebooks == nullptr) return absl::InvalidArgumentError("codebooks is null");
  CrqLaunch p;
  p.tasks = tasks;
  p.codebooks = codebooks;
  p.group_size = shape.group_size;
  p.split_tokens = DecodeAttentionSplitTokens(shape);
  p.splits = DecodeAttentionSplits(shape);
  p.max_rows = shape.max_rows;
  p.page_buffer = static_cast<int>((std::max(shape.max_page_bytes, 0) + kDeviceVector - 1) /
                                   kDeviceVector * kDeviceVector);
  p.page_buffers = 2;
  p.partial_out = static_cast<float*>(workspace);
  p.partial_lse = p.partial_out +
                  static_cast<size_t>(shape.num_tasks) * p.splits * shape.max_rows * shape.head_dim;
  return WithCrqHeadDim(shape.head_dim, [&](auto dim) {
    return LaunchCrqFor<decltype(dim)::value>(shape, p, stream);
  });
}

}  // namespace kvq
