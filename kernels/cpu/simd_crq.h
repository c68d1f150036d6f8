// SIMD loops of the cpu backend's crq kernel (kernels/cpu/crq_cpu.cc):
// level look-ups on packed codes, the group's dots and multiply-adds, and the
// walk of the mean term's RoPE angles. Highway, dispatched at run time to the
// best compiled target (simd_targets.h).
#ifndef KVQ_KERNELS_CPU_SIMD_CRQ_H_
#define KVQ_KERNELS_CPU_SIMD_CRQ_H_

#include <cstddef>
#include <cstdint>

namespace kvq {
namespace cpu {

// The levels of one code row's two halves (hd/crq_hd.h: coordinates
// [0, d/2) at hi bits, [d/2, d) at lo bits), 16 slots each, unused slots
// zero: the look-up tables of CrqDecodeRow.
struct CrqRowLevels {
  alignas(64) float hi[16];
  alignas(64) float lo[16];
};

// out[c] = gain * level(code_c) of one packed code row of d coordinates
// (d a multiple of 16); `codes` is scratch of d bytes.
void CrqDecodeRow(const uint8_t* row, int d, int half_bits, const CrqRowLevels& levels,
                  float gain, uint8_t* codes, float* out);

// out[k] = rows[k * stride, + d) . x for k < nr (d a multiple of 8).
void CrqDots(const float* x, const float* rows, size_t stride, int nr, int d, float* out);

// out[k] = sum_j a[k * stride + j] cs[j] + b[k * stride + j] sn[j] for k <
// nr, j < n (n a multiple of 8, arrays zero-padded to it).
void CrqMeanDots(const float* a, const float* b, size_t stride, int nr, const float* cs,
                 const float* sn, int n, float* out);

// acc[k * stride + c] += w[k] * x[c] for k < nr with w[k] != 0, c < d (a
// multiple of 8).
void CrqAxpys(const float* w, int nr, const float* x, int d, float* acc, size_t stride);

// x[i] = exp(x[i] - shift) for i < n: softmax weights from scores and their
// maximum (Highway's Exp, within 1 ulp of std::exp).
void CrqExpShifted(float* x, int n, float shift);

// One token's angles in float (csf, snf) from the walked (cs, sn), then the
// walk one position on: (cs, sn) turned by (step_c, step_s), pair by pair,
// in double. n pairs; the float arrays hold at least n.
void CrqRopeWalk(double* cs, double* sn, const double* step_c, const double* step_s, int n,
                 float* csf, float* snf);

}  // namespace cpu
}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_SIMD_CRQ_H_
