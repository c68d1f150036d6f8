// The device quantize and dequantize kernels (cuda_quantize.h). Grid:
// blockIdx.y walks the jobs of the batch, blockIdx.x the units of a job: a
// quantization block (block_tokens rows, whose parameters are set together)
// for int8 and packed sides, one row for fp16 / bf16 / fp8 rows, and
// kDequantRows rows when reading. Each kernel is compiled per head_dim
// (kernel_head_dims.h: a template parameter, so the element walks divide
// by constants). Every value comes from the quant_hd.h / dequant_hd.h
// functions that cuda_host runs on the CPU.
#include "kernels/cuda/cuda_quantize.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/kernel_head_dims.h"
#include "kernels/hd/quant_hd.h"

namespace kvq {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kDequantRows = 8;
// The largest unit: block_tokens (<= 256) rows of head_dim, and its
// groups (at most max(block_tokens, head_dim), quant_hd.h GroupsPerUnit).
constexpr int kMaxBlockTokens = 256;
constexpr int kMaxUnitGroups = 256;

constexpr int kVector = 16;  // Bytes per LDG.128.
// Quantization units up to this size are staged in shared memory with
// 16-byte loads before the block's passes over them (ranges, outlier
// scans, codes); larger ones are read in place.
constexpr int kMaxStagedUnitBytes = 96 * 1024;

template <class Job>
struct JobBatch {
  DeviceQuantSide side;
  int count = 0;
  int staged_unit_bytes = 0;  // QuantizePackedUnits: bytes staged per unit, or 0.
  Job jobs[kMaxJobsPerLaunch];
};
// Kernel parameters may take 32764 bytes (CUDA 12.1+, sm_70+).
static_assert(sizeof(JobBatch<QuantizeJob>) <= 32000);
static_assert(sizeof(JobBatch<DequantizeJob>) <= 32000);

// 16 bytes of input rows as floats: 4 fp32 or 8 fp16 elements per load.
template <class T>
struct Vec {
  static constexpr int kElems = kVector / sizeof(T);
};
template <class T>
__device__ __forceinline__ void LoadVector(const T* src, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) out[i] = hd::ElementToFloat(elems[i]);
}

// Copies `bytes` (a multiple of 16, both ends 16-byte aligned) of global
// memory that no kernel writes meanwhile (a job's rows, a page being read)
// with the block's threads, one read-only 16-byte load each.
__device__ __forceinline__ void CopyVectors(const void* src, int bytes, void* dst) {
  const uint4* from = static_cast<const uint4*>(src);
  uint4* to = static_cast<uint4*>(dst);
  for (int i = threadIdx.x; i < bytes / kVector; i += blockDim.x) to[i] = __ldg(from + i);
}

__device__ __forceinline__ void StoreElement(float* out, float x) { *out = x; }
__device__ __forceinline__ void StoreElement(uint16_t* out, float x) { *out = hd::FloatToHalf(x); }

// fp16 / bf16 / fp8 rows: one block per row, a thread per channel.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    QuantizeFloatRows(const __grid_constant__ JobBatch<QuantizeJob> batch) {
  const PageLayout& L = batch.side.layout;
  const SideLayout& S = L.side(batch.side.side);
  constexpr int d = D;
  for (int j = blockIdx.y; j < batch.count; j += gridDim.y) {
    const QuantizeJob& job = batch.jobs[j];
    const int r = blockIdx.x;
    if (r >= job.n) continue;
    const T* x = static_cast<const T*>(job.rows) + static_cast<size_t>(r) * d;
    uint8_t* out = PageLayout::CodeRow(job.page, S, job.row0 + r);
    const float inv = S.format == CodeFormat::kFp8E4m3 ? hd::Div(1.0f, job.extras.fp8_scale) : 1.0f;
    // A thread per 16 input bytes (rows are 16-byte aligned: the job's
    // rows are, and head_dim is a multiple of 16).
    constexpr int kElems = Vec<T>::kElems;
    for (int c0 = threadIdx.x * kElems; c0 < d; c0 += blockDim.x * kElems) {
      float v[kElems];
      LoadVector(x + c0, v);
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        const int c = c0 + i;
        if (S.format == CodeFormat::kFp8E4m3) {
          out[c] = hd::FloatToFp8E4m3(hd::Mul(v[i], inv));
        } else {
          hd::StoreHalfBits(out + 2 * c, S.format == CodeFormat::kFp16 ? hd::FloatToHalf(v[i])
                                                                      : hd::FloatToBf16(v[i]));
        }
      }
    }
  }
}

