// SIMD QuantizeRows / DequantizeRows of the cpu backend (the append and fetch
// paths of a stream).
//
// Both produce exactly what the reference produces:
//  * dequantization is simd_dequant-inl.h (same conversions, multiply then
//    add, -ffp-contract=off);
//  * quantization takes each group's min / max in lanes, sets the group
//    parameters with StoreGroupParams (scalar, shared with the reference)
//    and computes codes as UniformCode does (times the rounded reciprocal),
//    vectorized over channels (per-channel keys: one G-row block at a time;
//    per-token groups: one row at a time, or one block for p8, whose header
//    spans the block; kivi appends whole blocks), then
//    packs bit planes with shifts (the inverse of the unpack). Sparse
//    outliers are chosen by the same SelectOutliers and kept out of the
//    group ranges by +-inf in copies of the block that feed min / max. fp16
//    uses the F16C conversion (IEEE round to nearest even, as FloatToHalf)
//    on AVX2; other targets and the rare cases (fp8, nuq) use the reference.

#include "kernels/cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/simd_quant.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <vector>

#include "hwy/highway.h"
#include "kernels/cpu/outliers.h"
#include "kernels/cpu/quant_math.h"
#include "kernels/cpu/range_fit.h"
#include "kernels/cpu/simd_dequant-inl.h"
#include "kernels/cpu/simd_kernels.h"
#include "kernels/group_params.h"
#include "kernels/numeric.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace cpu {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;

struct QuantScratch {
  std::vector<uint8_t> codes;  // [rows][d]
  std::vector<float> scale, zero, inv;  // [d] or [groups]; inv = 1 / scale.
  std::vector<float> glo, ghi;     // Each group's min / max, laid out as scale / zero.
  // With sparse outliers: the block with +inf (lo) / -inf (hi) at the
  // outliers, the sources of the group minima / maxima, so the outliers stay
  // out of the range as in the reference.
  std::vector<float> lo, hi;
  std::vector<float> members;  // One group's elements, for `fit`.
  std::vector<uint16_t> half;  // fp16 scales, then zero points (StoreParams).
};

QuantScratch& ThreadQuantScratch() {
  static thread_local QuantScratch s;
  return s;
}

// round((x - zero) * inv) per lane, as UniformCode rounds it before
// clamping (inv = 1 / scale, and 0 where scale is 0, whose code is 0: with
// finite inputs, which Append checks, the product is then 0).
template <class D>
HWY_INLINE hn::Vec<D> RoundedQuotient(hn::Vec<D> a, hn::Vec<D> inv) {
  return hn::Round(hn::Mul(a, inv));
}

// UniformCode(x, {scale, zero}, bits) per lane, as a float; inv = 1 / scale
// (0 where scale is 0).
template <class D>
HWY_INLINE hn::Vec<D> CodeOf(D d, hn::Vec<D> x, hn::Vec<D> inv, hn::Vec<D> zero,
                             hn::Vec<D> top) {
  const hn::Vec<D> q = RoundedQuotient<D>(hn::Sub(x, zero), inv);
  return hn::Min(hn::Max(q, hn::Zero(d)), top);
}

// Stores integral floats in [0, 255] as bytes.
template <class D>
HWY_INLINE void StoreCodes(D d, hn::Vec<D> v, uint8_t* dst) {
#if KVQ_X86_AVX3
  if constexpr (hn::MaxLanes(D()) == 16) {
    // In range by construction: a plain conversion and the truncating
    // narrow (vpmovdb) instead of the saturating sequences.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v.raw)));
    return;
  }
#endif
  const hn::Rebind<int32_t, D> di;
  const hn::Rebind<uint8_t, D> d8;
  (void)d;
  hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, v)), d8, dst);
}

// codes[i] = UniformCode(x[i], ...) for i < n, n a multiple of D's lanes;
// per-lane parameters at inv / zero + i, or, with kBroadcast, one set at
// inv[0] / zero[0] for all.
template <bool kBroadcast, class D>
HWY_INLINE void CodesOf(D d, const float* HWY_RESTRICT x, const float* inv, const float* zero,
                        int n, float top, uint8_t* HWY_RESTRICT codes) {
  const size_t N = hn::Lanes(d);
  const hn::Vec<D> vtop = hn::Set(d, top);
  for (int i = 0; i < n; i += static_cast<int>(N)) {
    const size_t p = kBroadcast ? 0 : static_cast<size_t>(i);
    const hn::Vec<D> vi = kBroadcast ? hn::Set(d, inv[0]) : hn::LoadU(d, inv + p);
    const hn::Vec<D> vz = kBroadcast ? hn::Set(d, zero[0]) : hn::LoadU(d, zero + p);
    StoreCodes(d, CodeOf(d, hn::LoadU(d, x + i), vi, vz, vtop), codes + i);
  }
}

// CodesOf with the widest vector that divides n (16 lanes on AVX-512).
template <bool kBroadcast>
void CodesOfRow(const float* x, const float* inv, const float* zero, int n, float top,
                uint8_t* codes) {
  const hn::ScalableTag<float> dw;
  const hn::CappedTag<float, 8> d8;
  if (n % static_cast<int>(hn::Lanes(dw)) == 0) {
    CodesOf<kBroadcast>(dw, x, inv, zero, n, top, codes);
  } else {
    CodesOf<kBroadcast>(d8, x, inv, zero, n, top, codes);
  }
}

