// Fused decode attention (cuda_attention.h); docs/CUDA.md "Kernels" has the
// design. One split kernel, instantiated per arithmetic (its Math policy:
// the tiles' element type and inner products), and one merge kernel, each
// compiled per supported head_dim (a template parameter: every division by
// head_dim in a loop is by a constant):
//
//   grid (splits, row tiles, tasks), 128 threads: block (s, r, t) computes
//   the partial (out, lse) of task t's query rows [16r, 16r + 16) over its
//   split s (hd::SplitBegin / SplitEnd: split_tokens keys from a page
//   start, sized at launch from the batch and the SM count). The block
//   walks its keys page by page: each page is copied whole into shared
//   memory with 16-byte cp.async (LDGSTS), the next page's copy in flight
//   while this one is read (double-buffered when two pages fit). Keys and
//   values are dequantized from the shared copy 32 keys at a time through
//   per-channel code positions and per-row parameter offsets computed once
//   (no division in the tile loops), RoPE is applied to pre-RoPE keys, then
//   the scores, the online softmax (a warp per 4 rows, lanes = the tile's
//   32 keys, max and sum by warp shuffles) and the value accumulation.
//     - SplitKernel<D, FloatMath>: fp32 CUDA-core math, for fp16/bf16/fp8/
//       int8 and anything the tensor-core math does not take.
//     - SplitKernel<D, MmaMath>: packed codes of <= 4 bits. Keys and values are
//       dequantized to fp16 (2 and 4 bits with uniform levels and fp16
//       parameters: the magic-number trick, one HSUB2 and one HFMA2 per
//       two elements, clamped to fp16's finite range), queries scaled by a
//       power of two into fp16's range, and QK^T and PV run as mma.sync
//       m16n8k16 with the 16 query rows as the MMA's M, fp32 accumulators.
//   MergeKernel, grid (rows, tasks): a row's split partials merged in one
//   step (hd::MergeWeight / MergedChannel), the splits' max and weight sum
//   by block reductions, a thread per four channels with 16-byte loads;
//   then the inverse Hadamard rotation, out and lse.
#include "kernels/cuda/cuda_attention.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/hd/attention_hd.h"
#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_info.h"
#include "kernels/cuda/kernel_head_dims.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

constexpr int kThreads = kAttentionThreads;  // 4 warps.
constexpr int kWarps = kThreads / 32;
constexpr int kRowTile = kAttentionRowTile;  // Query rows per block: the MMA's M.
constexpr int kKeyTile = kAttentionKeyTile;  // Keys per step: a lane per key in the softmax.
constexpr int kRowsPerWarp = kRowTile / kWarps;
// Four resident blocks per SM: caps the split kernels at 128 registers.
constexpr int kMinBlocks = 4;
constexpr int kHalfPad = 8;    // fp16 row padding: conflict-free fragment loads.
constexpr int kMaxSplits = 1024;      // The merge kernel keeps their weights in shared memory.
constexpr int kMinSplitTokens = 256;  // A split streams at least this many keys.
constexpr int kVector = kDeviceVector;
static_assert(kPageAlign % kVector == 0, "pages must start on a 16-byte boundary");

struct LaunchParams {
  const DeviceAttentionTask* tasks;
  int group_size;
  float softmax_scale;
  int split_tokens;
  int splits;      // Grid x: the partials' stride per task.
  int max_rows;    // The partials' stride per split.
  int page_buffer;   // Bytes of one staged page (the largest page_bytes).
  int page_buffers;  // 1 or 2 (double-buffered).
  float* partial_out;  // [task][split][row][head_dim]
  float* partial_lse;  // [task][split][row]
};


// Per-side lookups a block computes once: where each channel's code lies
// and its parameter group, and the sizes ParamsFrom needs.
template <int D>
struct SideTables {
  hd::CodePos pos[D];
  int16_t group[D];
};
struct SideConsts {
  int n = 0;             // L.ParamsPerEntry(S)
  int block_groups = 0;  // L.EntriesPerBlock(S) * n
};

template <int D>
__device__ void FillSideTables(const PageLayout& L, const SideLayout& S, SideTables<D>* tab) {
  if (!hd::HasParams(S)) return;
  for (int c = threadIdx.x; c < D; c += kThreads) {
    tab->pos[c] = hd::CodePosOf(D, S.bits, c);
    tab->group[c] = static_cast<int16_t>(hd::GroupOfChannel(S, c));
  }
}
__device__ __forceinline__ SideConsts ConstsOf(const PageLayout& L, const SideLayout& S) {
  SideConsts k;
  k.n = L.ParamsPerEntry(S);
  k.block_groups = L.EntriesPerBlock(S) * k.n;
  return k;
}

// The tile's page rows: their parameter entries (one division per row per
// tile, by blockDim threads, instead of one per element).
__device__ __forceinline__ void FillRowParams(const PageLayout& L, int row0, int n,
                                              hd::RowParams* rk, hd::RowParams* rv) {
  for (int j = threadIdx.x; j < n; j += kThreads) {
    rk[j] = hd::RowParamsOf(L, L.key, row0 + j);
    rv[j] = hd::RowParamsOf(L, L.value, row0 + j);
  }
}