// The best of two candidates in the outlier order (-1: none).
__device__ __forceinline__ void KeepBetter(float& score, int& index, float other_score,
                                           int other_index) {
  if (other_index >= 0 && (index < 0 || hd::OutlierBefore(other_score, other_index, score, index))) {
    score = other_score;
    index = other_index;
  }
}

// int8 and packed sides: one block per quantization unit. Outliers by k
// block-wide arg-max passes over the strict outlier order, ranges and fits
// a thread per group (sequential in element order, as the reference sums),
// p8 headers by one thread (their min / max keep the first of equal
// zeros), then a thread per packed byte.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    QuantizePackedUnits(const __grid_constant__ JobBatch<QuantizeJob> batch) {
  __shared__ uint32_t outlier_bits[kMaxBlockTokens * D / 32];
  __shared__ hd::RobustCenter centers[kMaxUnitGroups];
  __shared__ hd::Range ranges[kMaxUnitGroups];
  __shared__ hd::ScaleZero params[kMaxUnitGroups];
  __shared__ float needed[kMaxUnitGroups];
  __shared__ float warp_score[kWarps];
  __shared__ int warp_index[kWarps];
  __shared__ float prev_score;
  __shared__ int prev_index;
  __shared__ hd::ZeroSteps8 zero_steps;
  __shared__ hd::ZeroSteps8 scale_step;
  __shared__ int16_t channel_group[D];  // hd::GroupOfChannel, once per block.
  extern __shared__ __align__(16) unsigned char staged_unit[];

  const PageLayout& L = batch.side.layout;
  const SideLayout& S = L.side(batch.side.side);
  constexpr int d = D;
  const int g = L.block_tokens;
  const int tid = threadIdx.x;
  const int groups = hd::GroupsPerUnit(L, S, g);
  const int elements = g * d;
  const int k_out = L.outliers_per_block;
  // hd::GroupOf by a table: the element walks below divide by constants
  // (head_dim) and by nothing else.
  const bool channels = S.axis == ParamAxis::kChannelGroups;
  const int np = L.ParamsPerEntry(S);
  for (int c = tid; c < d; c += blockDim.x) {
    channel_group[c] = static_cast<int16_t>(hd::GroupOfChannel(S, c));
  }
  __syncthreads();
  auto group_of = [&](int t, int c) { return (channels ? 0 : t * np) + channel_group[c]; };
  for (int j = blockIdx.y; j < batch.count; j += gridDim.y) {
    const QuantizeJob& job = batch.jobs[j];
    if (static_cast<int>(blockIdx.x) * g >= job.n) continue;
    const T* x = static_cast<const T*>(job.rows) + static_cast<size_t>(blockIdx.x) * elements;
    const int row = job.row0 + blockIdx.x * g;
    uint8_t* page = job.page;
    if (batch.staged_unit_bytes > 0) {
      // Every pass below reads the unit again: from shared memory, after
      // one 16-byte-load copy (the unit is 16-byte aligned: the rows are,
      // and head_dim is a multiple of 16).
      CopyVectors(x, batch.staged_unit_bytes, staged_unit);
      __syncthreads();
      x = reinterpret_cast<const T*>(staged_unit);
    }

    if (k_out > 0) {
      for (int w = tid; w < (elements + 31) / 32; w += blockDim.x) outlier_bits[w] = 0;
      for (int k = tid; k < groups; k += blockDim.x) {
        centers[k] = hd::RobustCenterOf(hd::GroupAt(L, S, x, g, k, hd::NoMask{}));
      }
      if (tid == 0) prev_index = -1;
      __syncthreads();
      uint8_t* table = reinterpret_cast<uint8_t*>(L.Outliers(page, S, row / g));
      for (int e = 0; e < k_out; ++e) {
        const float ps = prev_score;
        const int pi = prev_index;
        float best_score = 0.0f;
        int best = -1;
        for (int i = tid; i < elements; i += blockDim.x) {
          const float s =
              hd::OutlierScore(hd::ElementToFloat(x[i]), centers[group_of(i / d, i % d)]);
          if (pi >= 0 && !hd::OutlierBefore(ps, pi, s, i)) continue;
          KeepBetter(best_score, best, s, i);
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
          const float os = __shfl_down_sync(0xffffffffu, best_score, offset);
          const int oi = __shfl_down_sync(0xffffffffu, best, offset);
          KeepBetter(best_score, best, os, oi);
        }
        if ((tid & 31) == 0) {
          warp_score[tid / 32] = best_score;
          warp_index[tid / 32] = best;
        }
        __syncthreads();
        if (tid == 0) {
          for (int w = 1; w < kWarps; ++w) KeepBetter(best_score, best, warp_score[w], warp_index[w]);
          // No candidate left (only NaN scores remain): the lowest index not
          // chosen yet, as hd::NextOutlierOrUnchosen; never index -1.
          if (best < 0) {
            best = hd::FirstUnchosen(hd::BitMask{outlier_bits}, elements);
            best_score = hd::OutlierScore(hd::ElementToFloat(x[best]),
                                          centers[group_of(best / d, best % d)]);
          }
          prev_score = best_score;
          prev_index = best;
          outlier_bits[best >> 5] |= 1u << (best & 31);
          hd::StoreHalfBits(table + 2 * e, static_cast<uint16_t>(best));
          hd::StoreHalfBits(table + 2 * (k_out + e), hd::FloatToHalf(hd::ElementToFloat(x[best])));
        }
        __syncthreads();
      }
    }

    for (int k = tid; k < groups; k += blockDim.x) {
      ranges[k] = k_out > 0
                      ? hd::GroupRange(hd::GroupAt(L, S, x, g, k, hd::BitMask{outlier_bits}),
                                       S.bits, batch.side.fit)
                      : hd::GroupRange(hd::GroupAt(L, S, x, g, k, hd::NoMask{}), S.bits,
                                       batch.side.fit);
    }
    __syncthreads();

    if (S.param_bits == 16) {
      for (int k = tid; k < groups; k += blockDim.x) {
        params[k] = hd::Params16(ranges[k], S.bits, batch.side.nuq);
        const int entry = channels ? row / g : row + k / np;
        uint8_t* p = reinterpret_cast<uint8_t*>(L.Params(page, S, entry));
        const int i = channels ? k : k % np;
        hd::StoreHalfBits(p + 2 * i, hd::FloatToHalf(params[k].scale));
        hd::StoreHalfBits(p + 2 * (np + i), hd::FloatToHalf(params[k].zero));
      }
    } else {
      const float top = hd::Params8Top(S.bits, batch.side.nuq);
      // L.ParamBlock(page, S, row / g), with the p8 block's size this branch
      // already knows (its header and a code per group): the layout's
      // general ParamBlockBytes also answers crq's gain, and that branch
      // cost this kernel (half) a 24-byte stack frame.
      uint8_t* block = page + S.params_offset +
                       static_cast<size_t>(row / g) * (kParams8HeaderBytes + 2 * groups);
      uint8_t* scale_codes = block + kParams8HeaderBytes;
      uint8_t* zero_codes = scale_codes + groups;
      if (tid == 0) {
        float zmin = hd::Infinity(), zmax = -hd::Infinity();
        for (int k = 0; k < groups; ++k) {
          zmin = hd::MinOf(zmin, hd::Params8Low(ranges[k]));
          zmax = hd::MaxOf(zmax, hd::Params8Low(ranges[k]));
        }
        zero_steps = hd::ZeroSteps(zmin, zmax);
      }
      __syncthreads();
      for (int k = tid; k < groups; k += blockDim.x) {
        const hd::Code8 zc = hd::ZeroCode8(ranges[k], zero_steps);
        zero_codes[k] = zc.code;
        params[k].zero = zc.value;
        needed[k] = hd::NeededScale8(ranges[k], zc.value, top);
      }
      __syncthreads();
      if (tid == 0) {
        float smax = 0.0f;
        for (int k = 0; k < groups; ++k) smax = hd::MaxOf(smax, needed[k]);
        scale_step = hd::ScaleStep8(smax);
        hd::StoreParams8Header(block, scale_step.step_bits, zero_steps.base_bits,
                               zero_steps.step_bits);
      }
      __syncthreads();
      for (int k = tid; k < groups; k += blockDim.x) {
        const hd::Code8 sc =
            hd::ScaleCode8(ranges[k], needed[k], params[k].zero, scale_step.step, top);
        scale_codes[k] = sc.code;
        params[k].scale = sc.value;
      }
    }
    __syncthreads();

    const int row_bytes = hd::PackedRowBytes(d, S.bits);
    const float* levels = batch.side.nuq ? job.extras.levels : nullptr;
    for (int i = tid; i < g * row_bytes; i += blockDim.x) {
      const int t = i / row_bytes;
      const T* xr = x + static_cast<size_t>(t) * d;
      auto code = [&](int c) {
        return hd::CodeOf(hd::ElementToFloat(xr[c]), params[group_of(t, c)], S.bits, levels, c);
      };
      PageLayout::CodeRow(page, S, row + t)[i % row_bytes] = hd::PackedByte(code, d, S.bits, i % row_bytes);
    }
    __syncthreads();  // The shared tables are reused by the next job.
  }
}

