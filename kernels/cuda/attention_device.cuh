// Device pieces both decode-attention files use (cuda_attention.cu for
// every scheme, cuda_crq.cu for crq): warp and block reductions, the
// asynchronous page copy, RoPE's cos / sin, and the merge of a row's split
// partials. CUDA only: included by .cu files.
#ifndef KVQ_KERNELS_CUDA_ATTENTION_DEVICE_CUH_
#define KVQ_KERNELS_CUDA_ATTENTION_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/hd/attention_hd.h"

namespace kvq {

inline constexpr int kDeviceVector = 16;  // Bytes per cp.async / LDG.128.
// A split kernel's block: 4 warps over 16 query rows, 32 keys per tile.
inline constexpr int kAttentionThreads = 128;
inline constexpr int kAttentionRowTile = 16;
inline constexpr int kAttentionKeyTile = 32;

__device__ __forceinline__ int TaskSplitOrigin(const DeviceAttentionTask& t) {
  return hd::SplitOrigin(t.key_begin, t.stream.page_base, t.stream.layout.page_tokens);
}

// --- Warp reductions (all 32 lanes get the result). ---
__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = hd::Max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The block-wide max / sum of one value per thread (every thread gets it).
template <bool kMax, int kThreads>
__device__ __forceinline__ float BlockReduce(float x, float* scratch) {
  x = kMax ? WarpMax(x) : WarpSum(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) r = kMax ? hd::Max(r, scratch[i]) : r + scratch[i];
  __syncthreads();
  return r;
}

// --- Asynchronous page copies (sm_80+): 16 bytes per thread and step. ---
template <int kThreads>
__device__ __forceinline__ void CopyPageAsync(const uint8_t* page, int bytes, uint8_t* dst) {
  for (int i = threadIdx.x * kDeviceVector; i < bytes; i += kThreads * kDeviceVector) {
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst + i));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(page + i));
  }
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void WaitPageCopies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// cos and sin of the angle position * inv_freq (inv_freq: hd::RopeInvFreq
// over the linear factor): hd::RopeCosSin's device form, reduced to a
// fraction of a turn in double and evaluated by sincospif, whose reduction
// is exact (sincosf's slow path for large angles keeps an array in local
// memory).
__device__ __forceinline__ void RopeCosSinOf(double inv_freq, int position, float* c, float* s) {
  constexpr double kInvTwoPi = 0.5 / 3.141592653589793238462643383279502884;
  const double turns = static_cast<double>(position) * inv_freq * kInvTwoPi;
  const double frac = turns - rint(turns);  // [-0.5, 0.5] turns.
  sincospif(static_cast<float>(2.0 * frac), s, c);
}

// The Walsh-Hadamard butterflies of rows [0, nrows) of x ([row][D]), one
// stage's pairs in parallel: each adds and subtracts the values the serial
// form (hd::WalshHadamardStage) would, so the bits are the same. Called by
// every thread of the block; ends with __syncthreads().
template <int D, int kThreads>
__device__ __forceinline__ void WalshHadamardRows(float* x, int nrows) {
  constexpr int kHalf = D / 2;
  for (int lg = 0; (1 << lg) < D; ++lg) {
    const int len = 1 << lg;
    for (int e = threadIdx.x; e < nrows * kHalf; e += kThreads) {
      const int r = e / kHalf, k = e % kHalf;
      float* row = x + r * D;
      const int j = ((k >> lg) << (lg + 1)) + (k & (len - 1));  // Stage lg's pair k.
      const float a = row[j], b = row[j + len];
      row[j] = a + b;
      row[j + len] = a - b;
    }
    __syncthreads();
  }
}

// Split partials of a launch: P has group_size, split_tokens, splits,
// max_rows, partial_out ([task][split][row][D]) and partial_lse.
template <class P>
__device__ __forceinline__ size_t PartialRow(const P& p, int task, int split, int row) {
  return (static_cast<size_t>(task) * p.splits + split) * p.max_rows + row;
}

