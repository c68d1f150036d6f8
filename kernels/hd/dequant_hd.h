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
KVQ_HD int CodeAt(const uint8_t* row, int head_dim, int bits, int c) {
  if (bits == 3) {
    return PlaneCode(row, head_dim, 2, c) | (PlaneCode(row + head_dim / 4, head_dim, 1, c) << 2);
  }
  return PlaneCode(row, head_dim, bits, c);
}

struct ScaleZero {
  float scale = 0.0f;
  float zero = 0.0f;
};

// Scale and zero point of channel c of page row `row` (kernels/group_params.h
// has both formats).
KVQ_HD ScaleZero ParamsAt(const PageLayout& L, const SideLayout& S, const uint8_t* page, int row,
                          int c) {
  const bool channels = S.axis == ParamAxis::kChannelGroups;
  const int n = L.ParamsPerEntry(S);
  const int group = channels ? c : c / S.group_channels;
  if (S.param_bits == 16) {
    const uint8_t* p = page + S.params_offset +
                       static_cast<size_t>(channels ? row / L.block_tokens : row) * 4 * n;
    return {HalfToFloat(LoadHalfBits(p + 2 * group)), HalfToFloat(LoadHalfBits(p + 2 * (n + group)))};
  }
  const int block = row / L.block_tokens;
  const uint8_t* header = L.ParamBlock(page, S, block);
  const int groups = L.EntriesPerBlock(S) * n;
  const int index = channels ? group : (row % L.block_tokens) * n + group;
  const float scale_step = HalfToFloat(LoadHalfBits(header));
  const float zero_base = HalfToFloat(LoadHalfBits(header + 2));
  const float zero_step = HalfToFloat(LoadHalfBits(header + 4));
  const uint8_t* codes = header + kParams8HeaderBytes;
  // Both products are exact (group_params.h), so only the add rounds.
  return {static_cast<float>(codes[index]) * scale_step,
          MulAdd(static_cast<float>(codes[groups + index]), zero_step, zero_base)};
}

// What a stream adds to its pages: nuq levels per channel as floats
// (levels[c * (1 << bits) + code]; null for uniform codes) and the fp8
// per-head scale.
struct SideExtras {
  const float* levels = nullptr;
  float fp8_scale = 1.0f;
};

// Element (row, c) of one side before outliers are applied.
KVQ_HD float DequantElement(const PageLayout& L, const SideLayout& S, const uint8_t* page,
                            int row, int c, const SideExtras& extras) {
  const uint8_t* code_row = PageLayout::CodeRow(page, S, row);
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
  }
  const int code = CodeAt(code_row, L.head_dim, S.bits, c);
  const ScaleZero p = ParamsAt(L, S, page, row, c);
  const float level =
      extras.levels ? extras.levels[c * (1 << S.bits) + code] : static_cast<float>(code);
  return MulAdd(p.scale, level, p.zero);
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
