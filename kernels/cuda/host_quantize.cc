// The quantize and dequantize halves of "cuda_host": quant_hd.h and
// dequant_hd.h composed in plain loops, one quantization unit (a block of
// rows whose parameters are set together) at a time, in the order the
// device kernels run the same functions (kernels/cuda/cuda_quantize.cu).
#include <cstdint>
#include <vector>

#include "kernels/hd/dequant_hd.h"
#include "kernels/cuda/host_program_backend.h"
#include "kernels/hd/quant_hd.h"
#include "kernels/hd/crq_hd.h"
#include "kernels/crq_transform.h"
#include "kernels/cuda/stream_view_host.h"
#include "kernels/cpu/range_fit.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"

namespace kvq {

namespace {

// Picks the unit's outliers (outliers_per_block > 0), writes the block's
// table and marks them in `is_outlier` ([rows * head_dim]).
void SelectUnitOutliers(const PageLayout& L, const SideLayout& S, const float* unit, int rows,
                        uint8_t* table, std::vector<uint8_t>& is_outlier) {
  const int d = L.head_dim;
  const int groups = hd::GroupsPerUnit(L, S, rows);
  std::vector<hd::RobustCenter> centers(groups);
  for (int k = 0; k < groups; ++k) {
    centers[k] = hd::RobustCenterOf(hd::GroupAt(L, S, unit, rows, k, hd::NoMask{}));
  }
  auto score = [&](int i) {
    return hd::OutlierScore(unit[i], centers[hd::GroupOf(L, S, i / d, i % d)]);
  };
  const int k = L.outliers_per_block;
  int prev = -1;
  float prev_score = 0.0f;
  for (int e = 0; e < k; ++e) {
    const int i = hd::NextOutlierOrUnchosen(score, rows * d, prev_score, prev,
                                             hd::ByteMask{is_outlier.data()});
    prev = i;
    prev_score = score(i);
    is_outlier[i] = 1;
    hd::StoreHalfBits(table + 2 * e, static_cast<uint16_t>(i));
    hd::StoreHalfBits(table + 2 * (k + e), hd::FloatToHalf(unit[i]));
  }
}

// One unit of an int8 / packed side: `rows` rows from page row `row` on
// (a whole block for block-quantized sides).
void QuantizeUnit(const KvStream& s, Side side, const float* unit, int rows, uint8_t* page,
                  int row, const float* levels) {
  const PageLayout& L = s.layout();
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  const bool channels = S.axis == ParamAxis::kChannelGroups;
  const bool nuq = s.spec().nuq;
  const bool fit = FitsRanges(s.spec(), side);
  std::vector<uint8_t> is_outlier(static_cast<size_t>(rows) * d, 0);
  if (L.outliers_per_block > 0) {
    uint8_t* table = reinterpret_cast<uint8_t*>(L.Outliers(page, S, row / L.block_tokens));
    SelectUnitOutliers(L, S, unit, rows, table, is_outlier);
  }
  const hd::ByteMask mask{is_outlier.data()};
  const int groups = hd::GroupsPerUnit(L, S, rows);
  std::vector<hd::Range> ranges(groups);
  for (int k = 0; k < groups; ++k) {
    ranges[k] = hd::GroupRange(hd::GroupAt(L, S, unit, rows, k, mask), S.bits, fit);
  }
  std::vector<hd::ScaleZero> params(groups);
  const int np = L.ParamsPerEntry(S);
  if (S.param_bits == 16) {
    for (int k = 0; k < groups; ++k) {
      params[k] = hd::Params16(ranges[k], S.bits, nuq);
      const int entry = channels ? row / L.block_tokens : row + k / np;
      uint8_t* p = reinterpret_cast<uint8_t*>(L.Params(page, S, entry));
      const int i = channels ? k : k % np;
      hd::StoreHalfBits(p + 2 * i, hd::FloatToHalf(params[k].scale));
      hd::StoreHalfBits(p + 2 * (np + i), hd::FloatToHalf(params[k].zero));
    }
  } else {
    const float top = hd::Params8Top(S.bits, nuq);
    float zmin = hd::Infinity(), zmax = -hd::Infinity();
    for (int k = 0; k < groups; ++k) {
      zmin = hd::MinOf(zmin, hd::Params8Low(ranges[k]));
      zmax = hd::MaxOf(zmax, hd::Params8Low(ranges[k]));
    }
    const hd::ZeroSteps8 z = hd::ZeroSteps(zmin, zmax);
    uint8_t* block = L.ParamBlock(page, S, row / L.block_tokens);
    uint8_t* scale_codes = block + kParams8HeaderBytes;
    uint8_t* zero_codes = scale_codes + groups;
    std::vector<float> needed(groups);
    float smax = 0.0f;
    for (int k = 0; k < groups; ++k) {
      const hd::Code8 zc = hd::ZeroCode8(ranges[k], z);
      zero_codes[k] = zc.code;
      params[k].zero = zc.value;
      needed[k] = hd::NeededScale8(ranges[k], zc.value, top);
      smax = hd::MaxOf(smax, needed[k]);
    }
    const hd::ZeroSteps8 sstep = hd::ScaleStep8(smax);
    for (int k = 0; k < groups; ++k) {
      const hd::Code8 sc = hd::ScaleCode8(ranges[k], needed[k], params[k].zero, sstep.step, top);
      scale_codes[k] = sc.code;
      params[k].scale = sc.value;
    }
    hd::StoreParams8Header(block, sstep.step_bits, z.base_bits, z.step_bits);
  }
  for (int t = 0; t < rows; ++t) {
    const float* x = unit + static_cast<size_t>(t) * d;
    auto code = [&](int c) {
      return hd::CodeOf(x[c], params[hd::GroupOf(L, S, t, c)], S.bits, levels, c);
    };
    uint8_t* out = PageLayout::CodeRow(page, S, row + t);
    for (int j = 0; j < hd::PackedRowBytes(d, S.bits); ++j) {
      out[j] = hd::PackedByte(code, d, S.bits, j);
    }
  }
}

}  // namespace

void HostQuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                      int row0) {
  page = HostPagePointer(s, page);
  const PageLayout& L = s.layout();
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  switch (S.format) {
    case CodeFormat::kFp16:
    case CodeFormat::kBf16:
      for (int r = 0; r < n; ++r) {
        uint8_t* out = PageLayout::CodeRow(page, S, row0 + r);
        for (int c = 0; c < d; ++c) {
          const float x = rows[static_cast<size_t>(r) * d + c];
          hd::StoreHalfBits(out + 2 * c, S.format == CodeFormat::kFp16 ? hd::FloatToHalf(x)
                                                                      : hd::FloatToBf16(x));
        }
      }
      return;
    case CodeFormat::kFp8E4m3: {
      const float inv = hd::Div(1.0f, s.fp8_scale(side));
      for (int r = 0; r < n; ++r) {
        uint8_t* out = PageLayout::CodeRow(page, S, row0 + r);
        for (int c = 0; c < d; ++c) {
          out[c] = hd::FloatToFp8E4m3(hd::Mul(rows[static_cast<size_t>(r) * d + c], inv));
        }
      }
      return;
    }
    case CodeFormat::kInt8:
    case CodeFormat::kPacked:
      break;
    case CodeFormat::kCrq: {
      const hd::CrqCodebooks& cb = CrqCodebooks();
      std::vector<uint8_t> codes(d);
      for (int r = 0; r < n; ++r) {
        hd::CrqStoreRow(rows + static_cast<size_t>(r) * d, d, S.half_bits, cb, codes.data(),
                        PageLayout::CodeRow(page, S, row0 + r),
                        reinterpret_cast<uint8_t*>(PageLayout::Gain(page, S, row0 + r)));
      }
      return;
    }
  }
  const std::vector<float> levels = LevelsAsFloats(s, side);
  const int g = L.block_tokens;
  for (int r = 0; r < n; r += g) {
    QuantizeUnit(s, side, rows + static_cast<size_t>(r) * d, g, page, row0 + r,
                 levels.empty() ? nullptr : levels.data());
  }
}

void HostDequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                        float* out) {
  const SideLayout& S = s.layout().side(side);
  if (S.format == CodeFormat::kCrq) {
    const int d = s.head_dim();
    const hd::CrqCodebooks& cb = CrqCodebooks();
    for (int r = 0; r < n; ++r) {
      const uint8_t* row = PageLayout::CodeRow(page, S, row0 + r);
      const float gain = hd::HalfToFloat(
          hd::LoadHalfBits(reinterpret_cast<const uint8_t*>(PageLayout::Gain(page, S, row0 + r))));
      for (int c = 0; c < d; ++c) {
        out[static_cast<size_t>(r) * d + c] = hd::CrqDequant(row, d, S.half_bits, gain, cb, c);
      }
    }
    return;
  }
  const std::vector<float> levels = LevelsAsFloats(s, side);
  hd::DequantRows(s.layout(), side, page, row0, n,
                  ExtrasFor(s, side, levels.empty() ? nullptr : levels.data()), out);
}

}  // namespace kvq