// Row `row` of task `ti`: its split partials merged in one step
// (hd::MergeWeight / MergedChannel), the splits' max and weight sum by
// block reductions, a thread per four channels with 16-byte loads; then
// the inverse Hadamard rotation when the stream rotates, out and lse.
template <int D, int kThreads, int kMaxSplits, class P>
__device__ __forceinline__ void MergeRow(const P& p, const DeviceAttentionTask& t, int ti,
                                         int row) {
  const int splits = hd::SplitCount(TaskSplitOrigin(t), t.key_begin, t.key_end, p.split_tokens);
  __shared__ float weight_s[kMaxSplits];
  __shared__ __align__(16) float out_s[D];
  __shared__ float scratch[kThreads / 32];
  float m = hd::NegInf();
  for (int s = threadIdx.x; s < splits; s += kThreads) {
    m = hd::Max(m, p.partial_lse[PartialRow(p, ti, s, row)]);
  }
  m = BlockReduce<true, kThreads>(m, scratch);
  float sum = 0.0f;
  for (int s = threadIdx.x; s < splits; s += kThreads) {
    const float wgt = hd::MergeWeight(p.partial_lse[PartialRow(p, ti, s, row)], m);
    weight_s[s] = wgt;
    sum += wgt;
  }
  sum = BlockReduce<false, kThreads>(sum, scratch);  // Its barrier publishes weight_s.
  const int i = row / p.group_size, h = row % p.group_size;
  if (threadIdx.x == 0) t.lse[static_cast<size_t>(i) * t.lse_stride + h] = hd::MergedLse(m, sum);
  // A thread per four channels, the splits in order (hd::MergeSplits).
  for (int c4 = threadIdx.x; c4 < D / 4; c4 += kThreads) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < splits; ++s) {
      const float wgt = weight_s[s];
      const float4 x = *reinterpret_cast<const float4*>(
          p.partial_out + PartialRow(p, ti, s, row) * D + 4 * c4);
      acc.x += wgt * x.x;
      acc.y += wgt * x.y;
      acc.z += wgt * x.z;
      acc.w += wgt * x.w;
    }
    out_s[4 * c4 + 0] = hd::MergedChannel(acc.x, sum);
    out_s[4 * c4 + 1] = hd::MergedChannel(acc.y, sum);
    out_s[4 * c4 + 2] = hd::MergedChannel(acc.z, sum);
    out_s[4 * c4 + 3] = hd::MergedChannel(acc.w, sum);
  }
  __syncthreads();
  if (const float* signs = t.stream.rotation_signs) {
    // One row's stages (WalshHadamardRows' row loop costs head_dim 96 a
    // stack frame).
    for (int lg = 0; (1 << lg) < D; ++lg) {
      const int len = 1 << lg;
      for (int k = threadIdx.x; k < D / 2; k += kThreads) {
        const int j = ((k >> lg) << (lg + 1)) + (k & (len - 1));
        const float a = out_s[j], b = out_s[j + len];
        out_s[j] = a + b;
        out_s[j + len] = a - b;
      }
      __syncthreads();
    }
    const float norm = hd::HadamardNorm(D);
    for (int c = threadIdx.x; c < D; c += kThreads) out_s[c] *= norm * signs[c];
    __syncthreads();
  }
  float* out = t.out + static_cast<size_t>(i) * t.out_stride + static_cast<size_t>(h) * D;
  for (int c = threadIdx.x; c < D; c += kThreads) out[c] = out_s[c];
}

// Key end query row `row` of the task sees.
__device__ __forceinline__ int VisibleEnd(const DeviceAttentionTask& t, int group, int row) {
  if (t.q_positions == nullptr) return t.key_end;
  return min(t.key_end, t.q_positions[row / group] + 1);
}