// Element c of tile row j of one side in the stored basis, before
// outliers: from the staged page when `page` is set (row0 + j its row),
// else an fp16 sink or tail row from global memory.
template <int D>
__device__ __forceinline__ float TileElement(const DeviceStreamView& v, const SideLayout& S,
                                             const hd::SideExtras& extras,
                                             const SideTables<D>& tab, SideConsts k,
                                             const hd::RowParams* rp, const uint8_t* page,
                                             int row0, Side side, int t, int j, int c) {
  if (page != nullptr) {
    const uint8_t* code_row = PageLayout::CodeRow(page, S, row0 + j);
    if (!hd::HasParams(S)) return hd::DequantCode(S, code_row, c, hd::CodePos{}, hd::ScaleZero{}, extras);
    const hd::ScaleZero sz = hd::ParamsFrom(S, page, rp[j], tab.group[c], k.n, k.block_groups);
    return hd::DequantCode(S, code_row, c, tab.pos[c], sz, extras);
  }
  if (t < v.sink_tokens) {
    return hd::HalfToFloat((side == Side::kKey ? v.sink_k : v.sink_v)[static_cast<size_t>(t) * D + c]);
  }
  const int i = t - v.sink_tokens - v.quantized_tokens;
  return hd::HalfToFloat((side == Side::kKey ? v.tail_k : v.tail_v)[static_cast<size_t>(i) * D + c]);
}

// Calls put(j, c, value) for every outlier of the staged page's tile rows
// [row0, row0 + n) of one side (a thread per row: no two write one element).
template <int D, typename Put>
__device__ __forceinline__ void ForEachOutlier(const PageLayout& L, const SideLayout& S,
                                               const uint8_t* page, const hd::RowParams* rp,
                                               int row0, int n, Put put) {
  const int k = L.outliers_per_block;
  if (k == 0 || page == nullptr) return;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    const int block = rp[j].block;
    const uint8_t* table = page + S.outliers_offset + static_cast<size_t>(block) * 4 * k;
    const int in_block = row0 + j - block * L.block_tokens;
    for (int e = 0; e < k; ++e) {
      const int index = hd::LoadHalfBits(table + 2 * e);
      if (index / D != in_block) continue;
      put(j, index % D, hd::HalfToFloat(hd::LoadHalfBits(table + 2 * (k + e))));
    }
  }
}

// The block's query rows [row0, row0 + nrows) into q_f ([16][D] fp32),
// rotated forward when the stream rotates. The Walsh-Hadamard stages run
// their butterflies in parallel: each adds and subtracts the values the
// serial form would, so the bits are hd::HadamardForward's.
template <int D>
__device__ void LoadQueries(const DeviceAttentionTask& t, int group, int row0, int nrows,
                            float* q_f) {
  const float* signs = t.stream.rotation_signs;
  for (int e = threadIdx.x; e < kRowTile * D; e += kThreads) {
    const int r = e / D, c = e % D;
    float x = 0.0f;
    if (r < nrows) {
      const int row = row0 + r;
      x = t.q[static_cast<size_t>(row / group) * t.q_stride + static_cast<size_t>(row % group) * D + c];
      if (signs) x *= signs[c];
    }
    q_f[e] = x;
  }
  __syncthreads();
  if (signs == nullptr) return;
  WalshHadamardRows<D, kThreads>(q_f, nrows);
  const float norm = hd::HadamardNorm(D);
  for (int e = threadIdx.x; e < nrows * D; e += kThreads) q_f[e] *= norm;
  __syncthreads();
}

// Pair i's inverse frequency over the linear factor (hd::RopeInvFreq /
// linear_factor), once per block: the tile loop then divides by nothing.
__device__ void LoadInvFreq(const hd::RopeParams& rope, double* inv_freq) {
  for (int i = threadIdx.x; i < rope.rotary_dim / 2; i += kThreads) {
    inv_freq[i] = hd::RopeInvFreq(rope, i) / static_cast<double>(rope.linear_factor);
  }
}

// RoPE on tile rows [0, n) of keys in `x` (row stride `stride`): a warp per
// key, a lane per pair.
template <typename T>
__device__ void RopeTile(const hd::RopeParams& rope, const double* inv_freq, int t0, int n,
                         T* x, int stride) {
  if (rope.rotary_dim == 0) return;
  const int pairs = rope.rotary_dim / 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = warp; j < n; j += kWarps) {
    T* row = x + j * stride;
    for (int i = lane; i < pairs; i += 32) {
      float c, s, r0, r1;
      RopeCosSinOf(inv_freq[i], t0 + j, &c, &s);
      const int a = hd::RopeFirst(rope, i), b = hd::RopeSecond(rope, i);
      hd::RotatePair(static_cast<float>(row[a]), static_cast<float>(row[b]), c, s, &r0, &r1);
      row[a] = static_cast<T>(r0);
      row[b] = static_cast<T>(r1);
    }
  }
  __syncthreads();
}