// inv[i] = 1 / scale[i], 0 where scale[i] is 0.
void Reciprocals(const float* scale, int n, float* inv) {
  for (int i = 0; i < n; ++i) inv[i] = scale[i] != 0.0f ? 1.0f / scale[i] : 0.0f;
}

// Packs one row of n byte codes into bit planes (inverse of UnpackRow).
void PackPlaneInto(const uint8_t* codes, int bytes, int b, int shift, uint8_t* plane) {
  const int per_byte = 8 / b;
  const uint8_t mask = static_cast<uint8_t>((1 << b) - 1);
  const hn::CappedTag<uint8_t, 16> d8;
  const int N = static_cast<int>(hn::Lanes(d8));
  int j = 0;
  if (bytes % N == 0) {
    const auto vmask = hn::Set(d8, mask);
    for (; j < bytes; j += N) {
      auto acc = hn::Zero(d8);
      for (int m = 0; m < per_byte; ++m) {
        auto v = hn::And(hn::ShiftRightSame(hn::LoadU(d8, codes + j + bytes * m), shift), vmask);
        acc = hn::Or(acc, hn::ShiftLeftSame(v, m * b));
      }
      hn::StoreU(acc, d8, plane + j);
    }
  }
  for (; j < bytes; ++j) {
    uint8_t byte = 0;
    for (int m = 0; m < per_byte; ++m) {
      byte |= static_cast<uint8_t>(((codes[j + bytes * m] >> shift) & mask) << (m * b));
    }
    plane[j] = byte;
  }
}

void PackRow(const uint8_t* codes, int n, int bits, uint8_t* row) {
  switch (bits) {
    case 8:
      std::memcpy(row, codes, n);
      return;
    case 4:
    case 2:
      PackPlaneInto(codes, n * bits / 8, bits, 0, row);
      return;
    case 3:
      PackPlaneInto(codes, n / 4, 2, 0, row);
      PackPlaneInto(codes, n / 8, 1, 2, row + n / 4);
      return;
  }
}

// Sparse outliers of `block` (g rows): the table as the reference writes it,
// and qs.lo / qs.hi, the block with the outliers masked for min / max.
void PrepareOutliers(const PageLayout& L, const SideLayout& S, const float* block, uint8_t* page,
                     int block_index, QuantScratch& qs) {
  const int g = L.block_tokens;
  const int d = L.head_dim;
  const int k = L.outliers_per_block;
  const size_t size = static_cast<size_t>(g) * d;
  qs.lo.assign(block, block + size);
  qs.hi.assign(block, block + size);
  const std::vector<int> idx = SelectOutliers(block, g, d, S, k);
  uint16_t* table = L.Outliers(page, S, block_index);
  for (int e = 0; e < k; ++e) {
    table[e] = static_cast<uint16_t>(idx[e]);
    table[k + e] = FloatToHalf(block[idx[e]]);
    qs.lo[idx[e]] = std::numeric_limits<float>::infinity();
    qs.hi[idx[e]] = -std::numeric_limits<float>::infinity();
  }
}

// The `fit` range of one group: its count elements at stride in `lo_src`
// (+inf marks a sparse outlier, left out as in the reference), in the
// reference's order; lo / hi hold the group's min / max and receive the fit.
void FitGroup(const float* lo_src, int count, size_t stride, int bits, float* lo, float* hi,
              std::vector<float>& members) {
  members.clear();
  for (int i = 0; i < count; ++i) {
    const float x = lo_src[i * stride];
    if (x != std::numeric_limits<float>::infinity()) members.push_back(x);
  }
  if (members.empty()) return;
  const FittedRange r =
      FitUniformRange(members.data(), static_cast<int>(members.size()), bits, *lo, *hi);
  *lo = r.lo;
  *hi = r.hi;
}