// The per-block preamble both split kernels share. False when the block
// has nothing to do (its split or rows lie outside its task).
struct BlockWork {
  int row0 = 0, nrows = 0;
  int s0 = 0, s1 = 0;  // The split's keys.
  int kv_end = 0;      // Past the last key any of the block's rows sees.
  int p_first = 0, p_last = -1;  // Pages the block reads.
};
template <class P>
__device__ bool BlockWorkOf(const P& p, const DeviceAttentionTask& t, BlockWork* w) {
  const int rows = t.num_queries * p.group_size;
  w->row0 = blockIdx.y * kAttentionRowTile;
  if (w->row0 >= rows) return false;
  w->nrows = min(kAttentionRowTile, rows - w->row0);
  const int origin = TaskSplitOrigin(t);
  if (static_cast<int>(blockIdx.x) >=
      hd::SplitCount(origin, t.key_begin, t.key_end, p.split_tokens)) {
    return false;
  }
  w->s0 = hd::SplitBegin(origin, t.key_begin, blockIdx.x, p.split_tokens);
  w->s1 = hd::SplitEnd(origin, t.key_end, blockIdx.x, p.split_tokens);
  int last = w->s0;
  for (int r = 0; r < w->nrows; ++r) last = max(last, VisibleEnd(t, p.group_size, w->row0 + r));
  w->kv_end = min(w->s1, last);
  const DeviceStreamView& v = t.stream;
  const int a = max(w->s0, v.sink_tokens);
  const int b = min(w->kv_end, v.sink_tokens + v.quantized_tokens);
  if (a < b) {
    w->p_first = (a - v.page_base) / v.layout.page_tokens;
    w->p_last = (b - 1 - v.page_base) / v.layout.page_tokens;
  }
  return true;
}

// A task whose pages do not fit the staging buffer (the launcher's shape
// said less): its rows get NaN partials, so the merged result is not
// finite and CheckAttentionResults fails the call instead of the copy
// running past the buffer.
template <class P>
__device__ bool PagesFit(const P& p, const DeviceAttentionTask& t, const BlockWork& w,
                         int head_dim) {
  if (w.p_last < w.p_first || static_cast<int>(t.stream.layout.page_bytes) <= p.page_buffer) {
    return true;
  }
  for (int e = threadIdx.x; e < w.nrows * head_dim; e += kAttentionThreads) {
    p.partial_out[PartialRow(p, blockIdx.z, blockIdx.x, w.row0 + e / head_dim) * head_dim +
                  e % head_dim] = NAN;
  }
  if (threadIdx.x < w.nrows) {
    p.partial_lse[PartialRow(p, blockIdx.z, blockIdx.x, w.row0 + threadIdx.x)] = NAN;
  }
  return false;
}

// Walks the block's keys [s0, kv_end) as segments (the sink, each page,
// the tail), staging each page in shared memory, and calls
// tile(t0, n, page, row0) for every run of at most kAttentionKeyTile keys: `page`
// the staged copy (row0 the page row of t0) or null for fp16 sink / tail
// rows. tile() ends with __syncthreads(), so a buffer is free again when
// the next copy into it is issued.
template <class P, typename Tile>
__device__ __forceinline__ void WalkKeys(const P& p, const DeviceStreamView& v,
                                         const BlockWork& w, uint8_t* buffers, Tile tile) {
  const int page_bytes = static_cast<int>(v.layout.page_bytes);
  const int pt = v.layout.page_tokens;
  const int q_begin = v.sink_tokens, q_end = v.sink_tokens + v.quantized_tokens;
  if (w.p_last >= w.p_first) {
    CopyPageAsync<kAttentionThreads>(v.pages[w.p_first], page_bytes, buffers);
  }
  int t = w.s0;
  while (t < w.kv_end) {
    const uint8_t* page = nullptr;
    int page_start = 0;
    int seg_end = w.kv_end;
    if (t < q_begin) {
      seg_end = min(w.kv_end, q_begin);
    } else if (t < q_end) {
      const int pidx = (t - v.page_base) / pt;  // Once per page.
      page_start = v.page_base + pidx * pt;
      seg_end = min(min(w.kv_end, q_end), page_start + pt);
      const int k = pidx - w.p_first;
      if (p.page_buffers == 2) {
        if (pidx < w.p_last) {
          CopyPageAsync<kAttentionThreads>(v.pages[pidx + 1], page_bytes,
                                           buffers + ((k + 1) & 1) * p.page_buffer);
          WaitPageCopies<1>();
        } else {
          WaitPageCopies<0>();
        }
        page = buffers + (k & 1) * p.page_buffer;
      } else {
        if (k > 0) CopyPageAsync<kAttentionThreads>(v.pages[pidx], page_bytes, buffers);
        WaitPageCopies<0>();
        page = buffers;
      }
      __syncthreads();
    }
    for (int t0 = t; t0 < seg_end; t0 += kAttentionKeyTile) {
      tile(t0, min(kAttentionKeyTile, seg_end - t0), page, t0 - page_start);
    }
    t = seg_end;
  }
}

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_ATTENTION_DEVICE_CUH_
