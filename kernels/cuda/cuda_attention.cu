// Fused decode attention (cuda_attention.h). Two split kernels, one per
// arithmetic, and one merge kernel:
//
//   grid (splits, row tiles, tasks), 128 threads: block (s, r, t) computes
//   the partial (out, lse) of task t's query rows [16r, 16r + 16) over its
//   keys [key_begin + 256 s, +256), 32 keys at a time: the tile's keys and
//   values are dequantized into shared memory once for all 16 rows (the
//   GQA group: every query head of a KV head reads each element once), RoPE
//   is applied to pre-RoPE keys there, then scores, the online softmax
//   (hd::SoftmaxPushTile) and the value accumulation.
//     - SplitKernelFloat: fp32 CUDA-core math, for fp16/bf16/fp8/int8 and
//       anything the tensor-core kernel does not take.
//     - SplitKernelMma: packed codes of <= 4 bits. Keys and values are
//       dequantized to fp16 (2 and 4 bits with uniform levels and fp16
//       parameters: the magic-number trick, one HSUB2 and one HFMA2 per
//       two elements), and QK^T and PV run as mma.sync m16n8k16 with the 16
//       query rows as the MMA's M, fp32 accumulators.
//   MergeKernel, grid (rows, tasks): folds a row's split partials with
//   hd::MergeWeightsOf / hd::MergeChannel (MergeAttention's arithmetic),
//   undoes the Hadamard rotation and writes out and lse.
#include "kernels/cuda/cuda_attention.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/hd/attention_hd.h"
#include "kernels/cuda/cuda_status.h"