// FitUniformRange (range_fit.h) for one vector of channels [c, c + lanes)
// of a G-token key block at once, lane j for channel c + j, op for op in
// the same order, so the bytes are the reference's. lo_src is the block
// with +inf at sparse outliers, which count as absent (they add +0 where the
// reference skips them); glo / ghi hold each channel's min / max and
// receive the range. (Throughput-bound: four vectors in flight at once
// measured no faster.)
template <class D>
void FitChannelRanges(D df, const float* lo_src, int g, int d, int c, int bits, float* glo,
                      float* ghi) {
  using V = hn::Vec<D>;
  const V zero = hn::Zero(df);
  const V one = hn::Set(df, 1.0f);
  const V top = hn::Set(df, static_cast<float>((1 << bits) - 1));
  const V inf = hn::Set(df, std::numeric_limits<float>::infinity());
  const V mn = hn::LoadU(df, glo + c);
  const V mx = hn::LoadU(df, ghi + c);
  auto element = [&](int t) { return hn::LoadU(df, lo_src + static_cast<size_t>(t) * d + c); };
  auto squared_error = [&](V lo, V hi) {
    const V scale = hn::Div(hn::Sub(hi, lo), top);
    const V inv_scale = hn::IfThenElseZero(hn::Gt(scale, zero), hn::Div(one, scale));
    V sse = zero;
    for (int t = 0; t < g; ++t) {
      const V x = element(t);
      V q = hn::Round(hn::Mul(hn::Sub(x, lo), inv_scale));
      q = hn::Min(hn::Max(q, zero), top);
      const V e = hn::Sub(hn::Add(lo, hn::Mul(scale, q)), x);
      sse = hn::Add(sse, hn::IfThenElseZero(hn::Ne(x, inf), hn::Mul(e, e)));
    }
    return sse;
  };
  V count = zero, sx = zero;
  for (int t = 0; t < g; ++t) {
    const V x = element(t);
    const auto present = hn::Ne(x, inf);
    count = hn::Add(count, hn::IfThenElseZero(present, one));
    sx = hn::Add(sx, hn::IfThenElseZero(present, x));
  }
  const auto valid = hn::And(hn::Gt(mx, mn), hn::Ge(count, hn::Set(df, 2.0f)));
  if (hn::AllFalse(df, valid)) return;
  const V range = hn::Sub(mx, mn);
  V best_sse = squared_error(mn, mx);
  V best_lo = mn, best_hi = mx;
  for (int i = -kFitSteps; i <= kFitSteps; ++i) {
    const V inv_step = hn::Div(hn::Mul(top, hn::Set(df, FitStepFactor(i))), range);
    V sl = zero, sl2 = zero, slx = zero;
    for (int t = 0; t < g; ++t) {
      const V x = element(t);
      const auto present = hn::Ne(x, inf);
      V l = hn::Min(hn::Max(hn::Round(hn::Mul(hn::Sub(x, mn), inv_step)), zero), top);
      l = hn::IfThenElseZero(present, l);
      sl = hn::Add(sl, l);
      sl2 = hn::Add(sl2, hn::Mul(l, l));
      slx = hn::Add(slx, hn::IfThenElseZero(present, hn::Mul(l, x)));
    }
    const V det = hn::Sub(hn::Mul(count, sl2), hn::Mul(sl, sl));
    const V scale = hn::Div(hn::Sub(hn::Mul(count, slx), hn::Mul(sl, sx)), det);
    const V lo = hn::Div(hn::Sub(hn::Mul(sl2, sx), hn::Mul(sl, slx)), det);
    const V hi = hn::Add(lo, hn::Mul(scale, top));
    const V sse = squared_error(lo, hi);
    const auto storable =
        hn::And(hn::Ge(lo, hn::Set(df, -kFp16Max)), hn::Le(hi, hn::Set(df, kFp16Max)));
    const auto better = hn::And(hn::And(hn::And(valid, storable), hn::Gt(det, zero)),
                                hn::And(hn::Gt(scale, zero), hn::Lt(sse, best_sse)));
    best_sse = hn::IfThenElse(better, sse, best_sse);
    best_lo = hn::IfThenElse(better, lo, best_lo);
    best_hi = hn::IfThenElse(better, hi, best_hi);
  }
  hn::StoreU(best_lo, df, glo + c);
  hn::StoreU(best_hi, df, ghi + c);
}

// The fitted ranges of every channel of a key block.
template <class D>
void FitBlockRanges(D df, const float* lo_src, int g, int d, int bits, float* glo, float* ghi) {
  const int lanes = static_cast<int>(hn::Lanes(df));
  for (int c = 0; c < d; c += lanes) FitChannelRanges(df, lo_src, g, d, c, bits, glo, ghi);
}

// StoreGroupParams (uniform levels) with the parameter arithmetic in
// vectors: fp16 parameters through F16C, which rounds to nearest even as
// FloatToHalf does, so the bytes and the returned scale / zero are the
// reference's. A scalar call per row cost ~30 cycles per parameter, as much
// as quantizing the row. p8 parameters (a per-block search) stay scalar.
void StoreParams(const PageLayout& L, const SideLayout& S, uint8_t* page, int first_entry,
                 int entries, const float* lo, const float* hi, float* scale, float* zero,
                 QuantScratch& qs) {
#if KVQ_X86_AVX2
  if (S.param_bits == 16) {
    const int n = L.ParamsPerEntry(S);
    const int total = entries * n;
    qs.half.resize(2 * static_cast<size_t>(total) + 16);
    uint16_t* hs = qs.half.data();
    uint16_t* hz = hs + total + 8;
    const __m256 top = _mm256_set1_ps(static_cast<float>((1 << S.bits) - 1));
    int k = 0;
    for (; k + 8 <= total; k += 8) {
      __m256 mn = _mm256_loadu_ps(lo + k);
      __m256 mx = _mm256_loadu_ps(hi + k);
      const __m256 empty = _mm256_cmp_ps(mn, mx, _CMP_GT_OQ);  // As the reference: 0, 0.
      mn = _mm256_andnot_ps(empty, mn);
      mx = _mm256_andnot_ps(empty, mx);
      const __m128i sh =
          _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(mx, mn), top), _MM_FROUND_TO_NEAREST_INT);
      const __m128i zh = _mm256_cvtps_ph(mn, _MM_FROUND_TO_NEAREST_INT);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hs + k), sh);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hz + k), zh);
      _mm256_storeu_ps(scale + k, _mm256_cvtph_ps(sh));
      _mm256_storeu_ps(zero + k, _mm256_cvtph_ps(zh));
    }
    for (; k < total; ++k) {
      float mn = lo[k], mx = hi[k];
      if (mn > mx) mn = mx = 0.0f;
      const GroupParams g = MakeGroupParams(mn, mx, S.bits, false);
      hs[k] = FloatToHalf(g.scale);
      hz[k] = FloatToHalf(g.zero);
      scale[k] = g.scale;
      zero[k] = g.zero;
    }
    // An entry's parameters are its n scales, then its n zero points.
    for (int e = 0; e < entries; ++e) {
      uint16_t* p = L.Params(page, S, first_entry + e);
      std::memcpy(p, hs + static_cast<size_t>(e) * n, sizeof(uint16_t) * n);
      std::memcpy(p + n, hz + static_cast<size_t>(e) * n, sizeof(uint16_t) * n);
    }
    return;
  }
