// Entry points of the SIMD kernels behind CpuBackend(). Each is compiled for
// several Highway targets (kernels/cpu/simd_targets.h) and dispatched at run
// time; cpu_backend.cc does the planning, threading and merging around them.
#ifndef KVQ_KERNELS_CPU_SIMD_KERNELS_H_
#define KVQ_KERNELS_CPU_SIMD_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kernels/page_layout.h"

namespace kvq {
namespace cpu {

// Query rows that share one pass over the keys (a GQA group, or a few
// queries of a chunk times their group).
inline constexpr int kMaxRows = 8;

// Attention of `rows` prepared query rows over keys [begin, end) of `stream`.
//   q[r * head_dim ...]: the query in the stored basis (rotated when the
//     scheme rotates) already multiplied by the softmax scale, so scores are
//     plain dot products;
//   visible_end[r]: keys t >= visible_end[r] are masked for row r (causal);
//   out[r * head_dim ...]: softmax-normalized output in the stored basis
//     (not inverse-rotated), zero when no key is visible;
//   lse[r]: log-sum-exp of the scores, -inf when no key is visible.
// Any number of rows; they are processed kMaxRows at a time. Single-threaded:
// the caller splits work across threads and merges by LSE.
struct RangeJob {
  const KvStream* stream = nullptr;
  int begin = 0;
  int end = 0;
  int rows = 0;
  const float* q = nullptr;
  const int32_t* visible_end = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
  // Called with each page before the job reads it (AttentionOptions).
  const PageCheck* page_check = nullptr;
};
void AttendRange(const RangeJob& job);

// KernelBackend::DequantizeRows for every format (bit-identical to the
// reference: same conversions, multiply then add).
void DequantizeRowsSimd(const KvStream& stream, Side side, const uint8_t* page, int row0,
                        int n, float* out);
// KernelBackend::DequantizeRowsHalf: uniform 2-, 3- and 4-bit rows on AVX-512
// straight to fp16; false, writing nothing, elsewhere.
bool DequantizeRowsHalfSimd(const KvStream& stream, Side side, const uint8_t* page, int row0,
                            int n, uint16_t* out, size_t stride);

// KernelBackend::QuantizeRows for fp16, bf16 and uniform kivi/int8, with or
// without sparse outliers (same codes, parameters and outlier tables as the
// reference). Returns false, writing nothing, for the other cases (fp8,
// nuq), which the caller sends to the reference.
// fp16 <-> float for whole rows, rounding exactly as HalfToFloat /
// FloatToHalf (IEEE round to nearest even) for finite values.
void HalfToFloatSimd(const uint16_t* src, size_t n, float* dst);
void FloatToHalfSimd(const float* src, size_t n, uint16_t* dst);

// Largest magnitude bit pattern (sign bit cleared) of n fp16 / bf16 (16) or
// fp32 (32) elements. Magnitude bits order like the magnitudes of finite
// values and put Inf and NaN above every finite value, so one compare against
// the bits of a limit checks a whole tensor (KvStream::ValidateInput).
uint16_t MaxAbsBits16(const uint16_t* src, size_t n);
uint32_t MaxAbsBits32(const uint32_t* src, size_t n);

// Copies `lines` whole 64-byte lines to dst (64-byte aligned; src any) with
// non-temporal stores where the target has them (LineStreamer's writes);
// FenceStreams orders them before later stores (sfence).
inline constexpr size_t kStreamLine = 64;
void StreamLines(uint8_t* dst, const uint8_t* src, size_t lines);
void FenceStreams();

bool QuantizeRowsSimd(const KvStream& stream, Side side, const float* rows, int n,
                      uint8_t* page, int row0);
// KernelBackend::QuantizeRowsHalf of the cpu backend: AVX-512 only.
bool QuantizeRowsHalfSimd(const KvStream& stream, Side side, const uint16_t* rows, int n,
                          uint8_t* page, int row0);

}  // namespace cpu
}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_SIMD_KERNELS_H_