namespace kvq {
namespace {

constexpr int kThreads = 128;  // 4 warps.
constexpr int kWarps = kThreads / 32;
constexpr int kRowTile = 16;   // Query rows per block: the MMA's M.
constexpr int kKeyTile = 32;   // Keys per step: one n8 slice per warp.
constexpr int kSplit = hd::kAttentionSplitTokens;
// fp32 accumulators per thread in the float kernel: 16 rows x 256 channels.
constexpr int kAccPerThread = kRowTile * kMaxHeadDim / kThreads;
constexpr int kHalfPad = 8;    // fp16 row padding: conflict-free fragment loads.

struct LaunchParams {
  const DeviceAttentionTask* tasks;
  int head_dim;
  int group_size;
  float softmax_scale;
  int splits;    // Grid x: the partials' stride per task.
  int max_rows;  // The partials' stride per split.
  float* partial_out;  // [task][split][row][head_dim]
  float* partial_lse;  // [task][split][row]
};

__device__ __forceinline__ size_t PartialRow(const LaunchParams& p, int task, int split, int row) {
  return (static_cast<size_t>(task) * p.splits + split) * p.max_rows + row;
}

// Key end query row `row` of the task sees.
__device__ __forceinline__ int VisibleEnd(const DeviceAttentionTask& t, int group, int row) {
  if (t.q_positions == nullptr) return t.key_end;
  return min(t.key_end, t.q_positions[row / group] + 1);
}

// Element (t, c) of one side before outliers (stored basis, no RoPE).
__device__ __forceinline__ float ElementAt(const DeviceStreamView& v, Side side, int t, int c) {
  const int d = v.layout.head_dim;
  if (t < v.sink_tokens) {
    return hd::HalfToFloat((side == Side::kKey ? v.sink_k : v.sink_v)[static_cast<size_t>(t) * d + c]);
  }
  if (t < v.sink_tokens + v.quantized_tokens) {
    const int q = t - v.page_base;
    return hd::DequantElement(v.layout, v.layout.side(side), v.pages[q / v.layout.page_tokens],
                              q % v.layout.page_tokens, c, hd::ExtrasOf(v, side));
  }
  const int i = t - v.sink_tokens - v.quantized_tokens;
  return hd::HalfToFloat((side == Side::kKey ? v.tail_k : v.tail_v)[static_cast<size_t>(i) * d + c]);
}

// Calls put(j, c, value) for every outlier of tile keys [t0, t0 + n) of
// one side (the block's threads share the tokens; rows are distinct, so
// no two threads write one element).
template <typename Put>
__device__ __forceinline__ void ForEachOutlier(const DeviceStreamView& v, Side side, int t0, int n,
                                               Put put) {
  const PageLayout& L = v.layout;
  if (L.outliers_per_block == 0) return;
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const int t = t0 + j;
    if (t < v.sink_tokens || t >= v.sink_tokens + v.quantized_tokens) continue;
    const int q = t - v.page_base;
    const uint8_t* page = v.pages[q / L.page_tokens];
    const int row = q % L.page_tokens;
    const int block = row / L.block_tokens;
    const uint8_t* table =
        page + S.outliers_offset + static_cast<size_t>(block) * 4 * L.outliers_per_block;
    for (int e = 0; e < L.outliers_per_block; ++e) {
      const int index = hd::LoadHalfBits(table + 2 * e);
      if (block * L.block_tokens + index / d != row) continue;
      put(j, index % d, hd::HalfToFloat(hd::LoadHalfBits(table + 2 * (L.outliers_per_block + e))));
    }
  }
}

// The block's query rows [row0, row0 + nrows) into q (stride `stride`),
// as fp32 rows of head_dim, rotated forward when the stream rotates.
// The Walsh-Hadamard stages run their butterflies in parallel: each
// butterfly adds and subtracts the values the serial form would, so the
// bits are hd::HadamardForward's.
__device__ void LoadQueries(const DeviceAttentionTask& t, int group, int row0, int nrows,
                            float* q_f) {
  const int d = t.stream.layout.head_dim;
  const float* signs = t.stream.rotation_signs;
  for (int e = threadIdx.x; e < nrows * d; e += blockDim.x) {
    const int r = e / d, c = e % d;
    const int row = row0 + r;
    const float x = t.q[static_cast<size_t>(row / group) * t.q_stride +
                        static_cast<size_t>(row % group) * d + c];
    q_f[e] = signs ? x * signs[c] : x;
  }
  __syncthreads();
  if (signs == nullptr) return;
  const int half = d / 2;
  for (int len = 1; len < d; len <<= 1) {
    for (int e = threadIdx.x; e < nrows * half; e += blockDim.x) {
      const int r = e / half, k = e % half;
      float* x = q_f + static_cast<size_t>(r) * d;
      const int j = (k / len) * 2 * len + (k % len);
      const float a = x[j], b = x[j + len];
      x[j] = a + b;
      x[j + len] = a - b;
    }
    __syncthreads();
  }
  const float norm = hd::HadamardNorm(d);
  for (int e = threadIdx.x; e < nrows * d; e += blockDim.x) q_f[e] *= norm;
  __syncthreads();
}

__device__ void LoadInvFreq(const hd::RopeParams& rope, double* inv_freq) {
  for (int i = threadIdx.x; i < rope.rotary_dim / 2; i += blockDim.x) {
    inv_freq[i] = hd::RopeInvFreq(rope, i);
  }
}

// The per-block preamble both split kernels share. False when the block
// has nothing to do (its split or rows lie outside its task).
struct BlockWork {
  int row0 = 0, nrows = 0;
  int s0 = 0, s1 = 0;  // The split's keys.
  int kv_end = 0;      // Past the last key any of the block's rows sees.
};
__device__ bool BlockWorkOf(const LaunchParams& p, const DeviceAttentionTask& t, BlockWork* w) {
  const int rows = t.num_queries * p.group_size;
  w->row0 = blockIdx.y * kRowTile;
  if (w->row0 >= rows) return false;
  w->nrows = min(kRowTile, rows - w->row0);
  w->s0 = t.key_begin + blockIdx.x * kSplit;
  if (w->s0 >= t.key_end) return false;
  w->s1 = min(t.key_end, w->s0 + kSplit);
  int last = w->s0;
  for (int r = 0; r < w->nrows; ++r) last = max(last, VisibleEnd(t, p.group_size, w->row0 + r));
  w->kv_end = min(w->s1, last);
  return true;
}

// ---------------------------------------------------------------------------
// fp32 split kernel.
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) SplitKernelFloat(LaunchParams p) {
  const DeviceAttentionTask& t = p.tasks[blockIdx.z];
  BlockWork w;
  if (!BlockWorkOf(p, t, &w)) return;
  const DeviceStreamView& v = t.stream;
  const int d = p.head_dim;
  const int ks = d + 1;  // Padded key rows: the score loop reads along them.

  extern __shared__ __align__(16) unsigned char smem[];
  double* inv_freq = reinterpret_cast<double*>(smem);
  float* q_s = reinterpret_cast<float*>(inv_freq + kMaxHeadDim / 2);
  float* k_s = q_s + kRowTile * d;
  float* v_s = k_s + kKeyTile * ks;
  float* p_s = v_s + kKeyTile * d;
  float* max_s = p_s + kRowTile * kKeyTile;
  float* sum_s = max_s + kRowTile;
  float* rescale_s = sum_s + kRowTile;
  int* visible_s = reinterpret_cast<int*>(rescale_s + kRowTile);

  LoadInvFreq(v.rope, inv_freq);
  if (threadIdx.x < kRowTile) {
    max_s[threadIdx.x] = hd::NegInf();
    sum_s[threadIdx.x] = 0.0f;
    visible_s[threadIdx.x] =
        threadIdx.x < w.nrows ? VisibleEnd(t, p.group_size, w.row0 + threadIdx.x) : w.s0;
  }
  LoadQueries(t, p.group_size, w.row0, w.nrows, q_s);

  float acc[kAccPerThread];
#pragma unroll
  for (int k = 0; k < kAccPerThread; ++k) acc[k] = 0.0f;

  for (int t0 = w.s0; t0 < w.kv_end; t0 += kKeyTile) {
    const int n = min(kKeyTile, w.kv_end - t0);
    for (int e = threadIdx.x; e < n * d; e += blockDim.x) {
      const int j = e / d, c = e % d;
      k_s[j * ks + c] = ElementAt(v, Side::kKey, t0 + j, c);
      v_s[e] = ElementAt(v, Side::kValue, t0 + j, c);
    }
    __syncthreads();
    ForEachOutlier(v, Side::kKey, t0, n, [&](int j, int c, float x) { k_s[j * ks + c] = x; });
    ForEachOutlier(v, Side::kValue, t0, n, [&](int j, int c, float x) { v_s[j * d + c] = x; });
    __syncthreads();
    if (v.rope.rotary_dim > 0) {
      const int pairs = v.rope.rotary_dim / 2;
      for (int e = threadIdx.x; e < n * pairs; e += blockDim.x) {
        const int j = e / pairs, i = e % pairs;
        float c, s;
        hd::RopeCosSin(v.rope, inv_freq[i], t0 + j, &c, &s);
        float* x = k_s + j * ks;
        hd::RotatePair(x[hd::RopeFirst(v.rope, i)], x[hd::RopeSecond(v.rope, i)], c, s,
                       &x[hd::RopeFirst(v.rope, i)], &x[hd::RopeSecond(v.rope, i)]);
      }
      __syncthreads();
    }
    for (int e = threadIdx.x; e < kRowTile * kKeyTile; e += blockDim.x) {
      const int r = e / kKeyTile, j = e % kKeyTile;
      float score = hd::NegInf();
      if (r < w.nrows && j < n && t0 + j < visible_s[r]) {
        score = hd::Dot(q_s + r * d, k_s + j * ks, d) * p.softmax_scale;
      }
      p_s[e] = score;
    }
    __syncthreads();
    if (threadIdx.x < kRowTile) {
      const int r = threadIdx.x;
      hd::SoftmaxState st;
      st.max = max_s[r];
      st.sum = sum_s[r];
      rescale_s[r] = hd::SoftmaxPushTile(&st, p_s + r * kKeyTile, kKeyTile, p_s + r * kKeyTile);
      max_s[r] = st.max;
      sum_s[r] = st.sum;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kAccPerThread; ++k) {
      const int e = threadIdx.x + k * kThreads;
      if (e < w.nrows * d) {
        const int r = e / d, c = e % d;
        float a = acc[k] * rescale_s[r];
        for (int j = 0; j < n; ++j) a += p_s[r * kKeyTile + j] * v_s[j * d + c];
        acc[k] = a;
      }
    }
    __syncthreads();
  }

  const int task = blockIdx.z, split = blockIdx.x;
#pragma unroll
  for (int k = 0; k < kAccPerThread; ++k) {
    const int e = threadIdx.x + k * kThreads;
    if (e < w.nrows * d) {
      const int r = e / d, c = e % d;
      hd::SoftmaxState st;
      st.max = max_s[r];
      st.sum = sum_s[r];
      p.partial_out[PartialRow(p, task, split, w.row0 + r) * d + c] = acc[k] * hd::SoftmaxOutScale(st);
    }
  }
  if (threadIdx.x < w.nrows) {
    hd::SoftmaxState st;
    st.max = max_s[threadIdx.x];
    st.sum = sum_s[threadIdx.x];
    p.partial_lse[PartialRow(p, task, split, w.row0 + threadIdx.x)] = hd::SoftmaxLse(st);
  }
}