#endif
  (void)qs;
  StoreGroupParams(L, S, page, first_entry, entries, lo, hi, false, scale, zero);
}

void QuantizeAffine(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                    int row0) {
  const bool fitting = FitsRanges(s.spec(), side);
  const PageLayout& L = s.layout();
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  const int bits = S.bits;
  const int g = L.block_tokens;
  const bool outliers = L.outliers_per_block > 0;
  const float topf = static_cast<float>((1 << bits) - 1);
  const hn::CappedTag<float, 8> df;
  const int N = static_cast<int>(hn::Lanes(df));
  QuantScratch& qs = ThreadQuantScratch();
  qs.codes.resize(static_cast<size_t>(d) + N);
  uint8_t* codes = qs.codes.data();
  if (S.axis == ParamAxis::kChannelGroups) {
    qs.scale.resize(d);
    qs.zero.resize(d);
    qs.inv.resize(d);
    qs.glo.resize(d);
    qs.ghi.resize(d);
    for (int b = 0; b < n / g; ++b) {
      const float* block = rows + static_cast<size_t>(b) * g * d;
      const float* lo_src = block;
      const float* hi_src = block;
      if (outliers) {
        PrepareOutliers(L, S, block, page, row0 / g + b, qs);
        lo_src = qs.lo.data();
        hi_src = qs.hi.data();
      }
      for (int c = 0; c < d; c += N) {
        auto mn = hn::LoadU(df, lo_src + c);
        auto mx = hn::LoadU(df, hi_src + c);
        for (int t = 1; t < g; ++t) {
          mn = hn::Min(mn, hn::LoadU(df, lo_src + static_cast<size_t>(t) * d + c));
          mx = hn::Max(mx, hn::LoadU(df, hi_src + static_cast<size_t>(t) * d + c));
        }
        hn::StoreU(mn, df, qs.glo.data() + c);
        hn::StoreU(mx, df, qs.ghi.data() + c);
      }
      if (fitting) {
        // Lanes are independent channels here, so the widest vector serves
        // (16 on AVX-512) where it divides head_dim.
        const hn::ScalableTag<float> dfull;
        if (d % hn::Lanes(dfull) == 0) {
          FitBlockRanges(dfull, lo_src, g, d, bits, qs.glo.data(), qs.ghi.data());
        } else {
          FitBlockRanges(df, lo_src, g, d, bits, qs.glo.data(), qs.ghi.data());
        }
      }
      StoreParams(L, S, page, row0 / g + b, 1, qs.glo.data(), qs.ghi.data(), qs.scale.data(),
                  qs.zero.data(), qs);
      Reciprocals(qs.scale.data(), d, qs.inv.data());
      for (int t = 0; t < g; ++t) {
        const float* x = block + static_cast<size_t>(t) * d;
        CodesOfRow<false>(x, qs.inv.data(), qs.zero.data(), d, topf, codes);
        PackRow(codes, d, bits, PageLayout::CodeRow(page, S, row0 + b * g + t));
      }
    }
    return;
  }
  const int gc = S.group_channels;
  const int ng = d / gc;
  // Parameters are set a block at a time (p8's header spans the block's
  // rows; fp16 ones vectorize across them), or a row at a time when n is
  // not whole blocks.
  const int step = S.param_bits == 8 || n % g == 0 ? g : 1;
  qs.glo.resize(static_cast<size_t>(step) * ng);
  qs.ghi.resize(qs.glo.size());
  qs.scale.resize(qs.glo.size());
  qs.zero.resize(qs.glo.size());
  qs.inv.resize(qs.glo.size());
  for (int r0 = 0; r0 < n; r0 += step) {
    for (int r = r0; r < r0 + step; ++r) {
      const float* lo_src = rows + static_cast<size_t>(r) * d;
      const float* hi_src = lo_src;
      if (outliers && r / g < n / g) {  // Outliers live in whole blocks only.
        if (r % g == 0) PrepareOutliers(L, S, lo_src, page, row0 / g + r / g, qs);
        lo_src = qs.lo.data() + static_cast<size_t>(r % g) * d;
        hi_src = qs.hi.data() + static_cast<size_t>(r % g) * d;
      }
      for (int j = 0; j < ng; ++j) {
        auto mn = hn::LoadU(df, lo_src + j * gc);
        auto mx = hn::LoadU(df, hi_src + j * gc);
        for (int c = N; c < gc; c += N) {
          mn = hn::Min(mn, hn::LoadU(df, lo_src + j * gc + c));
          mx = hn::Max(mx, hn::LoadU(df, hi_src + j * gc + c));
        }
        const size_t k = static_cast<size_t>(r - r0) * ng + j;
        qs.glo[k] = hn::GetLane(hn::MinOfLanes(df, mn));
        qs.ghi[k] = hn::GetLane(hn::MaxOfLanes(df, mx));
        if (fitting) {
          FitGroup(lo_src + j * gc, gc, 1, bits, &qs.glo[k], &qs.ghi[k], qs.members);
        }
      }
    }
    StoreParams(L, S, page, row0 + r0, step, qs.glo.data(), qs.ghi.data(), qs.scale.data(),
                qs.zero.data(), qs);
    Reciprocals(qs.scale.data(), step * ng, qs.inv.data());
    for (int r = r0; r < r0 + step; ++r) {
      const float* x = rows + static_cast<size_t>(r) * d;
      for (int j = 0; j < ng; ++j) {
        const size_t k = static_cast<size_t>(r - r0) * ng + j;
        CodesOfRow<true>(x + j * gc, &qs.inv[k], &qs.zero[k], gc, topf,
                         codes + j * gc);
      }
      PackRow(codes, d, bits, PageLayout::CodeRow(page, S, row0 + r));
    }
  }
}

