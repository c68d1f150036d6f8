// Reading one stored element of a quantized page: the per-element math the
// device kernels (dequantize-fetch and fused attention) and the "cuda_host"
// backend share. Values are in the stored basis (rotated, pre-RoPE), as
// DequantizeRowsRef returns them; the reference stays the truth and the
// typed suites compare against it.
//
// Every product and sum rounds on its own (MulAdd), as the reference does
// (kernels compile without contraction): a fused multiply-add would round
// once and give other bits.
#ifndef KVQ_KERNELS_HD_DEQUANT_HD_H_
#define KVQ_KERNELS_HD_DEQUANT_HD_H_

#include <cstdint>

#include "kernels/hd/hd.h"
#include "kernels/hd/numeric_hd.h"
#include "kernels/page_layout.h"

namespace kvq::hd {

// a * b + c with the product rounded before the add.
KVQ_HD float MulAdd(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(a, b), c);
#else
  volatile float p = a * b;  // Keeps the host compiler from contracting too.
  return p + c;
#endif
}

KVQ_HD uint16_t LoadHalfBits(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

// Code of channel c in a packed row of `head_dim` codes (page_layout.h: a
// b-bit plane of P = head_dim * b / 8 bytes holds channel j + P * m in byte
// j at bit m * b; 3 bits are a 2-bit plane of the low bits, then a 1-bit
// plane of the high bit; 8 bits are plain bytes).
KVQ_HD int PlaneCode(const uint8_t* plane, int head_dim, int b, int c) {
  const int p = head_dim * b / 8;
  const int m = c / p;
  return (plane[c - m * p] >> (m * b)) & ((1 << b) - 1);
}
// Where channel c's code lies in a row: a byte, a shift and a mask for the
// low plane, and for 3-bit codes the same for the high bit's plane (mask_hi
// 0 otherwise). The device kernels keep one per channel in shared memory,
// so the loops over a tile divide by nothing.
struct CodePos {
  uint16_t byte_lo = 0;
  uint16_t byte_hi = 0;
  uint8_t shift_lo = 0;
  uint8_t shift_hi = 0;
  uint8_t mask_lo = 0;
  uint8_t mask_hi = 0;
};
KVQ_HD void PlanePos(int head_dim, int b, int base, int c, uint16_t* byte, uint8_t* shift,
                     uint8_t* mask) {
  const int p = head_dim * b / 8;
  const int m = c / p;
  *byte = static_cast<uint16_t>(base + c - m * p);
  *shift = static_cast<uint8_t>(m * b);
  *mask = static_cast<uint8_t>((1 << b) - 1);
}
KVQ_HD CodePos CodePosOf(int head_dim, int bits, int c) {
  CodePos pos;
  if (bits == 3) {
    PlanePos(head_dim, 2, 0, c, &pos.byte_lo, &pos.shift_lo, &pos.mask_lo);
    PlanePos(head_dim, 1, head_dim / 4, c, &pos.byte_hi, &pos.shift_hi, &pos.mask_hi);
  } else {
    PlanePos(head_dim, bits, 0, c, &pos.byte_lo, &pos.shift_lo, &pos.mask_lo);
  }
  return pos;
}
KVQ_HD int CodeFrom(const uint8_t* row, const CodePos& pos) {
  return ((row[pos.byte_lo] >> pos.shift_lo) & pos.mask_lo) |
         (((row[pos.byte_hi] >> pos.shift_hi) & pos.mask_hi) << 2);
}
KVQ_HD int CodeAt(const uint8_t* row, int head_dim, int bits, int c) {
  return CodeFrom(row, CodePosOf(head_dim, bits, c));
}

struct ScaleZero {
  float scale = 0.0f;
  float zero = 0.0f;
};

// Where a page row's parameters lie, found once per row: the byte offset
// in the page of its fp16 entry (param_bits 16) or of its block's p8
// header, the first p8 code index of the row, and its block.
struct RowParams {
  uint32_t entry = 0;
  int index_base = 0;
  int block = 0;
};
KVQ_HD RowParams RowParamsOf(const PageLayout& L, const SideLayout& S, int row) {
  const bool channels = S.axis == ParamAxis::kChannelGroups;
  const int n = L.ParamsPerEntry(S);
  RowParams rp;
  rp.block = row / L.block_tokens;
  if (S.param_bits == 16) {
    rp.entry = static_cast<uint32_t>(S.params_offset +
                                     static_cast<size_t>(channels ? rp.block : row) * 4 * n);
  } else {
    rp.entry = static_cast<uint32_t>(S.params_offset + rp.block * L.ParamBlockBytes(S));
    rp.index_base = channels ? 0 : (row - rp.block * L.block_tokens) * n;
  }
  return rp;
}
// The parameter group of channel c (a table lookup on the device).
KVQ_HD int GroupOfChannel(const SideLayout& S, int c) {
  return S.axis == ParamAxis::kChannelGroups ? c : c / S.group_channels;
}

// Scale and zero point of group `group` of a row (kernels/group_params.h
// has both formats). n: L.ParamsPerEntry(S); block_groups: the p8 codes
// of a block, L.EntriesPerBlock(S) * n.
KVQ_HD ScaleZero ParamsFrom(const SideLayout& S, const uint8_t* page, const RowParams& rp,
                            int group, int n, int block_groups) {
  const uint8_t* p = page + rp.entry;
  if (S.param_bits == 16) {
    return {HalfToFloat(LoadHalfBits(p + 2 * group)), HalfToFloat(LoadHalfBits(p + 2 * (n + group)))};
  }
  const int index = rp.index_base + group;
  const float scale_step = HalfToFloat(LoadHalfBits(p));
  const float zero_base = HalfToFloat(LoadHalfBits(p + 2));
  const float zero_step = HalfToFloat(LoadHalfBits(p + 4));
  const uint8_t* codes = p + kParams8HeaderBytes;
  // Both products are exact (group_params.h), so only the add rounds.
  return {static_cast<float>(codes[index]) * scale_step,
          MulAdd(static_cast<float>(codes[block_groups + index]), zero_step, zero_base)};
}

// Scale and zero point of channel c of page row `row`.
KVQ_HD ScaleZero ParamsAt(const PageLayout& L, const SideLayout& S, const uint8_t* page, int row,
                          int c) {
  const int n = L.ParamsPerEntry(S);
  return ParamsFrom(S, page, RowParamsOf(L, S, row), GroupOfChannel(S, c), n,
                    L.EntriesPerBlock(S) * n);
}

// What a stream adds to its pages: nuq levels per channel as floats
// (levels[c * (1 << bits) + code]; null for uniform codes) and the fp8
// per-head scale.
struct SideExtras {
  const float* levels = nullptr;
  float fp8_scale = 1.0f;
};

// Element c of a code row whose parameters are `p` and code position `pos`
// (both unused for fp16 / bf16 / fp8 rows): the device's form, with the
// row's lookups done once.
KVQ_HD float DequantCode(const SideLayout& S, const uint8_t* code_row, int c, const CodePos& pos,
                         const ScaleZero& p, const SideExtras& extras) {
  switch (S.format) {
    case CodeFormat::kFp16:
      return HalfToFloat(LoadHalfBits(code_row + 2 * c));
    case CodeFormat::kBf16:
      return Bf16ToFloat(LoadHalfBits(code_row + 2 * c));
    case CodeFormat::kFp8E4m3:
#if defined(__CUDA_ARCH__)
      return __fmul_rn(Fp8E4m3ToFloat(code_row[c]), extras.fp8_scale);
#else
      return Fp8E4m3ToFloat(code_row[c]) * extras.fp8_scale;
#endif
    case CodeFormat::kInt8:
    case CodeFormat::kPacked:
      break;
    case CodeFormat::kCrq:
      // A crq row's element needs its row's gain: CrqDequant (crq_hd.h),
      // which every backend calls for kCrq instead of this.
      return 0.0f;
  }
  const int code = CodeFrom(code_row, pos);
  const float level =
      extras.levels ? extras.levels[c * (1 << S.bits) + code] : static_cast<float>(code);
  return MulAdd(p.scale, level, p.zero);
}
KVQ_HD bool HasParams(const SideLayout& S) {
  return S.format == CodeFormat::kInt8 || S.format == CodeFormat::kPacked;
}

// Element (row, c) of one side before outliers are applied.
KVQ_HD float DequantElement(const PageLayout& L, const SideLayout& S, const uint8_t* page,
                            int row, int c, const SideExtras& extras) {
  const uint8_t* code_row = PageLayout::CodeRow(page, S, row);
  if (!HasParams(S)) return DequantCode(S, code_row, c, CodePos{}, ScaleZero{}, extras);
  return DequantCode(S, code_row, c, CodePosOf(L.head_dim, S.bits, c),
                     ParamsAt(L, S, page, row, c), extras);
}

// Overwrites the outliers of rows [row0, row0 + n) in out (row-major, d
// floats per row): the fp16 values the block tables keep.
KVQ_HD void ApplyOutliers(const PageLayout& L, const SideLayout& S, const uint8_t* page, int row0,
                          int n, float* out) {
  if (L.outliers_per_block == 0 || n <= 0) return;
  const int d = L.head_dim;
  const int g = L.block_tokens;
  for (int b = row0 / g; b <= (row0 + n - 1) / g; ++b) {
    const uint8_t* table = page + S.outliers_offset + static_cast<size_t>(b) * 4 * L.outliers_per_block;
    for (int e = 0; e < L.outliers_per_block; ++e) {
      const int index = LoadHalfBits(table + 2 * e);
      const int row = b * g + index / d;
      if (row < row0 || row >= row0 + n) continue;
      out[static_cast<size_t>(row - row0) * d + index % d] =
          HalfToFloat(LoadHalfBits(table + 2 * (L.outliers_per_block + e)));
    }
  }
}

// Rows [row0, row0 + n) of one side as floats: DequantizeRowsRef's values.
KVQ_HD void DequantRows(const PageLayout& L, Side side, const uint8_t* page, int row0, int n,
                        const SideExtras& extras, float* out) {
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < d; ++c) {
      out[static_cast<size_t>(r) * d + c] = DequantElement(L, S, page, row0 + r, c, extras);
    }
  }
  ApplyOutliers(L, S, page, row0, n, out);
}

}  // namespace kvq::hd

#endif  // KVQ_KERNELS_HD_DEQUANT_HD_H_