// kDequantRows rows per block: the rows' codes staged in shared memory
// with 16-byte loads (the aligned window around them, inside the page),
// every element, then the chunk's outliers by one thread in table order (a
// later entry wins, as in the reference), then the rows out.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    DequantizeRowsKernel(const __grid_constant__ JobBatch<DequantizeJob> batch) {
  constexpr int kMaxCodeRowBytes = 2 * D;  // fp16 / bf16 rows.
  __shared__ float rows[kDequantRows * D];
  __shared__ __align__(16) uint8_t codes[kDequantRows * kMaxCodeRowBytes + 2 * kVector];
  const PageLayout& L = batch.side.layout;
  const SideLayout& S = L.side(batch.side.side);
  constexpr int d = D;
  const int rb = static_cast<int>(S.code_row_bytes);
  for (int j = blockIdx.y; j < batch.count; j += gridDim.y) {
    const DequantizeJob& job = batch.jobs[j];
    const int first = blockIdx.x * kDequantRows;
    if (first >= job.n) continue;
    const int n = min(kDequantRows, job.n - first);
    const int row0 = job.row0 + first;
    hd::SideExtras extras = job.extras;
    if (!batch.side.nuq) extras.levels = nullptr;
    // The page starts 16-byte aligned and its size is a multiple of 16
    // (PageLayout::CheckVectorLoads), so the window stays inside it.
    const uint8_t* src = PageLayout::CodeRow(job.page, S, row0);
    const uintptr_t lo = reinterpret_cast<uintptr_t>(src) & ~uintptr_t{kVector - 1};
    const uintptr_t hi =
        (reinterpret_cast<uintptr_t>(src) + static_cast<uintptr_t>(n) * rb + kVector - 1) &
        ~uintptr_t{kVector - 1};
    CopyVectors(reinterpret_cast<const void*>(lo), static_cast<int>(hi - lo), codes);
    __syncthreads();
    const uint8_t* staged = codes + (reinterpret_cast<uintptr_t>(src) - lo);
    for (int r = 0; r < n; ++r) {
      const uint8_t* code_row = staged + r * rb;
      const hd::RowParams rp = hd::RowParamsOf(L, S, row0 + r);
      const int np = L.ParamsPerEntry(S);
      for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float x;
        if (hd::HasParams(S)) {
          const hd::ScaleZero p = hd::ParamsFrom(S, job.page, rp, hd::GroupOfChannel(S, c), np,
                                                 L.EntriesPerBlock(S) * np);
          x = hd::DequantCode(S, code_row, c, hd::CodePosOf(d, S.bits, c), p, extras);
        } else {
          x = hd::DequantCode(S, code_row, c, hd::CodePos{}, hd::ScaleZero{}, extras);
        }
        rows[r * d + c] = x;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) hd::ApplyOutliers(L, S, job.page, row0, n, rows);
    __syncthreads();
    const int stride = job.out_stride > 0 ? job.out_stride : d;
    T* out = static_cast<T*>(job.out) + static_cast<size_t>(first) * stride;
    for (int r = 0; r < n; ++r) {
      for (int c = threadIdx.x; c < d; c += blockDim.x) {
        StoreElement(out + static_cast<size_t>(r) * stride + c, rows[r * d + c]);
      }
    }
    __syncthreads();
  }
}