#if KVQ_X86_AVX3
// ---------------------------------------------------------------------------
// Whole G-token blocks of fp16 rows straight to codes (AVX-512): the append's
// common case, uniform 2-, 3- or 4-bit kivi with fp16 parameters and no sparse
// outliers or fitted ranges. QuantizeAffine gets floats that a separate pass
// converted, takes min / max in 8 lanes, writes byte codes and packs them in
// another pass. Here one pass converts a block (16 lanes, into an L1 buffer)
// while it takes the per-channel min / max, and the codes are packed into
// bit planes in registers. The arithmetic is QuantizeAffine's, op for op
// (the same min / max order, StoreParams, 1 / scale, CodeOf), so the bytes
// are the reference's.

// Whether QuantizeBlockHalf512 takes this side of the stream.
bool HalfBlocksApply(const KvStream& s, Side side) {
  const PageLayout& L = s.layout();
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  if (s.spec().nuq || FitsRanges(s.spec(), side) || L.outliers_per_block > 0) return false;
  if (S.format != CodeFormat::kPacked || S.bits < 2 || S.bits > 4 || S.param_bits != 16) {
    return false;
  }
  if (d != 64 && d != 128 && d != 256) return false;
  return S.axis == ParamAxis::kChannelGroups ||
         (S.group_channels % 16 == 0 && d % S.group_channels == 0);
}

// One bit plane of a packed row: byte j is sum_m field(code[j + P m]) <<
// (b m), P the plane's bytes, field = (code >> kShift) & (2^b - 1), the
// inverse of the unpack; c[i] holds the int32 codes of channels
// [16 i, 16 i + 16). kMask: codes can exceed the field (the 2-bit plane of
// 3-bit codes). Planes narrower than 16 bytes (1-bit at head_dim 64: 8
// bytes) fold the upper 8 lanes onto the lower ones.
template <int b, int kShift, bool kMask, int kD>
HWY_INLINE void PackPlane512(const __m512i* c, uint8_t* plane) {
  constexpr int kPlaneBytes = kD * b / 8;
  constexpr int kPerByte = 8 / b;
  const __m512i mask = _mm512_set1_epi32((1 << b) - 1);
  auto field = [&](int i) {
    const __m512i x = kShift == 0 ? c[i] : _mm512_srli_epi32(c[i], kShift);
    return kMask ? _mm512_and_si512(x, mask) : x;
  };
  if constexpr (kPlaneBytes >= 16) {
    constexpr int kChunks = kPlaneBytes / 16;
    for (int k = 0; k < kChunks; ++k) {
      __m512i acc = field(k);
      for (int m = 1; m < kPerByte; ++m) {
        acc = _mm512_or_si512(acc, _mm512_slli_epi32(field(k + kChunks * m), b * m));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(plane + 16 * k), _mm512_cvtepi32_epi8(acc));
    }
  } else {
    static_assert(kPlaneBytes == 8, "a plane of 8 or a multiple of 16 bytes");
    // Byte j takes channels j + 8 m: lane j of c[m / 2] for even m, lane
    // j + 8 for odd m.
    __m512i acc = field(0);
    for (int m = 2; m < kPerByte; m += 2) {
      acc = _mm512_or_si512(acc, _mm512_slli_epi32(field(m / 2), b * m));
    }
    const __m256i lo = _mm512_castsi512_si256(acc);
    const __m256i hi = _mm256_slli_epi32(_mm512_extracti64x4_epi64(acc, 1), b);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(plane),
                     _mm256_cvtepi32_epi8(_mm256_or_si256(lo, hi)));
  }
}

// A packed row of kBits codes: one plane for 2 and 4 bits; for 3 bits the
// low two bits in a 2-bit plane, then the high bit in a 1-bit plane.
template <int kBits, int kD>
HWY_INLINE void PackCodes512(const __m512i* c, uint8_t* row) {
  if constexpr (kBits == 3) {
    PackPlane512<2, 0, true, kD>(c, row);
    PackPlane512<1, 2, false, kD>(c, row + kD / 4);
  } else {
    PackPlane512<kBits, 0, false, kD>(c, row);
  }
}

// inv = 1 / scale, 0 where scale is 0 (Reciprocals, 16 at a time; the
// division is IEEE in both).
void Reciprocals512(const float* scale, int n, float* inv) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 s = _mm512_loadu_ps(scale + i);
    const __mmask16 nz = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    _mm512_storeu_ps(inv + i, _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0f), s));
  }
  Reciprocals(scale + i, n - i, inv + i);
}

// 16 fp16 values at p as floats.
HWY_INLINE __m512 LoadHalf16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Converts `g` fp16 rows of kD channels to floats in `f`.
template <int kD>
HWY_INLINE void HalfRowsTo512(const uint16_t* HWY_RESTRICT x, int g, float* HWY_RESTRICT f) {
  for (int i = 0; i < g * kD; i += 16) _mm512_storeu_ps(f + i, LoadHalf16(x + i));
}

