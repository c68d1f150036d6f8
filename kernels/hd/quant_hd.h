// Quantizing one group of a page: the per-group math the device quantize
// kernels and the "cuda_host" backend share, the writing half of
// dequant_hd.h. Every function gives the bits of the reference's
// (kernels/cpu/quant_math.h, kernels/group_params.cc, kernels/cpu/range_fit.cc,
// kernels/cpu/outliers.cc, PackCodes in kernels/page_layout.cc), which stays
// the truth: tests/unit/quant_hd_test.cc compares them function by function
// and the typed suites compare cuda_host's pages with the reference's.
//
// What the reference does with host-only tools is done here without them,
// to the same result:
// - std::vector scratch: groups are read in place through StridedGroup,
//   outliers are left out through a mask the caller keeps.
// - std::nth_element (the median and the MAD of a group): KthSmallest
//   counts ranks instead, O(m^2) for a group of m <= 256 elements but no
//   scratch and no data-dependent swaps.
// - std::partial_sort (the top k outliers): NextOutlier walks the same
//   strict total order one element at a time.
// - FitStepFactor's double arithmetic: the same expression (device doubles
//   are IEEE), no libm.
// Every float operation rounds on its own: on the device through the _rn
// intrinsics, which nvcc never contracts into a fused multiply-add; on the
// host the files that use this header compile with -ffp-contract=off.
#ifndef KVQ_KERNELS_HD_QUANT_HD_H_
#define KVQ_KERNELS_HD_QUANT_HD_H_

#include <cmath>
#include <cstdint>

#include "kernels/hd/dequant_hd.h"
#include "kernels/hd/hd.h"
#include "kernels/hd/numeric_hd.h"
#include "kernels/page_layout.h"

namespace kvq::hd {

// --- Single rounded float operations. ---
KVQ_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVQ_HD float Sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KVQ_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVQ_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// Round to nearest, ties to even (std::nearbyint in the default mode).
KVQ_HD float RoundEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}
KVQ_HD float Abs(float x) { return BitsToFloat(FloatBits(x) & 0x7fffffffu); }
KVQ_HD float Infinity() { return BitsToFloat(0x7f800000u); }
// std::min / std::max exactly: on equal operands (+0 and -0) the first one
// is kept, which decides the sign of a zero range end.
KVQ_HD float MinOf(float a, float b) { return b < a ? b : a; }
KVQ_HD float MaxOf(float a, float b) { return a < b ? b : a; }

KVQ_HD void StoreHalfBits(uint8_t* p, uint16_t h) {
  p[0] = static_cast<uint8_t>(h & 0xff);
  p[1] = static_cast<uint8_t>(h >> 8);
}