// The online softmax of one tile, a warp per kRowsPerWarp rows and a lane
// per key: scores in p_s[r][32] become weights, rescale_s[r] the factor
// for the row's accumulator; the running max and sum stay in registers
// (m, l, the same in every lane). hd::SoftmaxPushTile's arithmetic, its
// max and sum taken by shuffles.
// With p_h set (the tensor-core kernel), the weights also go there as fp16
// (row stride p_h_stride).
__device__ __forceinline__ void SoftmaxTile(float* p_s, float* rescale_s, float* m, float* l,
                                            __half* p_h = nullptr, int p_h_stride = 0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int r = warp * kRowsPerWarp + rr;
    const float s = p_s[r * kKeyTile + lane];
    const float new_max = hd::Max(m[rr], WarpMax(s));
    float w = 0.0f, rescale = 1.0f;
    if (new_max != hd::NegInf()) {
      rescale = hd::Exp(m[rr] - new_max);
      w = hd::Exp(s - new_max);
      m[rr] = new_max;
    }
    l[rr] = l[rr] * rescale + WarpSum(w);
    p_s[r * kKeyTile + lane] = w;
    if (p_h != nullptr) p_h[r * p_h_stride + lane] = __float2half_rn(w);
    if (lane == 0) rescale_s[r] = rescale;
  }
}

// Shared memory of a split kernel: the page buffers first (16-byte
// aligned for cp.async), then the tables, then the math's tiles.
template <int D>
struct CommonSmem {
  SideTables<D> key_tab, value_tab;
  hd::RowParams key_rows[kKeyTile], value_rows[kKeyTile];
  double inv_freq[D / 2];
  float q_f[kRowTile * D];
  float p_s[kRowTile * kKeyTile];
  float rescale_s[kRowTile];
  float max_s[kRowTile];
  float sum_s[kRowTile];
  int visible_s[kRowTile];
};

size_t AlignVector(size_t n) { return (n + kVector - 1) / kVector * kVector; }

// The common preamble: tables, inverse frequencies, visibility, queries.
template <int D>
__device__ void Prepare(const LaunchParams& p, const DeviceAttentionTask& t, const BlockWork& w,
                        CommonSmem<D>* s) {
  const DeviceStreamView& v = t.stream;
  FillSideTables<D>(v.layout, v.layout.key, &s->key_tab);
  FillSideTables<D>(v.layout, v.layout.value, &s->value_tab);
  LoadInvFreq(v.rope, s->inv_freq);
  if (threadIdx.x < kRowTile) {
    s->visible_s[threadIdx.x] =
        threadIdx.x < w.nrows ? VisibleEnd(t, p.group_size, w.row0 + threadIdx.x) : w.s0;
  }
  LoadQueries<D>(t, p.group_size, w.row0, w.nrows, s->q_f);  // Ends with __syncthreads().
}