bool BlockQuantized(const SideLayout& S) {
  return S.format == CodeFormat::kInt8 || S.format == CodeFormat::kPacked;
}

// Checks shared by both directions: the page, the rows, the extras.
absl::Status CheckJob(const DeviceQuantSide& side, size_t i, const void* page, const void* rows,
                      const char* rows_name, const hd::SideExtras& extras, int row0, int n) {
  const PageLayout& L = side.layout;
  const SideLayout& S = L.side(side.side);
  if (page == nullptr) return absl::InvalidArgumentError(absl::StrCat("job ", i, ": page is null"));
  if (reinterpret_cast<uintptr_t>(page) % kVector != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job ", i, ": page must be ", kVector, "-byte aligned (the kernels load 16 bytes)"));
  }
  if (rows == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("job ", i, ": ", rows_name, " is null"));
  }
  if (n < 1 || row0 < 0 || row0 + n > L.page_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("job ", i, ": rows [", row0, ", ", row0 + n,
                                                   ") must be a non-empty range inside the page's ",
                                                   L.page_tokens, " rows"));
  }
  if (side.nuq && BlockQuantized(S) && extras.levels == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("job ", i, ": extras.levels is null for nuq"));
  }
  if (S.format == CodeFormat::kFp8E4m3 &&
      !(std::isfinite(extras.fp8_scale) && extras.fp8_scale > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job ", i, ": extras.fp8_scale must be finite and > 0, got ", extras.fp8_scale));
  }
  return absl::OkStatus();
}