// ---------------------------------------------------------------------------
// Tensor-core split kernel.
// ---------------------------------------------------------------------------
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

// Channels c..c+3 of page row `row` (hd::QuadChannel) as four fp16
// values. Each code goes into the mantissa of 1024.0 (0x6400 | code):
// byte_perm builds two such half2 from four code bytes, HSUB2 takes 1024
// off (exactly), HFMA2 applies scale and zero.
__device__ __forceinline__ void DequantQuad(const PageLayout& L, const SideLayout& S,
                                            const uint8_t* page, int row, int m, int quad,
                                            __half2* out) {
  const int d = L.head_dim;
  const int c = hd::QuadChannel(d, S.bits, m, quad);
  const uint32_t codes = hd::QuadCodes(PageLayout::CodeRow(page, S, row), S.bits, m, quad);
  constexpr uint32_t kMagicBytes = 0x01010101u * (hd::kHalfMagic1024 >> 8);  // 0x64 in each byte.
  const uint32_t lo_bits = __byte_perm(codes, kMagicBytes, 0x5140);
  const uint32_t hi_bits = __byte_perm(codes, kMagicBytes, 0x5342);
  const __half2 bias = __float2half2_rn(1024.0f);
  const __half2 lo = __hsub2(*reinterpret_cast<const __half2*>(&lo_bits), bias);
  const __half2 hi = __hsub2(*reinterpret_cast<const __half2*>(&hi_bits), bias);
  const hd::QuadParams at = hd::QuadParamsAt(L, S, row, c);
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
  out[0] = __hfma2(lo, scale_lo, zero_lo);
  out[1] = __hfma2(hi, scale_hi, zero_hi);
}