// Stores the rows' softmax state, the lse partials, and each row's output
// scale (1 / sum) in out_scale_s for every thread.
__device__ void FinishSoftmax(const LaunchParams& p, const BlockWork& w, const float* m,
                              const float* l, float* max_s, float* sum_s, float* out_scale_s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      max_s[warp * kRowsPerWarp + rr] = m[rr];
      sum_s[warp * kRowsPerWarp + rr] = l[rr];
    }
  }
  __syncthreads();
  if (threadIdx.x < kRowTile) {
    hd::SoftmaxState st;
    st.max = max_s[threadIdx.x];
    st.sum = sum_s[threadIdx.x];
    if (threadIdx.x < w.nrows) {
      p.partial_lse[PartialRow(p, blockIdx.z, blockIdx.x, w.row0 + threadIdx.x)] =
          hd::SoftmaxLse(st);
    }
    out_scale_s[threadIdx.x] = hd::SoftmaxOutScale(st);  // One division per row.
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------
// The split kernel's two arithmetics: its Math policy (SplitKernel<D, Math>).
//
// A Math<D> names its shared memory (Smem: CommonSmem<D> plus the tile's
// keys and values as k_tile / v_tile, row strides kKeyStride /
// kValueStride, elements made from floats by FromFloat) and holds each
// thread's output accumulators. Start(p, s) runs once after the common
// preamble (MmaMath: the queries to fp16), ZeroAccumulators after it; then
// per 32-key tile, between the kernel's barriers:
//   LoadTile    the tile's keys and values, dequantized (before outliers
//               and RoPE, which the kernel applies to k_tile / v_tile);
//   Scores      p_s[r][j] = softmax_scale * q_r . k_j for the keys row r
//               sees, -inf for the others;
//   Softmax     SoftmaxTile over p_s (and the weights in the form
//               Accumulate reads);
//   Accumulate  acc = acc * rescale + P V.
// Store writes acc / sum as the split's partial outputs.
// ---------------------------------------------------------------------------

// fp32 CUDA-core math: fp16/bf16/fp8/int8 and whatever MmaMath does not take.
template <int D>
struct FloatSmem : CommonSmem<D> {
  static constexpr int kKeyStride = D + 1;  // Padded: the score loop reads along key rows.
  static constexpr int kValueStride = D;
  // Output accumulators per thread; above 16 (head_dim 256) they live in
  // shared memory (each element owned by one thread) instead of registers,
  // which keeps the kernel within 128 registers without spilling.
  static constexpr int kAcc = kRowTile * D / kThreads;
  static constexpr bool kAccShared = kAcc > 16;
  float k_tile[kKeyTile * kKeyStride];
  float v_tile[kKeyTile * kValueStride];
  float acc_s[kAccShared ? kRowTile * D : 1];
};
template <int D>
struct FloatMath {
  using Smem = FloatSmem<D>;
  static constexpr int kKeyStride = Smem::kKeyStride;
  static constexpr int kAcc = Smem::kAcc;
  static constexpr bool kAccShared = Smem::kAccShared;

  Smem* s = nullptr;
  float acc[kAcc];  // Unused (and allocated no register) when kAccShared.

  __device__ __forceinline__ void Start(const LaunchParams&, Smem* smem) { s = smem; }
  __device__ __forceinline__ void ZeroAccumulators() {
#pragma unroll
    for (int k = 0; k < kAcc; ++k) {
      if constexpr (kAccShared) {
        s->acc_s[threadIdx.x + k * kThreads] = 0.0f;  // Read only by this thread.
      } else {
        acc[k] = 0.0f;
      }
    }
  }
  static __device__ __forceinline__ float FromFloat(float x) { return x; }

  __device__ __forceinline__ void LoadTile(const DeviceStreamView& v, SideConsts kc, SideConsts vc,
                                           const uint8_t* page, int row0, int t0, int n) {
    const PageLayout& L = v.layout;
    for (int e = threadIdx.x; e < n * D; e += kThreads) {
      const int j = e / D, c = e % D;
      s->k_tile[j * kKeyStride + c] = TileElement<D>(v, L.key, v.key_extras, s->key_tab, kc,
                                                     s->key_rows, page, row0, Side::kKey, t0 + j,
                                                     j, c);
      s->v_tile[e] = TileElement<D>(v, L.value, v.value_extras, s->value_tab, vc, s->value_rows,
                                    page, row0, Side::kValue, t0 + j, j, c);
    }
  }

  __device__ __forceinline__ void Scores(const LaunchParams& p, const BlockWork& w, int t0, int n) {
    for (int e = threadIdx.x; e < kRowTile * kKeyTile; e += kThreads) {
      const int r = e / kKeyTile, j = e % kKeyTile;
      float score = hd::NegInf();
      if (r < w.nrows && j < n && t0 + j < s->visible_s[r]) {
        score = hd::Dot(s->q_f + r * D, s->k_tile + j * kKeyStride, D) * p.softmax_scale;
      }
      s->p_s[e] = score;
    }
  }

  __device__ __forceinline__ void Softmax(float* m, float* l) {
    SoftmaxTile(s->p_s, s->rescale_s, m, l);
  }

  __device__ __forceinline__ void Accumulate(int n) {
#pragma unroll
    for (int k = 0; k < kAcc; ++k) {
      const int e = threadIdx.x + k * kThreads;
      const int r = e / D, c = e % D;
      float a = (kAccShared ? s->acc_s[e] : acc[k]) * s->rescale_s[r];
      for (int j = 0; j < n; ++j) a += s->p_s[r * kKeyTile + j] * s->v_tile[j * D + c];
      if constexpr (kAccShared) {
        s->acc_s[e] = a;
      } else {
        acc[k] = a;
      }
    }
  }

  __device__ __forceinline__ void Store(const LaunchParams& p, const BlockWork& w) {
#pragma unroll
    for (int k = 0; k < kAcc; ++k) {
      const int e = threadIdx.x + k * kThreads;
      const int r = e / D, c = e % D;
      if (r < w.nrows) {
        p.partial_out[PartialRow(p, blockIdx.z, blockIdx.x, w.row0 + r) * D + c] =
            (kAccShared ? s->acc_s[e] : acc[k]) * s->rescale_s[r];
      }
    }
  }
};

// Tensor-core math (UseTensorCores: packed codes of <= 4 bits on both
// sides): fp16 tiles, QK^T and PV as mma.sync m16n8k16 with the 16 query
// rows as M and fp32 accumulators.
__device__ __forceinline__ void Mma16816(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t Load32(const __half* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ uint32_t Pack(__half lo, __half hi) {
  return static_cast<uint32_t>(__half_as_ushort(lo)) |
         (static_cast<uint32_t>(__half_as_ushort(hi)) << 16);
}
__device__ __forceinline__ __half2 ClampHalf2(__half2 x) {
  const __half2 lim = __float2half2_rn(hd::kHalfMax);
  return __hmin2(__hmax2(x, __hneg2(lim)), lim);
}

// Channels c..c+3 of a staged page row (hd::QuadChannel) as four fp16
// values. Each code goes into the mantissa of 1024.0 (0x6400 | code):
// byte_perm builds two such half2 from four code bytes, HSUB2 takes 1024
// off (exactly), HFMA2 applies scale and zero; the result is clamped to
// fp16's finite range.
__device__ __forceinline__ void DequantQuad(const SideLayout& S, const uint8_t* page,
                                            const uint8_t* code_row, int m, int quad,
                                            const hd::QuadParams& at, __half2* out) {
  const uint32_t codes = hd::QuadCodes(code_row, S.bits, m, quad);
  constexpr uint32_t kMagicBytes = 0x01010101u * (hd::kHalfMagic1024 >> 8);  // 0x64 in each byte.
  const uint32_t lo_bits = __byte_perm(codes, kMagicBytes, 0x5140);
  const uint32_t hi_bits = __byte_perm(codes, kMagicBytes, 0x5342);
  const __half2 bias = __float2half2_rn(1024.0f);
  const __half2 lo = __hsub2(*reinterpret_cast<const __half2*>(&lo_bits), bias);
  const __half2 hi = __hsub2(*reinterpret_cast<const __half2*>(&hi_bits), bias);
  const __half* scale = reinterpret_cast<const __half*>(page + at.scale);
  const __half* zero = reinterpret_cast<const __half*>(page + at.zero);
  __half2 scale_lo, scale_hi, zero_lo, zero_hi;
  if (at.per_channel) {
    scale_lo = *reinterpret_cast<const __half2*>(scale);
    scale_hi = *reinterpret_cast<const __half2*>(scale + 2);
    zero_lo = *reinterpret_cast<const __half2*>(zero);
    zero_hi = *reinterpret_cast<const __half2*>(zero + 2);
  } else {
    scale_lo = scale_hi = __half2half2(*scale);
    zero_lo = zero_hi = __half2half2(*zero);
  }
  out[0] = ClampHalf2(__hfma2(lo, scale_lo, zero_lo));
  out[1] = ClampHalf2(__hfma2(hi, scale_hi, zero_hi));
}

// Tile rows [0, n) of one side as fp16 rows (stride D + kHalfPad); rows
// n..kKeyTile are zeroed so that a zero weight never meets a stale NaN.
template <int D>
__device__ void LoadTileHalf(const DeviceStreamView& v, const SideLayout& S,
                             const hd::SideExtras& extras, const SideTables<D>& tab,
                             SideConsts k, const hd::RowParams* rp, const uint8_t* page,
                             int row0, Side side, int t0, int n, __half* dst) {
  constexpr int stride = D + kHalfPad;
  constexpr int quads = D / 4;
  const bool fast = page != nullptr && hd::QuadDequantTakes(v.layout, S, extras);
  for (int e = threadIdx.x; e < kKeyTile * quads; e += kThreads) {
    const int j = e / quads, qi = e % quads;
    __half2* out = reinterpret_cast<__half2*>(dst + j * stride + 4 * qi);
    if (j >= n) {
      out[0] = out[1] = __float2half2_rn(0.0f);
      continue;
    }
    if (fast) {
      // Quad qi's plane and word (hd::QuadOf, by constants), and its
      // channels, which are not 4 * qi: store them where they belong.
      const int plane_quads = S.bits == 4 ? D / 8 : D / 16;
      const int m = S.bits == 4 ? qi / (D / 8) : qi / (D / 16);
      const int quad = qi - m * plane_quads;
      const int c = m * (D * S.bits / 8) + 4 * quad;
      const hd::QuadParams at = hd::QuadParamsFrom(S, rp[j], c, tab.group[c], k.n);
      __half2 vals[2];
      DequantQuad(S, page, PageLayout::CodeRow(page, S, row0 + j), m, quad, at, vals);
      __half2* to = reinterpret_cast<__half2*>(dst + j * stride + c);
      to[0] = vals[0];
      to[1] = vals[1];
      continue;
    }
    const int c = 4 * qi;
    float x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = hd::ClampToHalfRange(
          TileElement<D>(v, S, extras, tab, k, rp, page, row0, side, t0 + j, j, c + i));
    }
    out[0] = __floats2half2_rn(x[0], x[1]);
    out[1] = __floats2half2_rn(x[2], x[3]);
  }
}

template <int D>
struct MmaSmem : CommonSmem<D> {
  static constexpr int kKeyStride = D + kHalfPad;
  static constexpr int kValueStride = kKeyStride;
  static constexpr int kProbStride = kKeyTile + kHalfPad;
  float score_scale_s[kRowTile];
  __half q_h[kRowTile * kKeyStride];
  __half k_tile[kKeyTile * kKeyStride];
  __half v_tile[kKeyTile * kValueStride];
  __half p_h[kRowTile * kProbStride];
};
template <int D>
struct MmaMath {
  using Smem = MmaSmem<D>;
  static constexpr int kHalfStride = Smem::kKeyStride;  // Keys, values and queries.
  static constexpr int kProbStride = Smem::kProbStride;
  static constexpr int kTiles = D / (8 * kWarps);  // n8 output tiles per warp.

  Smem* s = nullptr;
  const int warp, lane;
  const int g, tq;  // The MMA fragments' row group and column pair.
  // Output accumulators: warp w owns channels [w * D / 4, (w + 1) * D / 4),
  // kTiles n8 tiles of 4 floats per lane (rows g and g + 8).
  float o[kTiles][4];

  __device__ __forceinline__ MmaMath()
      : warp(threadIdx.x / 32), lane(threadIdx.x % 32), g(lane / 4), tq(lane % 4) {}
  // Queries to fp16, each row scaled into fp16's range (hd::HalfQueryScale)
  // and its scores scaled back: a warp per kRowsPerWarp rows.
  __device__ __forceinline__ void Start(const LaunchParams& p, Smem* smem) {
    s = smem;
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      float max_abs = 0.0f;
      for (int c = lane; c < D; c += 32) max_abs = hd::Max(max_abs, fabsf(s->q_f[r * D + c]));
      const float qs = hd::HalfQueryScale(WarpMax(max_abs));
      for (int c = lane; c < D; c += 32) {
        s->q_h[r * kHalfStride + c] = __float2half_rn(s->q_f[r * D + c] * qs);
      }
      if (lane == 0) s->score_scale_s[r] = p.softmax_scale * hd::HalfQueryUnscale(qs);
    }
    __syncthreads();
  }
  __device__ __forceinline__ void ZeroAccumulators() {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  }
  static __device__ __forceinline__ __half FromFloat(float x) { return __float2half_rn(x); }

  __device__ __forceinline__ void LoadTile(const DeviceStreamView& v, SideConsts kc, SideConsts vc,
                                           const uint8_t* page, int row0, int t0, int n) {
    const PageLayout& L = v.layout;
    LoadTileHalf<D>(v, L.key, v.key_extras, s->key_tab, kc, s->key_rows, page, row0, Side::kKey,
                    t0, n, s->k_tile);
    LoadTileHalf<D>(v, L.value, v.value_extras, s->value_tab, vc, s->value_rows, page, row0,
                    Side::kValue, t0, n, s->v_tile);
  }

  // S = Q K^T: warp w computes keys [8w, 8w + 8) for all 16 rows.
  __device__ __forceinline__ void Scores(const LaunchParams&, const BlockWork& w, int t0, int n) {
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const __half* krow = s->k_tile + (8 * warp + g) * kHalfStride;
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
      uint32_t a[4], b[2];
      a[0] = Load32(s->q_h + g * kHalfStride + k0 + 2 * tq);
      a[1] = Load32(s->q_h + (g + 8) * kHalfStride + k0 + 2 * tq);
      a[2] = Load32(s->q_h + g * kHalfStride + k0 + 2 * tq + 8);
      a[3] = Load32(s->q_h + (g + 8) * kHalfStride + k0 + 2 * tq + 8);
      b[0] = Load32(krow + k0 + 2 * tq);
      b[1] = Load32(krow + k0 + 2 * tq + 8);
      Mma16816(sc, a, b);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = g + (i / 2) * 8;
      const int j = 8 * warp + 2 * tq + (i % 2);
      const bool seen = r < w.nrows && j < n && t0 + j < s->visible_s[r];
      s->p_s[r * kKeyTile + j] = seen ? sc[i] * s->score_scale_s[r] : hd::NegInf();
    }
  }

  __device__ __forceinline__ void Softmax(float* m, float* l) {
    SoftmaxTile(s->p_s, s->rescale_s, m, l, s->p_h, kProbStride);
  }

  // O = O * rescale + P V: warp w's channel tiles, k over the 32 keys.
  __device__ __forceinline__ void Accumulate(int) {
    const float rescale_lo = s->rescale_s[g], rescale_hi = s->rescale_s[g + 8];
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      o[i][0] *= rescale_lo;
      o[i][1] *= rescale_lo;
      o[i][2] *= rescale_hi;
      o[i][3] *= rescale_hi;
    }
#pragma unroll
    for (int k0 = 0; k0 < kKeyTile; k0 += 16) {
      uint32_t a[4];
      a[0] = Load32(s->p_h + g * kProbStride + k0 + 2 * tq);
      a[1] = Load32(s->p_h + (g + 8) * kProbStride + k0 + 2 * tq);
      a[2] = Load32(s->p_h + g * kProbStride + k0 + 2 * tq + 8);
      a[3] = Load32(s->p_h + (g + 8) * kProbStride + k0 + 2 * tq + 8);
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const int col = warp * (D / kWarps) + 8 * i + g;
        const __half* vk = s->v_tile + (k0 + 2 * tq) * kHalfStride + col;
        uint32_t b[2];
        b[0] = Pack(vk[0], vk[kHalfStride]);
        b[1] = Pack(vk[8 * kHalfStride], vk[9 * kHalfStride]);
        Mma16816(o[i], a, b);
      }
    }
  }

  __device__ __forceinline__ void Store(const LaunchParams& p, const BlockWork& w) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = g + (e / 2) * 8;
        if (r >= w.nrows) continue;
        const int c = warp * (D / kWarps) + 8 * i + 2 * tq + (e % 2);
        p.partial_out[PartialRow(p, blockIdx.z, blockIdx.x, w.row0 + r) * D + c] =
            o[i][e] * s->rescale_s[r];
      }
    }
  }
};