// fp16 rounding toward -inf / +inf (the p8 encoder's directed rounding,
// kernels/group_params.h).
KVQ_HD uint16_t FloatToHalfDown(float f) {
  const uint16_t h = FloatToHalf(f);
  if (!(HalfToFloat(h) > f)) return h;
  if ((h & 0x7fffu) == 0) return 0x8001u;  // Down from +-0: the smallest negative.
  return (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}
KVQ_HD uint16_t FloatToHalfUp(float f) {
  return static_cast<uint16_t>(FloatToHalfDown(-f) ^ 0x8000u);
}

// --- A group's elements, read in place. ---

// Element types of input rows: floats, or fp16 bit patterns.
KVQ_HD float ElementToFloat(float x) { return x; }
KVQ_HD float ElementToFloat(uint16_t h) { return HalfToFloat(h); }

// Which elements of a quantization unit (a block of rows, row-major, flat
// index t * head_dim + c) are sparse outliers. NoMask: none.
struct NoMask {
  KVQ_HD bool operator()(int) const { return false; }
};
struct ByteMask {
  const uint8_t* bytes = nullptr;
  KVQ_HD bool operator()(int i) const { return bytes[i] != 0; }
};
struct BitMask {
  const uint32_t* words = nullptr;
  KVQ_HD bool operator()(int i) const { return (words[i >> 5] >> (i & 31)) & 1u; }
};

// One group: `count` elements of a unit from flat index `first` on, `stride`
// apart (head_dim for a channel over tokens, 1 for a run of channels).
template <class T, class Mask>
struct StridedGroup {
  const T* unit = nullptr;
  int first = 0;
  int stride = 1;
  int count = 0;
  Mask outlier{};

  KVQ_HD int flat(int i) const { return first + i * stride; }
  KVQ_HD float at(int i) const { return ElementToFloat(unit[flat(i)]); }
  KVQ_HD bool member(int i) const { return !outlier(flat(i)); }
};

// Group k of a unit of `rows` rows of side S (the reference's numbering:
// channel k for channel groups, row k / n and run k % n for token groups).
KVQ_HD int GroupsPerUnit(const PageLayout& L, const SideLayout& S, int rows) {
  return S.axis == ParamAxis::kChannelGroups ? L.head_dim : rows * L.ParamsPerEntry(S);
}
KVQ_HD int GroupOf(const PageLayout& L, const SideLayout& S, int t, int c) {
  return S.axis == ParamAxis::kChannelGroups ? c
                                             : t * L.ParamsPerEntry(S) + c / S.group_channels;
}
template <class T, class Mask>
KVQ_HD StridedGroup<T, Mask> GroupAt(const PageLayout& L, const SideLayout& S, const T* unit,
                                     int rows, int k, Mask mask) {
  StridedGroup<T, Mask> g;
  g.unit = unit;
  g.outlier = mask;
  if (S.axis == ParamAxis::kChannelGroups) {
    g.first = k;
    g.stride = L.head_dim;
    g.count = rows;
  } else {
    const int n = L.ParamsPerEntry(S);
    g.first = (k / n) * L.head_dim + (k % n) * S.group_channels;
    g.stride = 1;
    g.count = S.group_channels;
  }
  return g;
}

// --- Ranges. ---

struct Range {
  float lo = 0.0f;
  float hi = 0.0f;
};

// Min and max of the group's members in element order; lo > hi (+inf,
// -inf) when every element is an outlier.
template <class G>
KVQ_HD Range MemberMinMax(const G& g) {
  Range r{Infinity(), -Infinity()};
  for (int i = 0; i < g.count; ++i) {
    if (!g.member(i)) continue;
    const float x = g.at(i);
    r.lo = MinOf(r.lo, x);
    r.hi = MaxOf(r.hi, x);
  }
  return r;
}

template <class G>
KVQ_HD int MemberCount(const G& g) {
  int n = 0;
  for (int i = 0; i < g.count; ++i) n += g.member(i) ? 1 : 0;
  return n;
}

// `fit` (kernels/cpu/range_fit.h): the candidate steps and the search.
inline constexpr int kFitStepsHd = 10;
KVQ_HD float FitStepFactorHd(int i) {
  return static_cast<float>(1.0 + 0.125 * i / kFitStepsHd);
}

// UniformSquaredError over the group's members, in element order.
template <class G>
KVQ_HD float MemberSquaredError(const G& g, int bits, float lo, float hi) {
  const float top = static_cast<float>((1 << bits) - 1);
  const float scale = Div(Sub(hi, lo), top);
  const float inv_scale = scale > 0.0f ? Div(1.0f, scale) : 0.0f;
  float sse = 0.0f;
  for (int i = 0; i < g.count; ++i) {
    if (!g.member(i)) continue;
    const float x = g.at(i);
    float q = RoundEven(Mul(Sub(x, lo), inv_scale));
    q = MinOf(MaxOf(q, 0.0f), top);
    const float e = Sub(Add(lo, Mul(scale, q)), x);
    sse = Add(sse, Mul(e, e));
  }
  return sse;
}

// FitUniformRange over the group's members (n of them, min / max their
// extremes).
template <class G>
KVQ_HD Range FitMemberRange(const G& g, int n, int bits, float min, float max) {
  Range best{min, max};
  if (!(max > min) || n < 2) return best;
  const float top = static_cast<float>((1 << bits) - 1);
  const float count = static_cast<float>(n);
  const float range = Sub(max, min);
  float best_sse = MemberSquaredError(g, bits, min, max);
  float sx = 0.0f;
  for (int j = 0; j < g.count; ++j) {
    if (g.member(j)) sx = Add(sx, g.at(j));
  }
  const float fp16_max = 65504.0f;
  for (int i = -kFitStepsHd; i <= kFitStepsHd; ++i) {
    const float inv_step = Div(Mul(top, FitStepFactorHd(i)), range);
    float sl = 0.0f, sl2 = 0.0f, slx = 0.0f;
    for (int j = 0; j < g.count; ++j) {
      if (!g.member(j)) continue;
      const float x = g.at(j);
      const float l = MinOf(MaxOf(RoundEven(Mul(Sub(x, min), inv_step)), 0.0f), top);
      sl = Add(sl, l);
      sl2 = Add(sl2, Mul(l, l));
      slx = Add(slx, Mul(l, x));
    }
    const float det = Sub(Mul(count, sl2), Mul(sl, sl));
    if (!(det > 0.0f)) continue;
    const float scale = Div(Sub(Mul(count, slx), Mul(sl, sx)), det);
    const float zero = Div(Sub(Mul(sl2, sx), Mul(sl, slx)), det);
    if (!(scale > 0.0f)) continue;
    const float hi = Add(zero, Mul(scale, top));
    if (!(zero >= -fp16_max && hi <= fp16_max)) continue;
    const float sse = MemberSquaredError(g, bits, zero, hi);
    if (sse < best_sse) {
      best_sse = sse;
      best = {zero, hi};
    }
  }
  return best;
}

// The range a group is quantized over: min/max of its members ([0, 0]
// when there are none), or with `fit` the fitted range of them.
template <class G>
KVQ_HD Range GroupRange(const G& g, int bits, bool fit) {
  Range r = MemberMinMax(g);
  if (r.lo > r.hi) return {0.0f, 0.0f};
  if (fit) r = FitMemberRange(g, MemberCount(g), bits, r.lo, r.hi);
  return r;
}

// --- Parameters. ---

// fp16 parameters of one group (MakeGroupParams): the decoded floats; the
// stored bits are FloatToHalf of them. A group with lo > hi gets [0, 0].
KVQ_HD ScaleZero Params16(Range r, int bits, bool nuq) {
  if (r.lo > r.hi) r = {0.0f, 0.0f};
  const float range = Sub(r.hi, r.lo);
  const float scale = nuq ? range : Div(range, static_cast<float>((1 << bits) - 1));
  return {RoundToHalf(scale), RoundToHalf(r.lo)};
}

// p8 (kernels/group_params.h), in the encoder's order: the zero points'
// span over the block's groups, the header's zero base and step, each
// group's zero code, the scale step from the largest scale a group needs,
// each group's scale code.
KVQ_HD float Params8Low(Range r) { return r.lo > r.hi ? 0.0f : r.lo; }
KVQ_HD float Params8High(Range r) { return r.lo > r.hi ? 0.0f : r.hi; }
// The levels' span: 2^bits - 1 codes, or nuq's normalised [0, 1].
KVQ_HD float Params8Top(int bits, bool nuq) {
  return nuq ? 1.0f : static_cast<float>((1 << bits) - 1);
}

struct ZeroSteps8 {
  uint16_t base_bits = 0;
  uint16_t step_bits = 0;
  float base = 0.0f;
  float step = 0.0f;
};
// zmin / zmax: MinOf / MaxOf of Params8Low over the groups in order, from
// +inf / -inf.
KVQ_HD ZeroSteps8 ZeroSteps(float zmin, float zmax) {
  ZeroSteps8 z;
  z.base_bits = FloatToHalfDown(zmin);
  z.base = HalfToFloat(z.base_bits);
  z.step_bits = FloatToHalfUp(Div(Sub(zmax, z.base), 255.0f));
  z.step = HalfToFloat(z.step_bits);
  return z;
}

struct Code8 {
  uint8_t code = 0;
  float value = 0.0f;  // The decoded parameter.
};
KVQ_HD int ClampCode8(int v) { return v < 0 ? 0 : (v > 255 ? 255 : v); }

// The largest zero code whose decoded zero is at or below the group's low
// end (the division may round up across an integer: step back).
KVQ_HD Code8 ZeroCode8(Range r, const ZeroSteps8& z) {
  const float l = Params8Low(r);
#if defined(__CUDA_ARCH__)
  int code = z.step > 0.0f ? static_cast<int>(floorf(Div(Sub(l, z.base), z.step))) : 0;
#else
  int code = z.step > 0.0f ? static_cast<int>(std::floor(Div(Sub(l, z.base), z.step))) : 0;
#endif
  code = ClampCode8(code);
  while (code > 0 && Add(z.base, Mul(static_cast<float>(code), z.step)) > l) --code;
  return {static_cast<uint8_t>(code), Add(z.base, Mul(static_cast<float>(code), z.step))};
}

// The scale step a group needs above its decoded zero; the block's scale
// step is ScaleStep8 of the MaxOf of these (from 0).
KVQ_HD float NeededScale8(Range r, float zero, float top) {
  return MaxOf(0.0f, Div(Sub(Params8High(r), zero), top));
}
KVQ_HD ZeroSteps8 ScaleStep8(float smax) {
  ZeroSteps8 s;
  s.step_bits = FloatToHalfUp(Div(smax, 255.0f));
  s.step = HalfToFloat(s.step_bits);
  return s;
}
// The smallest scale code from the needed scale up whose decoded range
// reaches the group's high end.
KVQ_HD Code8 ScaleCode8(Range r, float needed, float zero, float scale_step, float top) {
  const float u = Params8High(r);
#if defined(__CUDA_ARCH__)
  int code = scale_step > 0.0f ? static_cast<int>(ceilf(Div(needed, scale_step))) : 0;
#else
  int code = scale_step > 0.0f ? static_cast<int>(std::ceil(Div(needed, scale_step))) : 0;
#endif
  code = ClampCode8(code);
  while (code < 255 && Add(zero, Mul(Mul(static_cast<float>(code), scale_step), top)) < u) {
    ++code;
  }
  return {static_cast<uint8_t>(code), Mul(static_cast<float>(code), scale_step)};
}

// The 8-byte p8 header: scale step, zero base, zero step, 0.
KVQ_HD void StoreParams8Header(uint8_t* block, uint16_t scale_step, uint16_t zero_base,
                               uint16_t zero_step) {
  StoreHalfBits(block, scale_step);
  StoreHalfBits(block + 2, zero_base);
  StoreHalfBits(block + 4, zero_step);
  StoreHalfBits(block + 6, 0);
}

// --- Codes. ---

// UniformCode: the reciprocal rounded once, then the product, to nearest
// even, clamped to [0, 2^bits - 1].
KVQ_HD uint8_t UniformCode(float x, ScaleZero p, int bits) {
  if (p.scale == 0.0f) return 0;
  const float inv = Div(1.0f, p.scale);
  const float q = RoundEven(Mul(Sub(x, p.zero), inv));
  const float top = static_cast<float>((1 << bits) - 1);
  return static_cast<uint8_t>(q < 0.0f ? 0.0f : (q > top ? top : q));
}

// Nearest of `n` sorted levels to the normalised x (ties to the lower).
KVQ_HD uint8_t NearestLevel(float x, ScaleZero p, const float* levels, int n) {
  const float u = p.scale == 0.0f ? 0.0f : Div(Sub(x, p.zero), p.scale);
  int best = 0;
  float best_d = Abs(Sub(u, levels[0]));
  for (int i = 1; i < n; ++i) {
    const float d = Abs(Sub(u, levels[i]));
    if (d < best_d) {
      best_d = d;
      best = i;
    }
  }
  return static_cast<uint8_t>(best);
}

// Code of x in channel c: a nuq level (levels channel-major, as
// SideExtras) or the uniform code.
KVQ_HD uint8_t CodeOf(float x, ScaleZero p, int bits, const float* levels, int c) {
  return levels ? NearestLevel(x, p, levels + c * (1 << bits), 1 << bits) : UniformCode(x, p, bits);
}

// Byte j of a packed row of n codes (page_layout.h's bit planes), codes
// from code(c).
template <class CodeFn>
KVQ_HD uint8_t PackedByte(const CodeFn& code, int n, int bits, int j) {
  if (bits == 8) return static_cast<uint8_t>(code(j));
  int b = bits;
  int shift = 0;
  if (bits == 3) {  // A 2-bit plane of the low bits, then a 1-bit plane of the high bit.
    const int low_bytes = n / 4;
    if (j < low_bytes) {
      b = 2;
    } else {
      b = 1;
      shift = 2;
      j -= low_bytes;
    }
  }
  const int p = n * b / 8;
  const int mask = (1 << b) - 1;
  int byte = 0;
  for (int m = 0; m < 8 / b; ++m) byte |= ((code(j + p * m) >> shift) & mask) << (m * b);
  return static_cast<uint8_t>(byte);
}
KVQ_HD int PackedRowBytes(int n, int bits) { return n * bits / 8; }

// --- Outliers (kernels/cpu/outliers.h). ---

// The k-th smallest (0-based) of the values v(0..m): nth_element's
// element k, by counting ranks (equal values are interchangeable; a zero's
// sign never reaches a score, which takes |x - median|).
template <class ValueFn>
KVQ_HD float KthSmallest(const ValueFn& v, int m, int k) {
  for (int i = 0; i < m; ++i) {
    const float x = v(i);
    int less = 0, equal = 0;
    for (int j = 0; j < m; ++j) {
      const float y = v(j);
      less += y < x ? 1 : 0;
      equal += y == x ? 1 : 0;
    }
    if (less <= k && k < less + equal) return x;
  }
  return v(0);  // Only with NaN inputs, which the stream rejects.
}

// A group's median and the divisor of its scores, MAD + eps.
struct RobustCenter {
  float median = 0.0f;
  float denom = 1.0f;
};
// Every element of the group counts (outliers are chosen from these).
template <class G>
KVQ_HD RobustCenter RobustCenterOf(const G& g) {
  const int mid = g.count / 2;
  RobustCenter c;
  c.median = KthSmallest([&](int i) { return g.at(i); }, g.count, mid);
  const float median = c.median;
  const float mad = KthSmallest([&](int i) { return Abs(Sub(g.at(i), median)); }, g.count, mid);
  const float eps = Mul(1e-6f, Add(Abs(median), 1.0f));
  c.denom = Add(mad, eps);
  return c;
}
KVQ_HD float OutlierScore(float x, RobustCenter c) { return Div(Abs(Sub(x, c.median)), c.denom); }

// The selection order: highest score first, ties to the lower index.
KVQ_HD bool OutlierBefore(float score_a, int a, float score_b, int b) {
  return score_a != score_b ? score_a > score_b : a < b;
}

// The first element of score(0..n) after (prev_score, prev) in that order
// (prev < 0: the very first); -1 when none is left.
template <class ScoreFn>
KVQ_HD int NextOutlier(const ScoreFn& score, int n, float prev_score, int prev) {
  int best = -1;
  float best_score = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float s = score(i);
    if (prev >= 0 && !OutlierBefore(prev_score, prev, s, i)) continue;
    if (best < 0 || OutlierBefore(s, i, best_score, best)) {
      best = i;
      best_score = s;
    }
  }
  return best;
}

// The lowest index of [0, n) that `chosen` does not hold; 0 when every one
// is (a block holds more elements than outliers, PageLayout::Make).
template <class Mask>
KVQ_HD int FirstUnchosen(const Mask& chosen, int n) {
  for (int i = 0; i < n; ++i) {
    if (!chosen(i)) return i;
  }
  return 0;
}

// NextOutlier, or when it finds none -- every element left has a NaN score,
// which the order compares with nothing -- the lowest index not chosen yet,
// so an outlier table never holds an index outside the block. For finite
// scores (the reference's domain) it is NextOutlier exactly.
template <class ScoreFn, class Mask>
KVQ_HD int NextOutlierOrUnchosen(const ScoreFn& score, int n, float prev_score, int prev,
                                 const Mask& chosen) {
  const int i = NextOutlier(score, n, prev_score, prev);
  return i >= 0 ? i : FirstUnchosen(chosen, n);
}

}  // namespace kvq::hd

#endif  // KVQ_KERNELS_HD_QUANT_HD_H_