// Tile keys [t0, t0 + n) of one side as fp16 rows (stride d + kHalfPad);
// rows n..kKeyTile are zeroed so that a zero weight never meets a stale NaN.
__device__ void LoadTileHalf(const DeviceStreamView& v, Side side, int t0, int n, __half* dst) {
  const PageLayout& L = v.layout;
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  const int stride = d + kHalfPad;
  const bool fast = hd::QuadDequantTakes(L, S, hd::ExtrasOf(v, side));
  const int quads = d / 4;
  for (int e = threadIdx.x; e < kKeyTile * quads; e += blockDim.x) {
    const int j = e / quads, qi = e % quads;
    const int t = t0 + j;
    __half2* out = reinterpret_cast<__half2*>(dst + j * stride + 4 * qi);
    if (j >= n) {
      out[0] = out[1] = __float2half2_rn(0.0f);
      continue;
    }
    const bool in_pages = t >= v.sink_tokens && t < v.sink_tokens + v.quantized_tokens;
    if (in_pages && fast) {
      const int q = t - v.page_base;
      int m, quad;
      hd::QuadOf(d, S.bits, qi, &m, &quad);
      // Quad qi's channels are not 4 * qi: store them where they belong.
      __half2 vals[2];
      DequantQuad(L, S, v.pages[q / L.page_tokens], q % L.page_tokens, m, quad, vals);
      __half2* at = reinterpret_cast<__half2*>(dst + j * stride + hd::QuadChannel(d, S.bits, m, quad));
      at[0] = vals[0];
      at[1] = vals[1];
      continue;
    }
    const int c = 4 * qi;
    out[0] = __floats2half2_rn(ElementAt(v, side, t, c), ElementAt(v, side, t, c + 1));
    out[1] = __floats2half2_rn(ElementAt(v, side, t, c + 2), ElementAt(v, side, t, c + 3));
  }
}