// ---------------------------------------------------------------------------
// Split kernel: the block's keys walked tile by tile, Math's inner products.
// ---------------------------------------------------------------------------
template <int D, template <int> class Math>
__global__ void __launch_bounds__(kThreads, kMinBlocks) SplitKernel(LaunchParams p) {
  const DeviceAttentionTask& t = p.tasks[blockIdx.z];
  BlockWork w;
  if (!BlockWorkOf(p, t, &w) || !PagesFit(p, t, w, D)) return;
  const DeviceStreamView& v = t.stream;
  const PageLayout& L = v.layout;
  using Smem = typename Math<D>::Smem;
  constexpr int ks = Smem::kKeyStride, vs = Smem::kValueStride;
  Math<D> math;

  extern __shared__ __align__(16) unsigned char smem[];
  uint8_t* buffers = smem;
  auto* s = reinterpret_cast<Smem*>(smem + static_cast<size_t>(p.page_buffers) * p.page_buffer);
  Prepare<D>(p, t, w, s);
  const SideConsts kc = ConstsOf(L, L.key), vc = ConstsOf(L, L.value);
  math.Start(p, s);

  float m[kRowsPerWarp], l[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = hd::NegInf();
    l[rr] = 0.0f;
  }
  math.ZeroAccumulators();

  WalkKeys(p, v, w, buffers, [&](int t0, int n, const uint8_t* page, int row0) {
    if (page != nullptr) {
      FillRowParams(L, row0, n, s->key_rows, s->value_rows);
      __syncthreads();
    }
    math.LoadTile(v, kc, vc, page, row0, t0, n);
    __syncthreads();
    if (L.outliers_per_block > 0 && page != nullptr) {
      ForEachOutlier<D>(L, L.key, page, s->key_rows, row0, n, [&](int j, int c, float x) {
        s->k_tile[j * ks + c] = Math<D>::FromFloat(x);
      });
      ForEachOutlier<D>(L, L.value, page, s->value_rows, row0, n, [&](int j, int c, float x) {
        s->v_tile[j * vs + c] = Math<D>::FromFloat(x);
      });
      __syncthreads();
    }
    RopeTile(v.rope, s->inv_freq, t0, n, s->k_tile, ks);
    math.Scores(p, w, t0, n);
    __syncthreads();
    math.Softmax(m, l);
    __syncthreads();
    math.Accumulate(n);
    __syncthreads();
  });

  FinishSoftmax(p, w, m, l, s->max_s, s->sum_s, s->rescale_s);
  math.Store(p, w);
}