// Room for `entries` parameter entries of each kind.
void SizeParams(QuantScratch& qs, size_t entries) {
  for (std::vector<float>* v : {&qs.glo, &qs.ghi, &qs.scale, &qs.zero, &qs.inv}) {
    v->resize(entries);
  }
}

// The g rows of floats at f (kD channels each) as codes, packed into code
// rows row0.. of the page; params(t, c) gives the 1 / scale and zero
// vectors of channels [16 c, 16 c + 16) of row t. CodeOf, with the clamp
// before the rounding (the same codes: the bounds 0 and top are integers)
// and the rounding done by the conversion (embedded round to nearest even):
// one instruction instead of vrndscaleps and vcvttps2dq.
template <int kBits, int kD, class ParamsOf>
HWY_INLINE void PackBlockCodes(const float* HWY_RESTRICT f, int g, ParamsOf params,
                               const SideLayout& S, uint8_t* page, int row0) {
  const __m512 top = _mm512_set1_ps(static_cast<float>((1 << kBits) - 1));
  for (int t = 0; t < g; ++t) {
    __m512i codes[kD / 16];
    for (int c = 0; c < kD / 16; ++c) {
      const auto [inv, zero] = params(t, c);
      const __m512 x = _mm512_loadu_ps(f + static_cast<size_t>(t) * kD + 16 * c);
      const __m512 q = _mm512_mul_ps(_mm512_sub_ps(x, zero), inv);
      codes[c] = _mm512_cvt_roundps_epi32(_mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), top),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    PackCodes512<kBits, kD>(codes, PageLayout::CodeRow(page, S, row0 + t));
  }
}

// One G-row block with per-channel groups (keys): min / max down each
// channel as the block converts, one parameter entry, then a packed row per
// token.
template <int kBits, int kD>
void QuantizeChannelBlockHalf(const PageLayout& L, const SideLayout& S,
                              const uint16_t* HWY_RESTRICT x, uint8_t* page, int row0,
                              QuantScratch& qs) {
  constexpr int C = kD / 16;
  const int g = L.block_tokens;
  qs.lo.resize(static_cast<size_t>(g) * kD);
  float* f = qs.lo.data();
  __m512 mn[C], mx[C];
  for (int c = 0; c < C; ++c) {
    mn[c] = mx[c] = LoadHalf16(x + 16 * c);
    _mm512_storeu_ps(f + 16 * c, mn[c]);
  }
  for (int t = 1; t < g; ++t) {
    for (int c = 0; c < C; ++c) {
      const size_t at = static_cast<size_t>(t) * kD + 16 * c;
      const __m512 v = LoadHalf16(x + at);
      _mm512_storeu_ps(f + at, v);
      mn[c] = _mm512_min_ps(mn[c], v);  // Operand order as QuantizeAffine's hn::Min.
      mx[c] = _mm512_max_ps(mx[c], v);
    }
  }
  SizeParams(qs, kD);
  for (int c = 0; c < C; ++c) {
    _mm512_storeu_ps(qs.glo.data() + 16 * c, mn[c]);
    _mm512_storeu_ps(qs.ghi.data() + 16 * c, mx[c]);
  }
  StoreParams(L, S, page, row0 / g, 1, qs.glo.data(), qs.ghi.data(), qs.scale.data(),
              qs.zero.data(), qs);
  Reciprocals512(qs.scale.data(), kD, qs.inv.data());
  PackBlockCodes<kBits, kD>(f, g, [&](int, int c) {
    return std::array{_mm512_loadu_ps(qs.inv.data() + 16 * c),
                      _mm512_loadu_ps(qs.zero.data() + 16 * c)};
  }, S, page, row0);
}

