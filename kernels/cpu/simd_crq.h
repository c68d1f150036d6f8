// SIMD loops of the cpu backend's crq kernel (kernels/cpu/crq_cpu.cc):
// level look-ups on packed codes, a block's scores and multiply-adds over a
// tile of keys, softmax sums, and the walk of the mean term's RoPE angles.
// Highway, dispatched at run time to the best compiled target
// (simd_targets.h).
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

// acc[k * stride + c] += w[k] * x[c] for k < nr with w[k] != 0, c < d (a
// multiple of 8).
void CrqAxpys(const float* w, int nr, const float* x, int d, float* acc, size_t stride);

// Keys scored a tile at a time: kCrqTile keys in the lanes of one vector, so
// every row's dots are vertical multiply-adds (no horizontal sums) and each
// key's decode and angles serve every row of the block.
inline constexpr int kCrqTile = 8;

// The scores of one tile of coded keys for rows k < nr:
//   out[k * out_stride + i] = fixed[k]
//       + sum_j (a[k * m_stride + j] cs[j][i] + b[k * m_stride + j] sn[j][i])
//       + gain[i] * sum_c qr[k * q_stride + c] levels[c][i]
// for lanes i < kCrqTile; levels is d x kCrqTile, cs and sn pairs x
// kCrqTile (tile-major: key i of coordinate c at c * kCrqTile + i). All
// kCrqTile lanes are written (unused keys: whatever their zero inputs give).
void CrqTileScores(const float* levels, const float* gain, const float* cs, const float* sn,
                   int pairs, int d, const float* qr, size_t q_stride, const float* a,
                   const float* b, size_t m_stride, const float* fixed, int nr, float* out,
                   size_t out_stride);

// For a block of many rows, the tile's keys with their mean term folded in:
//   z[c][i] = gain[i] levels[c][i] + (H R_{p_i} mu)[c],
// mu = key_mean / key_scale and H = norm * WalshHadamard * diag(signs) as
// HadamardRotation (signs_norm = signs * norm), R_{p_i} RoPE at key i's
// angles (cs, sn as for CrqTileScores; pair j turns channels first[j],
// second[j]). Since q' = H (s_k q), q' . z_i = q . R_p key_mean + gain
// q' . levels: CrqTileScores with no pairs, unit gains and no fixed term
// then scores each row with one dot per key. Costs O(d log d) per tile
// instead of d / 2 pairs per row and key. z is d x kCrqTile.
void CrqTileFoldMean(const float* levels, const float* gain, const float* cs, const float* sn,
                     const int* first, const int* second, int pairs, const float* mu,
                     const float* signs_norm, int d, float* z);

// acc[k * stride + c] += sum_i w[k * w_stride + i] * x[i * d + c] for k < nr,
// i < m (at most kCrqTile rows of x), c < d (a multiple of 8): a tile of
// rows accumulated with one load and store of each accumulator.
void CrqTileAxpys(const float* w, size_t w_stride, int nr, const float* x, int m, int d,
                  float* acc, size_t stride);

// The maximum of x[i < n] (-infinity for n = 0) and their sum (float
// partial sums in two vectors of lanes: a few ulp of the total for a
// chunk's weights).
float CrqMax(const float* x, int n);
float CrqSum(const float* x, int n);

// x[i] = exp(x[i] - shift) for i < n: softmax weights from scores and their
// maximum (Highway's Exp, within 1 ulp of std::exp).
void CrqExpShifted(float* x, int n, float shift);

// One token's angles in float (csf, snf) from the walked (cs, sn), then the
// walk one position on: (cs, sn) turned by (step_c, step_s), pair by pair,
// in double. n pairs; the float arrays hold at least n.
void CrqRopeWalk(double* cs, double* sn, const double* step_c, const double* step_s, int n,
                 float* csf, float* snf);

// Mean-term coefficients turned by angles: for rows k < nr and pairs j < n
// (a multiple of 8; a, b, ta, tb are nr x n),
//   ta[k][j] = a[k][j] c0[j] + b[k][j] s0[j],  tb[k][j] = b[k][j] c0[j] - a[k][j] s0[j],
// so that a cos(x + y) + b sin(x + y) = ta cos(y) + tb sin(y) for c0 = cos x,
// s0 = sin x.
void CrqTurnPairs(const float* a, const float* b, int nr, int n, const float* c0,
                  const float* s0, float* ta, float* tb);

// out[c * kCrqTile + i] = rows[i * stride + c] for i < kCrqTile, c < d (a
// multiple of 8): kCrqTile row-major rows (decoded keys, walked angles) to
// the tile-major layout of CrqTileScores, in 8 x 8 register blocks.
void CrqTransposeTile(const float* rows, size_t stride, int d, float* out);

}  // namespace cpu
}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_SIMD_CRQ_H_