// ---------------------------------------------------------------------------
// Merge kernel: grid (max_rows, tasks), one row per block.
// ---------------------------------------------------------------------------
template <int D>
__global__ void __launch_bounds__(kThreads) MergeKernel(LaunchParams p) {
  const int row = blockIdx.x;
  const DeviceAttentionTask& t = p.tasks[blockIdx.y];
  if (row >= t.num_queries * p.group_size) return;
  MergeRow<D, kThreads, kMaxSplits>(p, t, blockIdx.y, row);
}

// ---------------------------------------------------------------------------
// Launch.
// ---------------------------------------------------------------------------
int PageBuffer(const DecodeAttentionShape& shape) {
  return static_cast<int>(AlignVector(static_cast<size_t>(std::max(shape.max_page_bytes, 0))));
}

template <int D>
size_t KernelSmem(bool tensor_cores, int page_buffer, int buffers) {
  return static_cast<size_t>(page_buffer) * buffers +
         (tensor_cores ? sizeof(MmaSmem<D>) : sizeof(FloatSmem<D>));
}

template <int D>
absl::Status LaunchFor(const DecodeAttentionShape& shape, LaunchParams p, cudaStream_t stream) {
  KVQ_ASSIGN_OR_RETURN(const int max_smem, MaxSharedMemoryPerBlock());
  p.page_buffers = 2;
  size_t smem = KernelSmem<D>(shape.tensor_cores, p.page_buffer, 2);
  if (smem > static_cast<size_t>(max_smem)) {
    p.page_buffers = 1;
    smem = KernelSmem<D>(shape.tensor_cores, p.page_buffer, 1);
  }
  if (smem > static_cast<size_t>(max_smem)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_page_bytes ", shape.max_page_bytes, " needs ", smem,
        " bytes of shared memory per block with head_dim ", D, "; the device has ", max_smem));
  }
  const int row_tiles = (shape.max_rows + kRowTile - 1) / kRowTile;
  const dim3 grid(p.splits, row_tiles, shape.num_tasks);
  auto kernel = shape.tensor_cores ? SplitKernel<D, MmaMath> : SplitKernel<D, FloatMath>;
  KVQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem)),
                           "decode attention: shared memory");
  kernel<<<grid, kThreads, smem, stream>>>(p);
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "decode attention split kernel launch");
  MergeKernel<D><<<dim3(shape.max_rows, shape.num_tasks), kThreads, 0, stream>>>(p);
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "decode attention merge kernel launch");
  return absl::OkStatus();
}

}  // namespace