__global__ void __launch_bounds__(kThreads) SplitKernelMma(LaunchParams p) {
  const DeviceAttentionTask& t = p.tasks[blockIdx.z];
  BlockWork w;
  if (!BlockWorkOf(p, t, &w)) return;
  const DeviceStreamView& v = t.stream;
  const int d = p.head_dim;
  const int hs = d + kHalfPad;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;  // The MMA fragments' row group and column pair.

  extern __shared__ __align__(16) unsigned char smem[];
  double* inv_freq = reinterpret_cast<double*>(smem);
  float* q_f = reinterpret_cast<float*>(inv_freq + kMaxHeadDim / 2);  // [16][d] fp32 staging.
  float* p_s = q_f + kRowTile * d;
  float* max_s = p_s + kRowTile * kKeyTile;
  float* sum_s = max_s + kRowTile;
  float* rescale_s = sum_s + kRowTile;
  int* visible_s = reinterpret_cast<int*>(rescale_s + kRowTile);
  __half* q_h = reinterpret_cast<__half*>(visible_s + kRowTile);
  __half* k_h = q_h + kRowTile * hs;
  __half* v_h = k_h + kKeyTile * hs;
  __half* p_h = v_h + kKeyTile * hs;  // [16][kKeyTile + kHalfPad]
  constexpr int ps = kKeyTile + kHalfPad;

  LoadInvFreq(v.rope, inv_freq);
  if (threadIdx.x < kRowTile) {
    max_s[threadIdx.x] = hd::NegInf();
    sum_s[threadIdx.x] = 0.0f;
    visible_s[threadIdx.x] =
        threadIdx.x < w.nrows ? VisibleEnd(t, p.group_size, w.row0 + threadIdx.x) : w.s0;
  }
  LoadQueries(t, p.group_size, w.row0, w.nrows, q_f);
  for (int e = threadIdx.x; e < kRowTile * d; e += blockDim.x) {
    const int r = e / d, c = e % d;
    q_h[r * hs + c] = __float2half_rn(r < w.nrows ? q_f[e] : 0.0f);
  }

  // Output accumulators: warp w owns channels [w * d / 4, (w + 1) * d / 4),
  // d / 32 n8 tiles of 4 floats per lane (rows g and g + 8).
  constexpr int kMaxTiles = kMaxHeadDim / (8 * kWarps);
  const int tiles = d / (8 * kWarps);
  float o[kMaxTiles][4];
#pragma unroll
  for (int i = 0; i < kMaxTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  for (int t0 = w.s0; t0 < w.kv_end; t0 += kKeyTile) {
    const int n = min(kKeyTile, w.kv_end - t0);
    LoadTileHalf(v, Side::kKey, t0, n, k_h);
    LoadTileHalf(v, Side::kValue, t0, n, v_h);
    __syncthreads();
    ForEachOutlier(v, Side::kKey, t0, n,
                   [&](int j, int c, float x) { k_h[j * hs + c] = __float2half_rn(x); });
    ForEachOutlier(v, Side::kValue, t0, n,
                   [&](int j, int c, float x) { v_h[j * hs + c] = __float2half_rn(x); });
    __syncthreads();
    if (v.rope.rotary_dim > 0) {
      const int pairs = v.rope.rotary_dim / 2;
      for (int e = threadIdx.x; e < n * pairs; e += blockDim.x) {
        const int j = e / pairs, i = e % pairs;
        float c, s, r0, r1;
        hd::RopeCosSin(v.rope, inv_freq[i], t0 + j, &c, &s);
        __half* x = k_h + j * hs;
        const int a = hd::RopeFirst(v.rope, i), b = hd::RopeSecond(v.rope, i);
        hd::RotatePair(__half2float(x[a]), __half2float(x[b]), c, s, &r0, &r1);
        x[a] = __float2half_rn(r0);
        x[b] = __float2half_rn(r1);
      }
      __syncthreads();
    }
    // S = Q K^T: warp w computes keys [8w, 8w + 8) for all 16 rows.
    {
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const __half* krow = k_h + (8 * warp + g) * hs;
      for (int k0 = 0; k0 < d; k0 += 16) {
        uint32_t a[4], b[2];
        a[0] = Load32(q_h + g * hs + k0 + 2 * tq);
        a[1] = Load32(q_h + (g + 8) * hs + k0 + 2 * tq);
        a[2] = Load32(q_h + g * hs + k0 + 2 * tq + 8);
        a[3] = Load32(q_h + (g + 8) * hs + k0 + 2 * tq + 8);
        b[0] = Load32(krow + k0 + 2 * tq);
        b[1] = Load32(krow + k0 + 2 * tq + 8);
        Mma16816(s, a, b);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = g + (i / 2) * 8;
        const int j = 8 * warp + 2 * tq + (i % 2);
        const bool seen = r < w.nrows && j < n && t0 + j < visible_s[r];
        p_s[r * kKeyTile + j] = seen ? s[i] * p.softmax_scale : hd::NegInf();
      }
    }
    __syncthreads();
    if (threadIdx.x < kRowTile) {
      const int r = threadIdx.x;
      hd::SoftmaxState st;
      st.max = max_s[r];
      st.sum = sum_s[r];
      float* row = p_s + r * kKeyTile;
      rescale_s[r] = hd::SoftmaxPushTile(&st, row, kKeyTile, row);
      max_s[r] = st.max;
      sum_s[r] = st.sum;
      for (int j = 0; j < kKeyTile; ++j) p_h[r * ps + j] = __float2half_rn(row[j]);
    }
    __syncthreads();
    // O = O * rescale + P V: warp w's channel tiles, k over the 32 keys.
    const float rescale_lo = rescale_s[g], rescale_hi = rescale_s[g + 8];
#pragma unroll
    for (int i = 0; i < kMaxTiles; ++i) {
      o[i][0] *= rescale_lo;
      o[i][1] *= rescale_lo;
      o[i][2] *= rescale_hi;
      o[i][3] *= rescale_hi;
    }
#pragma unroll
    for (int k0 = 0; k0 < kKeyTile; k0 += 16) {
      uint32_t a[4];
      a[0] = Load32(p_h + g * ps + k0 + 2 * tq);
      a[1] = Load32(p_h + (g + 8) * ps + k0 + 2 * tq);
      a[2] = Load32(p_h + g * ps + k0 + 2 * tq + 8);
      a[3] = Load32(p_h + (g + 8) * ps + k0 + 2 * tq + 8);
#pragma unroll
      for (int i = 0; i < kMaxTiles; ++i) {
        if (i < tiles) {
          const int col = warp * (d / kWarps) + 8 * i + g;
          const __half* vk = v_h + (k0 + 2 * tq) * hs + col;
          uint32_t b[2];
          b[0] = Pack(vk[0], vk[hs]);
          b[1] = Pack(vk[8 * hs], vk[9 * hs]);
          Mma16816(o[i], a, b);
        }
      }
    }
    __syncthreads();
  }

  const int task = blockIdx.z, split = blockIdx.x;
#pragma unroll
  for (int i = 0; i < kMaxTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = g + (e / 2) * 8;
      if (i >= tiles || r >= w.nrows) continue;
      const int c = warp * (d / kWarps) + 8 * i + 2 * tq + (e % 2);
      hd::SoftmaxState st;
      st.max = max_s[r];
      st.sum = sum_s[r];
      p.partial_out[PartialRow(p, task, split, w.row0 + r) * d + c] = o[i][e] * hd::SoftmaxOutScale(st);
    }
  }
  if (threadIdx.x < w.nrows) {
    hd::SoftmaxState st;
    st.max = max_s[threadIdx.x];
    st.sum = sum_s[threadIdx.x];
    p.partial_lse[PartialRow(p, task, split, w.row0 + threadIdx.x)] = hd::SoftmaxLse(st);
  }
}

