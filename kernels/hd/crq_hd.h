// crq's per-element math (docs/KERNELS.md, "crq"), shared by the "cpu" and
// "cuda_host" backends and the device kernels. The reference
// (kernels/cpu/ref_backend.cc) has its own fp64 version and stays the truth.
//
// A crq code row of a side with w half bits (w = 2 x bits) holds
// coordinates [0, d/2) at hi = ceil(w/2) bits, then [d/2, d) at
// lo = floor(w/2) bits, each half packed as page_layout.h's bit planes of
// d/2 codes. Codes index the Lloyd-Max levels of N(0, 1) at their width
// (kernels/lloyd_max.h), carried as CrqCodebooks; the row's fp16 gain g
// scales them: the stored coordinate is g * level[code].
#ifndef KVQ_KERNELS_HD_CRQ_HD_H_
#define KVQ_KERNELS_HD_CRQ_HD_H_

#include <cmath>
#include <cstdint>

#include "kernels/hd/dequant_hd.h"
#include "kernels/hd/hd.h"
#include "kernels/hd/quant_hd.h"

namespace kvq::hd {

// The levels and decision thresholds of 2, 3 and 4 bits laid end to end:
// a value type a device kernel takes as an argument.
struct CrqCodebooks {
  float levels[4 + 8 + 16];
  float thresholds[3 + 7 + 15];
};
KVQ_HD const float* CrqLevels(const CrqCodebooks& cb, int bits) {
  return cb.levels + (1 << bits) - 4;
}
KVQ_HD const float* CrqThresholds(const CrqCodebooks& cb, int bits) {
  return cb.thresholds + (1 << bits) - bits - 2;
}

KVQ_HD int CrqHiBits(int half_bits) { return (half_bits + 1) / 2; }
KVQ_HD int CrqLoBits(int half_bits) { return half_bits / 2; }
KVQ_HD int CrqBitsAt(int half_bits, int d, int c) {
  return c < d / 2 ? CrqHiBits(half_bits) : CrqLoBits(half_bits);
}
KVQ_HD int CrqRowBytes(int d, int half_bits) {
  return d / 2 * (CrqHiBits(half_bits) + CrqLoBits(half_bits)) / 8;
}

// Code of coordinate c of a packed row.
KVQ_HD int CrqCodeAt(const uint8_t* row, int d, int half_bits, int c) {
  const int h = d / 2;
  const int hi = CrqHiBits(half_bits);
  return c < h ? CodeAt(row, h, hi, c) : CodeAt(row + h * hi / 8, h, CrqLoBits(half_bits), c - h);
}

// Byte j of a packed row whose codes come from code(c).
template <class CodeFn>
KVQ_HD uint8_t CrqPackedByte(const CodeFn& code, int d, int half_bits, int j) {
  const int h = d / 2;
  const int hi = CrqHiBits(half_bits);
  const int hi_bytes = h * hi / 8;
  if (j < hi_bytes) return PackedByte([&](int c) { return code(c); }, h, hi, j);
  return PackedByte([&](int c) { return code(h + c); }, h, CrqLoBits(half_bits), j - hi_bytes);
}

// The nearest of n levels to x: how many decision thresholds lie below it.
KVQ_HD int CrqNearest(float x, const float* thresholds, int n) {
  int code = 0;
  for (int i = 0; i < n - 1; ++i) code += x > thresholds[i] ? 1 : 0;
  return code;
}

// Codes one row y[d] (the calibrated, rotated coordinates): each y_c / sigma,
// sigma = ||y|| / sqrt(d), to its nearest level; returns the least-squares
// gain <y, c> / <c, c> of the chosen levels c (0 for a zero row). Float
// sums in coordinate order, each operation rounded on its own (quant_hd.h's
// Mul / Add / Div: the device never contracts them, and cuda_host's
// host_quantize.cc compiles with -ffp-contract=off), so the device writes
// cuda_host's bytes.
KVQ_HD float CrqCodeRow(const float* y, int d, int half_bits, const CrqCodebooks& cb,
                        uint8_t* codes) {
  float sq = 0.0f;
  for (int c = 0; c < d; ++c) sq = Add(sq, Mul(y[c], y[c]));
  const float inv_sigma = sq > 0.0f ? sqrtf(Div(static_cast<float>(d), sq)) : 0.0f;
  float yc = 0.0f, cc = 0.0f;
  for (int c = 0; c < d; ++c) {
    const int bits = CrqBitsAt(half_bits, d, c);
    const int code = CrqNearest(Mul(y[c], inv_sigma), CrqThresholds(cb, bits), 1 << bits);
    codes[c] = static_cast<uint8_t>(code);
    const float level = CrqLevels(cb, bits)[code];
    yc = Add(yc, Mul(y[c], level));
    cc = Add(cc, Mul(level, level));
  }
  return sq > 0.0f ? Div(yc, cc) : 0.0f;
}

// CrqCodeRow's codes packed into a page's code row and its gain stored as
// fp16 bits (`codes` is scratch of d bytes).
KVQ_HD void CrqStoreRow(const float* y, int d, int half_bits, const CrqCodebooks& cb,
                        uint8_t* codes, uint8_t* code_row, uint8_t* gain) {
  const float g = CrqCodeRow(y, d, half_bits, cb, codes);
  const int bytes = CrqRowBytes(d, half_bits);
  for (int j = 0; j < bytes; ++j) {
    code_row[j] = CrqPackedByte([&](int c) { return codes[c]; }, d, half_bits, j);
  }
  StoreHalfBits(gain, FloatToHalf(g));
}

// Coordinate c of a stored row: gain * level[code].
KVQ_HD float CrqDequant(const uint8_t* row, int d, int half_bits, float gain,
                        const CrqCodebooks& cb, int c) {
  const int bits = CrqBitsAt(half_bits, d, c);
  return gain * CrqLevels(cb, bits)[CrqCodeAt(row, d, half_bits, c)];
}

// The mean term of a key's score, q . R_p mu: per RoPE pair j (channels
// f, s, angle theta_j p) a_j cos + b_j sin with a_j = q_f mu_f + q_s mu_s,
// b_j = q_s mu_f - q_f mu_s; channels that do not rotate add q_c mu_c.
KVQ_HD void CrqMeanPair(float q_f, float q_s, float mu_f, float mu_s, float* a, float* b) {
  *a = q_f * mu_f + q_s * mu_s;
  *b = q_s * mu_f - q_f * mu_s;
}

}  // namespace kvq::hd

#endif  // KVQ_KERNELS_HD_CRQ_HD_H_