bool DecodeAttentionTakesHeadDim(int head_dim) { return KernelTakesHeadDim(head_dim); }

bool UseTensorCores(const PageLayout& layout) {
  auto packed_small = [](const SideLayout& s) {
    return s.format == CodeFormat::kPacked && s.bits <= 4;
  };
  return packed_small(layout.key) && packed_small(layout.value) &&
         layout.head_dim % (8 * kWarps) == 0 && layout.head_dim % 16 == 0 &&
         layout.head_dim <= kMaxHeadDim;
}

int DecodeAttentionSplitTokens(const DecodeAttentionShape& shape) {
  const int pt = std::max(shape.max_page_tokens, 1);
  const int max_keys = std::max(shape.max_keys, 1);
  const long long blocks = static_cast<long long>(std::max(shape.num_tasks, 1)) *
                           ((std::max(shape.max_rows, 1) + kRowTile - 1) / kRowTile);
  // Two blocks per SM: one streaming while the other computes.
  const long long target = 2LL * std::max(shape.sm_count, 1);
  const int wanted = blocks >= target ? 1 : static_cast<int>((target + blocks - 1) / blocks);
  int tokens = std::max((max_keys + wanted - 1) / wanted, kMinSplitTokens);
  // At most kMaxSplits splits, the origin's partial page included.
  tokens = std::max(tokens, (max_keys + pt - 1 + kMaxSplits - 1) / kMaxSplits);
  return hd::SplitTokensAtLeast(tokens, pt);
}