// Lane i of the result = op over the 16 lanes of v[i]: one tree of block
// and lane shuffles for all 16 (46 instructions), where a reduction each
// takes 8. Round 1 pairs 256-bit halves, round 2 128-bit blocks, rounds 3
// and 4 lanes within blocks; lane 4 b + l then holds v[4 l + b].
template <class Op>
HWY_INLINE __m512 ReduceLanes16(const __m512* v, Op op) {
  __m512 m[8], w[4], x[2];
  for (int i = 0; i < 8; ++i) {
    m[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {
    w[i] = op(_mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(m[2 * i], m[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {
    x[i] = op(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 r = op(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

// One G-row block with per-token groups of gc channels (values): the block
// converted, each row's group min / max (16 groups' lanes reduced
// together), the block's parameters in one StoreParams, then a packed row
// per token.
template <int kBits, int kD>
void QuantizeTokenBlockHalf(const PageLayout& L, const SideLayout& S,
                            const uint16_t* HWY_RESTRICT x, uint8_t* page, int row0,
                            QuantScratch& qs) {
  const int g = L.block_tokens;
  const int gc = S.group_channels;
  const int ng = kD / gc;
  const int per = gc / 16;  // Vectors per group.
  qs.lo.resize(static_cast<size_t>(g) * kD);
  float* f = qs.lo.data();
  HalfRowsTo512<kD>(x, g, f);
  const size_t entries = static_cast<size_t>(g) * ng;
  SizeParams(qs, entries);
  // Entry e = t * ng + j is group j of row t, at f + e * gc (ng * gc = kD):
  // its vectors' min (max), then 16 entries' lanes reduced together.
  auto group = [&](size_t e, auto op) {
    const float* p = f + e * gc;
    __m512 m = _mm512_loadu_ps(p);
    for (int i = 1; i < per; ++i) m = op(m, _mm512_loadu_ps(p + 16 * i));
    return m;
  };
  const auto min_op = [](__m512 a, __m512 b) { return _mm512_min_ps(a, b); };
  const auto max_op = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  size_t e = 0;
  for (; e + 16 <= entries; e += 16) {
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = group(e + i, min_op);
    _mm512_storeu_ps(qs.glo.data() + e, ReduceLanes16(v, min_op));
    for (int i = 0; i < 16; ++i) v[i] = group(e + i, max_op);
    _mm512_storeu_ps(qs.ghi.data() + e, ReduceLanes16(v, max_op));
  }
  for (; e < entries; ++e) {
    qs.glo[e] = _mm512_reduce_min_ps(group(e, min_op));
    qs.ghi[e] = _mm512_reduce_max_ps(group(e, max_op));
  }
  StoreParams(L, S, page, row0, g, qs.glo.data(), qs.ghi.data(), qs.scale.data(), qs.zero.data(),
              qs);
  Reciprocals512(qs.scale.data(), static_cast<int>(entries), qs.inv.data());
  PackBlockCodes<kBits, kD>(f, g, [&](int t, int c) {
    const size_t e = static_cast<size_t>(t) * ng + 16 * c / gc;
    return std::array{_mm512_set1_ps(qs.inv[e]), _mm512_set1_ps(qs.zero[e])};
  }, S, page, row0);
}

template <int kBits, int kD>
void QuantizeBlocksHalf(const PageLayout& L, const SideLayout& S, const uint16_t* rows, int n,
                        uint8_t* page, int row0) {
  QuantScratch& qs = ThreadQuantScratch();
  const int g = L.block_tokens;
  for (int b = 0; b < n; b += g) {
    const uint16_t* x = rows + static_cast<size_t>(b) * kD;
    if (S.axis == ParamAxis::kChannelGroups) {
      QuantizeChannelBlockHalf<kBits, kD>(L, S, x, page, row0 + b, qs);
    } else {
      QuantizeTokenBlockHalf<kBits, kD>(L, S, x, page, row0 + b, qs);
    }
  }
}

template <int kBits>
void QuantizeBlocksHalfOfDim(const PageLayout& L, const SideLayout& S, const uint16_t* rows,
                             int n, uint8_t* page, int row0) {
  switch (L.head_dim) {
    case 64: return QuantizeBlocksHalf<kBits, 64>(L, S, rows, n, page, row0);
    case 128: return QuantizeBlocksHalf<kBits, 128>(L, S, rows, n, page, row0);
    case 256: return QuantizeBlocksHalf<kBits, 256>(L, S, rows, n, page, row0);
  }
}
#endif  // KVQ_X86_AVX3

}  // namespace

bool QuantizeRowsImpl(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                      int row0) {
  const SideLayout& S = s.layout().side(side);
  const int d = s.head_dim();
  const hn::CappedTag<float, 8> df;
  const int N = static_cast<int>(hn::Lanes(df));
  switch (S.format) {
    case CodeFormat::kFp16:
#if KVQ_X86_AVX2
      for (int r = 0; r < n; ++r) {
        const float* x = rows + static_cast<size_t>(r) * d;
        auto* h = reinterpret_cast<uint16_t*>(PageLayout::CodeRow(page, S, row0 + r));
        for (int c = 0; c < d; c += 8) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(h + c),
                           _mm256_cvtps_ph(_mm256_loadu_ps(x + c), _MM_FROUND_TO_NEAREST_INT));
        }
      }
      return true;
#else
      return false;
#endif
    case CodeFormat::kBf16: {
      // Round to nearest even on the bits (inputs are finite: Append checks).
      const hn::RebindToUnsigned<decltype(df)> du;
      const hn::RebindToSigned<decltype(df)> di;
      const hn::Rebind<uint16_t, decltype(df)> d16;
      for (int r = 0; r < n; ++r) {
        const float* x = rows + static_cast<size_t>(r) * d;
        auto* b = reinterpret_cast<uint16_t*>(PageLayout::CodeRow(page, S, row0 + r));
        for (int c = 0; c < d; c += N) {
          const auto u = hn::BitCast(du, hn::LoadU(df, x + c));
          const auto odd = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
          const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), odd)));
          hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, rounded)), d16, b + c);
        }
      }
      return true;
    }
    case CodeFormat::kInt8:
    case CodeFormat::kCrq:
      return false;  // cpu_backend.cc sends crq to crq_cpu.h.
    case CodeFormat::kPacked:
      if (s.spec().nuq) return false;
      QuantizeAffine(s, side, rows, n, page, row0);
      return true;
    case CodeFormat::kFp8E4m3:
      return false;
  }
  return false;
}

void DequantizeRowsImpl(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                        float* out) {
  static thread_local SideContext ctx;
  ctx.Init(s, side);
  DequantRows(ctx, page, row0, n, out);
}

bool DequantizeRowsHalfImpl(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                            uint16_t* out, size_t stride) {
#if KVQ_X86_AVX3
  const SideLayout& S = s.layout().side(side);
  if (s.spec().nuq || (S.format != CodeFormat::kPacked && S.format != CodeFormat::kInt8)) {
    return false;
  }
  static thread_local SideContext ctx;
  ctx.Init(s, side);
  if (!UniformRows512Applies(ctx, S, s.head_dim())) return false;
  DequantUniformRows512(ctx, s.layout(), S, page, row0, n, out, stride);
  WriteOutliers(s.layout(), S, page, row0, n, out, stride);
  return true;
#else
  (void)s, (void)side, (void)page, (void)row0, (void)n, (void)out, (void)stride;
  return false;
#endif
}