absl::Status CheckSide(const DeviceQuantSide& side) {
  const PageLayout& L = side.layout;
  if (absl::Status st = CheckKernelHeadDim("layout.head_dim", L.head_dim); !st.ok()) return st;
  if (L.block_tokens < 1 || L.block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(absl::StrCat("layout.block_tokens must be in [1, ",
                                                   kMaxBlockTokens, "], got ", L.block_tokens));
  }
  const SideLayout& S = L.side(side.side);
  if (BlockQuantized(S) && hd::GroupsPerUnit(L, S, L.block_tokens) > kMaxUnitGroups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a block has ", hd::GroupsPerUnit(L, S, L.block_tokens), " groups, at most ",
        kMaxUnitGroups));
  }
  return absl::OkStatus();
}

template <class Job, class Kernel>
absl::Status LaunchBatches(const DeviceQuantSide& side, absl::Span<const Job> jobs,
                           int rows_per_unit, Kernel kernel, cudaStream_t stream,
                           const char* what, int staged_unit_bytes = 0) {
  if (staged_unit_bytes > 0) {
    KVQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  staged_unit_bytes),
                             "quantize: shared memory for a staged unit");
  }
  for (size_t first = 0; first < jobs.size(); first += kMaxJobsPerLaunch) {
    const size_t count = std::min<size_t>(kMaxJobsPerLaunch, jobs.size() - first);
    // On the heap, once per thread: 20 KB is too much for a caller's stack,
    // and as a thread_local object it would be static TLS, which glibc
    // carves out of every thread's stack, civetweb's fixed-size metrics
    // workers included (with NCCL loaded too they overflowed on the first
    // scrape). Launches copy it.
    thread_local const std::unique_ptr<JobBatch<Job>> batch_storage =
        std::make_unique<JobBatch<Job>>();
    JobBatch<Job>& batch = *batch_storage;
    batch.side = side;
    batch.count = static_cast<int>(count);
    batch.staged_unit_bytes = staged_unit_bytes;
    int units = 0;
    for (size_t i = 0; i < count; ++i) {
      batch.jobs[i] = jobs[first + i];
      units = std::max(units, (jobs[first + i].n + rows_per_unit - 1) / rows_per_unit);
    }
    const dim3 grid(units, std::min<int>(static_cast<int>(count), 65535));
    kernel<<<grid, kThreads, staged_unit_bytes, stream>>>(batch);
    KVQ_CUDA_RETURN_IF_ERROR(cudaGetLastError(), what);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateQuantizeJobs(const DeviceQuantSide& side,
                                  absl::Span<const QuantizeJob> jobs) {
  if (absl::Status st = CheckSide(side); !st.ok()) return st;
  const PageLayout& L = side.layout;
  const SideLayout& S = L.side(side.side);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const QuantizeJob& job = jobs[i];
    if (absl::Status st = CheckJob(side, i, job.page, job.rows, "rows", job.extras, job.row0, job.n);
        !st.ok()) {
      return st;
    }
    if (reinterpret_cast<uintptr_t>(job.rows) % kVector != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "job ", i, ": rows must be ", kVector, "-byte aligned (the kernels load 16 bytes)"));
    }
    if (BlockQuantized(S) && (job.row0 % L.block_tokens != 0 || job.n % L.block_tokens != 0)) {
      return absl::InvalidArgumentError(absl::StrCat("job ", i, ": row0 ", job.row0, " and n ",
                                                     job.n, " must be multiples of the block (",
                                                     L.block_tokens, " rows)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateDequantizeJobs(const DeviceQuantSide& side,
                                    absl::Span<const DequantizeJob> jobs) {
  if (absl::Status st = CheckSide(side); !st.ok()) return st;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const DequantizeJob& job = jobs[i];
    if (absl::Status st = CheckJob(side, i, job.page, job.out, "out", job.extras, job.row0, job.n);
        !st.ok()) {
      return st;
    }
    if (job.out_stride != 0 && job.out_stride < side.layout.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("job ", i, ": out_stride ", job.out_stride,
                                                     " is below head_dim ", side.layout.head_dim));
    }
  }
  return absl::OkStatus();
}