// ---------------------------------------------------------------------------
// Merge kernel: grid (max_rows, tasks), one row per block.
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) MergeKernel(LaunchParams p) {
  const DeviceAttentionTask& t = p.tasks[blockIdx.y];
  const int row = blockIdx.x;
  if (row >= t.num_queries * p.group_size) return;
  const int d = p.head_dim;
  const int splits = (t.key_end - t.key_begin + kSplit - 1) / kSplit;
  __shared__ float out_s[kMaxHeadDim];
  float lse = hd::NegInf();
  for (int c = threadIdx.x; c < d; c += blockDim.x) out_s[c] = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const size_t at = PartialRow(p, blockIdx.y, s, row);
    const hd::MergeWeights mw = hd::MergeWeightsOf(lse, p.partial_lse[at]);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
      out_s[c] = hd::MergeChannel(mw, out_s[c], p.partial_out[at * d + c]);
    }
    lse = mw.lse;
  }
  __syncthreads();
  if (const float* signs = t.stream.rotation_signs) {
    const int half = d / 2;
    for (int len = 1; len < d; len <<= 1) {
      for (int k = threadIdx.x; k < half; k += blockDim.x) {
        const int j = (k / len) * 2 * len + (k % len);
        const float a = out_s[j], b = out_s[j + len];
        out_s[j] = a + b;
        out_s[j + len] = a - b;
      }
      __syncthreads();
    }
    const float norm = hd::HadamardNorm(d);
    for (int c = threadIdx.x; c < d; c += blockDim.x) out_s[c] *= norm * signs[c];
    __syncthreads();
  }
  const int i = row / p.group_size, h = row % p.group_size;
  float* out = t.out + static_cast<size_t>(i) * t.out_stride + static_cast<size_t>(h) * d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) out[c] = out_s[c];
  if (threadIdx.x == 0) t.lse[static_cast<size_t>(i) * t.lse_stride + h] = lse;
}