int DecodeAttentionSplits(const DecodeAttentionShape& shape) {
  const int pt = std::max(shape.max_page_tokens, 1);
  const int st = DecodeAttentionSplitTokens(shape);
  return std::max(1, (std::max(shape.max_keys, 0) + pt - 1 + st - 1) / st);
}

size_t DecodeAttentionWorkspaceBytes(const DecodeAttentionShape& shape) {
  const size_t rows = static_cast<size_t>(std::max(shape.num_tasks, 0)) *
                      DecodeAttentionSplits(shape) * std::max(shape.max_rows, 0);
  return rows * (static_cast<size_t>(std::max(shape.head_dim, 0)) + 1) * sizeof(float);
}

absl::Status LaunchDecodeAttention(const DeviceAttentionTask* tasks,
                                   const DecodeAttentionShape& shape, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream) {
  if (shape.num_tasks == 0) return absl::OkStatus();
  if (shape.num_tasks < 0 || shape.num_tasks > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tasks must be in [0, 65535], got ", shape.num_tasks));
  }
  if (absl::Status st = CheckKernelHeadDim("head_dim", shape.head_dim); !st.ok()) return st;
  if (shape.group_size < 1 || shape.group_size > kMaxAttentionGroup) {
    return absl::InvalidArgumentError(absl::StrCat("group_size must be in [1, ",
                                                   kMaxAttentionGroup, "], got ", shape.group_size));
  }
  if (!(shape.softmax_scale > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("softmax_scale must be resolved to > 0, got ", shape.softmax_scale));
  }
  if (shape.max_rows < 1 || shape.max_keys < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_rows must be >= 1 (got ", shape.max_rows,
                                                   ") and max_keys >= 0 (got ", shape.max_keys, ")"));
  }
  if (shape.max_rows > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_rows must be at most 65535, got ", shape.max_rows));
  }
  if (shape.sm_count < 1 || shape.max_page_tokens < 1 || shape.max_page_bytes < 0 ||
      shape.max_page_bytes % kVector != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sm_count (", shape.sm_count, ") and max_page_tokens (", shape.max_page_tokens,
        ") must be >= 1 and max_page_bytes (", shape.max_page_bytes,
        ") a non-negative multiple of ", kVector));
  }
  const size_t need = DecodeAttentionWorkspaceBytes(shape);
  if (workspace == nullptr || workspace_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat("workspace must hold ", need,
                                                   " bytes, got ", workspace_bytes));
  }
  if (reinterpret_cast<uintptr_t>(workspace) % kVector != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace must be ", kVector, "-byte aligned (the merge reads float4)"));
  }
  LaunchParams p;
  p.tasks = tasks;
  p.group_size = shape.group_size;
  p.softmax_scale = shape.softmax_scale;
  p.split_tokens = DecodeAttentionSplitTokens(shape);
  p.splits = DecodeAttentionSplits(shape);
  p.max_rows = shape.max_rows;
  p.page_buffer = PageBuffer(shape);
  p.page_buffers = 2;
  p.partial_out = static_cast<float*>(workspace);
  p.partial_lse = p.partial_out +
                  static_cast<size_t>(shape.num_tasks) * p.splits * shape.max_rows * shape.head_dim;
  return WithKernelHeadDim(shape.head_dim, [&](auto dim) {
    return LaunchFor<decltype(dim)::value>(shape, p, stream);
  });
}

}  // namespace kvq