absl::Status LaunchQuantizeRows(const DeviceQuantSide& side, DeviceRowType input,
                                absl::Span<const QuantizeJob> jobs, cudaStream_t stream) {
  if (absl::Status st = ValidateQuantizeJobs(side, jobs); !st.ok()) return st;
  if (jobs.empty()) return absl::OkStatus();
  const SideLayout& S = side.layout.side(side.side);
  const bool f32 = input == DeviceRowType::kFloat32;
  return WithKernelHeadDim(side.layout.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    if (BlockQuantized(S)) {
      const int unit_bytes = side.layout.block_tokens * D * (f32 ? 4 : 2);
      return LaunchBatches(side, jobs, side.layout.block_tokens,
                           f32 ? QuantizePackedUnits<float, D> : QuantizePackedUnits<uint16_t, D>,
                           stream, "quantize launch",
                           unit_bytes <= kMaxStagedUnitBytes ? unit_bytes : 0);
    }
    return LaunchBatches(side, jobs, 1,
                         f32 ? QuantizeFloatRows<float, D> : QuantizeFloatRows<uint16_t, D>, stream,
                         "quantize launch");
  });
}

absl::Status LaunchDequantizeRows(const DeviceQuantSide& side, DeviceRowType output,
                                  absl::Span<const DequantizeJob> jobs, cudaStream_t stream) {
  if (absl::Status st = ValidateDequantizeJobs(side, jobs); !st.ok()) return st;
  if (jobs.empty()) return absl::OkStatus();
  return WithKernelHeadDim(side.layout.head_dim, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    return LaunchBatches(side, jobs, kDequantRows,
                         output == DeviceRowType::kFloat32 ? DequantizeRowsKernel<float, D>
                                                           : DequantizeRowsKernel<uint16_t, D>,
                         stream, "dequantize launch");
  });
}

}  // namespace kvq