size_t FloatKernelSmem(int d) {
  return sizeof(double) * (kMaxHeadDim / 2) +
         sizeof(float) * (kRowTile * d + kKeyTile * (d + 1) + kKeyTile * d +
                          kRowTile * kKeyTile + 3 * kRowTile) +
         sizeof(int) * kRowTile;
}

size_t MmaKernelSmem(int d) {
  return sizeof(double) * (kMaxHeadDim / 2) +
         sizeof(float) * (kRowTile * d + kRowTile * kKeyTile + 3 * kRowTile) +
         sizeof(int) * kRowTile +
         sizeof(__half) * ((kRowTile + 2 * kKeyTile) * (d + kHalfPad) +
                           kRowTile * (kKeyTile + kHalfPad));
}

}  // namespace

bool UseTensorCores(const PageLayout& layout) {
  auto packed_small = [](const SideLayout& s) {
    return s.format == CodeFormat::kPacked && s.bits <= 4;
  };
  return packed_small(layout.key) && packed_small(layout.value) &&
         layout.head_dim % (8 * kWarps) == 0 && layout.head_dim % 16 == 0 &&
         layout.head_dim <= kMaxHeadDim;
}

int DecodeAttentionSplits(const DecodeAttentionShape& shape) {
  return std::max(1, (shape.max_keys + kSplit - 1) / kSplit);
}

size_t DecodeAttentionWorkspaceBytes(const DecodeAttentionShape& shape) {
  const size_t rows = static_cast<size_t>(shape.num_tasks) * DecodeAttentionSplits(shape) *
                      std::max(shape.max_rows, 0);
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
  if (shape.head_dim < 8 || shape.head_dim > kMaxHeadDim || shape.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim must be a multiple of 8 in [8, ", kMaxHeadDim, "], got ", shape.head_dim));
  }
  if (shape.group_size < 1 || shape.group_size > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_size must be in [1, 64], got ", shape.group_size));
  }
  if (!(shape.softmax_scale > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("softmax_scale must be resolved to > 0, got ", shape.softmax_scale));
  }
  if (shape.max_rows < 1 || shape.max_keys < 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_rows must be >= 1 (got ", shape.max_rows,
                                                   ") and max_keys >= 0 (got ", shape.max_keys, ")"));
  }
  if (shape.tensor_cores && (shape.head_dim % (8 * kWarps) != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_cores needs head_dim a multiple of ", 8 * kWarps, ", got ", shape.head_dim));
  }
  const size_t need = DecodeAttentionWorkspaceBytes(shape);
  if (workspace == nullptr || workspace_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat("workspace must hold ", need,
                                                   " bytes, got ", workspace_bytes));
  }
  const int splits = DecodeAttentionSplits(shape);
  const int row_tiles = (shape.max_rows + kRowTile - 1) / kRowTile;
  LaunchParams p;
  p.tasks = tasks;
  p.head_dim = shape.head_dim;
  p.group_size = shape.group_size;
  p.softmax_scale = shape.softmax_scale;
  p.splits = splits;
  p.max_rows = shape.max_rows;
  p.partial_out = static_cast<float*>(workspace);
  p.partial_lse = p.partial_out +
                  static_cast<size_t>(shape.num_tasks) * splits * shape.max_rows * shape.head_dim;

  const dim3 grid(splits, row_tiles, shape.num_tasks);
  if (shape.tensor_cores) {
    const size_t smem = MmaKernelSmem(shape.head_dim);
    KVQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(SplitKernelMma,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(smem)),
                             "decode attention (tensor cores): shared memory");
    SplitKernelMma<<<grid, kThreads, smem, stream>>>(p);
  } else {
    const size_t smem = FloatKernelSmem(shape.head_dim);
    KVQ_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(SplitKernelFloat,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(smem)),
                             "decode attention (fp32): shared memory");
    SplitKernelFloat<<<grid, kThreads, smem, stream>>>(p);
  }
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "decode attention split kernel launch");
  MergeKernel<<<dim3(shape.max_rows, shape.num_tasks), kThreads, 0, stream>>>(p);
  KVQ_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "decode attention merge kernel launch");
  return absl::OkStatus();
}

}  // namespace kvq