bool QuantizeRowsHalfImpl(const KvStream& s, Side side, const uint16_t* rows, int n,
                          uint8_t* page, int row0) {
#if KVQ_X86_AVX3
  const PageLayout& L = s.layout();
  if (!HalfBlocksApply(s, side) || n % L.block_tokens != 0 || row0 % L.block_tokens != 0) {
    return false;
  }
  const SideLayout& S = L.side(side);
  switch (S.bits) {
    case 2: QuantizeBlocksHalfOfDim<2>(L, S, rows, n, page, row0); break;
    case 3: QuantizeBlocksHalfOfDim<3>(L, S, rows, n, page, row0); break;
    default: QuantizeBlocksHalfOfDim<4>(L, S, rows, n, page, row0); break;
  }
  return true;
#else
  (void)s, (void)side, (void)rows, (void)n, (void)page, (void)row0;
  return false;
#endif
}

// Row conversions for tensors at the API edge (RowToFloat / FloatToRow).
void HalfToFloatImpl(const uint16_t* src, size_t n, float* dst) {
  constexpr size_t kStep = size_t{1} << 20;  // HalfRowToFloat takes an int.
  for (size_t i = 0; i < n; i += kStep) {
    HalfRowToFloat(src + i, static_cast<int>(std::min(kStep, n - i)), dst + i);
  }
}

void FloatToHalfImpl(const float* src, size_t n, uint16_t* dst) {
  size_t c = 0;
#if KVQ_X86_AVX2
  for (; c + 8 <= n; c += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + c), _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; c < n; ++c) Store16(dst, c, FloatToHalf(src[c]));  // dst may be misaligned.
}

// max over i of (src[i] with the sign bit cleared): the magnitude bits, which
// order like the magnitudes for finite values and sort Inf / NaN above them.
template <typename T>
T MaxAbsBits(const T* HWY_RESTRICT src, size_t n) {
  const hn::CappedTag<T, 32 / sizeof(T)> d;
  const size_t N = hn::Lanes(d);
  const auto magnitude = hn::Set(d, static_cast<T>(static_cast<T>(~T{0}) >> 1));
  auto m0 = hn::Zero(d), m1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    m0 = hn::Max(m0, hn::And(hn::LoadU(d, src + i), magnitude));
    m1 = hn::Max(m1, hn::And(hn::LoadU(d, src + i + N), magnitude));
  }
  T m = hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1)));
  for (; i < n; ++i) {  // src may be misaligned (a tensor inside a message).
    T x;
    std::memcpy(&x, src + i, sizeof(T));
    m = std::max(m, static_cast<T>(x & hn::GetLane(magnitude)));
  }
  return m;
}
uint16_t MaxAbsBits16Impl(const uint16_t* src, size_t n) { return MaxAbsBits(src, n); }
uint32_t MaxAbsBits32Impl(const uint32_t* src, size_t n) { return MaxAbsBits(src, n); }

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq {
namespace cpu {

HWY_EXPORT(QuantizeRowsImpl);
HWY_EXPORT(QuantizeRowsHalfImpl);
HWY_EXPORT(DequantizeRowsImpl);
HWY_EXPORT(DequantizeRowsHalfImpl);
HWY_EXPORT(HalfToFloatImpl);
HWY_EXPORT(FloatToHalfImpl);
HWY_EXPORT(MaxAbsBits16Impl);
HWY_EXPORT(MaxAbsBits32Impl);

uint16_t MaxAbsBits16(const uint16_t* src, size_t n) {
  return HWY_DYNAMIC_DISPATCH(MaxAbsBits16Impl)(src, n);
}
uint32_t MaxAbsBits32(const uint32_t* src, size_t n) {
  return HWY_DYNAMIC_DISPATCH(MaxAbsBits32Impl)(src, n);
}

void HalfToFloatSimd(const uint16_t* src, size_t n, float* dst) {
  HWY_DYNAMIC_DISPATCH(HalfToFloatImpl)(src, n, dst);
}

void FloatToHalfSimd(const float* src, size_t n, uint16_t* dst) {
  HWY_DYNAMIC_DISPATCH(FloatToHalfImpl)(src, n, dst);
}

bool QuantizeRowsSimd(const KvStream& stream, Side side, const float* rows, int n,
                      uint8_t* page, int row0) {
  return HWY_DYNAMIC_DISPATCH(QuantizeRowsImpl)(stream, side, rows, n, page, row0);
}

bool QuantizeRowsHalfSimd(const KvStream& stream, Side side, const uint16_t* rows, int n,
                          uint8_t* page, int row0) {
  return HWY_DYNAMIC_DISPATCH(QuantizeRowsHalfImpl)(stream, side, rows, n, page, row0);
}

void DequantizeRowsSimd(const KvStream& stream, Side side, const uint8_t* page, int row0,
                        int n, float* out) {
  HWY_DYNAMIC_DISPATCH(DequantizeRowsImpl)(stream, side, page, row0, n, out);
}

bool DequantizeRowsHalfSimd(const KvStream& stream, Side side, const uint8_t* page, int row0,
                            int n, uint16_t* out, size_t stride) {
  return HWY_DYNAMIC_DISPATCH(DequantizeRowsHalfImpl)(stream, side, page, row0, n, out, stride);
}

}  // namespace cpu
}  // namespace kvq
#endif
