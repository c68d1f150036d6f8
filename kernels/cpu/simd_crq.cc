// SIMD loops of the cpu backend's crq kernel (simd_crq.h).
//
// A coded coordinate's level is a look-up of its code in a table of at most
// 16 floats, one table per half of the row (hd/crq_hd.h: the halves have
// their own widths). Eight codes widen to int32 lanes and index a lane
// permute of the table (vpermps on AVX2): 2 and 3 bits fit one 8-float
// register; 4 bits look up both halves of the table with the low three bits
// and pick by the fourth. Targets with fewer than 8 float lanes (the
// portable baseline) look up one code at a time.
//
// Every loop uses 256-bit tags, also on AVX3 (simd_targets.h).

#include "kernels/cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/simd_crq.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/cpu/simd_crq.h"
#include "kernels/hd/crq_hd.h"
#include "kernels/page_layout.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace cpu {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::CappedTag<float, 8>;
using DD = hn::CappedTag<double, 4>;

// The level of a vector of codes (int32 lanes): a lane permute of the
// table's first 8 floats, at 4 bits also of its last 8 and a select.
template <class V, class VI>
HWY_INLINE V Level(DF df, V t0, V t1, int bits, VI idx) {
  const hn::RebindToSigned<DF> di;
  if (bits <= 3) return hn::TableLookupLanes(t0, hn::IndicesFromVec(df, idx));
  const auto seven = hn::Set(di, 7);
  const auto low = hn::IndicesFromVec(df, hn::And(idx, seven));
  return hn::IfThenElse(hn::RebindMask(df, idx > seven), hn::TableLookupLanes(t1, low),
                        hn::TableLookupLanes(t0, low));
}

// Codes of channels [c0, c0 + 8) of one bit plane (page_layout.h: b bits,
// p bytes per row, channel c in byte c mod p at shift (c / p) b) when p is
// a multiple of 8: 8 consecutive bytes, one shift.
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> PlaneCodes(const uint8_t* plane, int p, int b, int c0) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint8_t, DF> du8;
  const auto bytes = hn::PromoteTo(di, hn::LoadU(du8, plane + c0 % p));
  return hn::And(hn::ShiftRightSame(bytes, (c0 / p) * b), hn::Set(di, (1 << b) - 1));
}

// Channels [c0, c0 + 8) (c0 a multiple of 8) of the 1-bit plane of 32
// codes (3 bits at head_dim 64: 4 bytes, channel c in byte c mod 4 at bit
// c / 4), by a per-lane shift of the plane read as one little-endian word:
// lane l's bit is 8 (l mod 4) + l / 4 + c0 / 4. The lane part is a constant
// loaded from memory (an Iota built on the stack stalls on store
// forwarding in every call).
HWY_INLINE hn::Vec<hn::RebindToSigned<DF>> Plane32Bits(const uint8_t* plane, int c0) {
  const hn::RebindToSigned<DF> di;
  alignas(32) static constexpr int32_t kLaneBit[8] = {0, 8, 16, 24, 1, 9, 17, 25};
  const uint32_t word = static_cast<uint32_t>(plane[0]) | static_cast<uint32_t>(plane[1]) << 8 |
                        static_cast<uint32_t>(plane[2]) << 16 | static_cast<uint32_t>(plane[3]) << 24;
  const auto shift = hn::Add(hn::Load(di, kLaneBit), hn::Set(di, c0 / 4));
  // The arithmetic shift's sign fill never reaches bit 0 except at shift 31,
  // where it is bit 31 itself.
  return hn::And(hn::Set(di, static_cast<int32_t>(word)) >> shift, hn::Set(di, 1));
}

// out[c] = gain * table[code_c] for the n codes (a multiple of 8) of one
// packed half row at `bits`. Codes come straight from the bit planes when
// every plane's bytes per row are a multiple of 8 (3 bits: a 2-bit plane of
// the low bits, a 1-bit plane of the high bit; or that plane is 32 codes),
// else through `codes`.
void DecodeHalf(const uint8_t* HWY_RESTRICT half, int n, int bits,
                const float* HWY_RESTRICT table, float gain, uint8_t* HWY_RESTRICT codes,
                float* HWY_RESTRICT out) {
  const DF df;
  if (hn::Lanes(df) < 8) {
    UnpackCodes(half, n, bits, codes);
    for (int c = 0; c < n; ++c) out[c] = gain * table[codes[c]];
    return;
  }
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint8_t, DF> du8;
  const auto g = hn::Set(df, gain);
  const auto t0 = hn::LoadU(df, table);
  const auto t1 = hn::LoadU(df, table + 8);
  const bool planes_fit = bits == 3 ? n % 64 == 0 || n == 32 : (n * bits / 8) % 8 == 0;
  if (!planes_fit) {
    UnpackCodes(half, n, bits, codes);
    for (int c = 0; c < n; c += 8) {
      const auto idx = hn::PromoteTo(di, hn::LoadU(du8, codes + c));
      hn::StoreU(hn::Mul(Level(df, t0, t1, bits, idx), g), df, out + c);
    }
    return;
  }
  if (bits == 3) {
    const uint8_t* high = half + n / 4;
    for (int c = 0; c < n; c += 8) {
      const auto top = n == 32 ? Plane32Bits(high, c) : PlaneCodes(high, n / 8, 1, c);
      const auto idx = hn::Or(PlaneCodes(half, n / 4, 2, c), hn::ShiftLeft<2>(top));
      hn::StoreU(hn::Mul(Level(df, t0, t1, bits, idx), g), df, out + c);
    }
    return;
  }
  const int p = n * bits / 8;
  for (int c = 0; c < n; c += 8) {
    hn::StoreU(hn::Mul(Level(df, t0, t1, bits, PlaneCodes(half, p, bits, c)), g), df, out + c);
  }
}

}  // namespace

void CrqDecodeRowImpl(const uint8_t* row, int d, int half_bits, const CrqRowLevels& levels,
                      float gain, uint8_t* codes, float* out) {
  const int h = d / 2;
  const int hi = hd::CrqHiBits(half_bits);
  const int lo = hd::CrqLoBits(half_bits);
  DecodeHalf(row, h, hi, levels.hi, gain, codes, out);
  DecodeHalf(row + h * hi / 8, h, lo, levels.lo, gain, codes + h, out + h);
}

void CrqDotsImpl(const float* HWY_RESTRICT x, const float* HWY_RESTRICT rows, size_t stride,
                 int nr, int d, float* HWY_RESTRICT out) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  for (int k = 0; k < nr; ++k) {
    const float* r = rows + k * stride;
    auto acc = hn::Zero(df);
    for (int c = 0; c < d; c += N) acc = hn::MulAdd(hn::LoadU(df, r + c), hn::LoadU(df, x + c), acc);
    out[k] = hn::GetLane(hn::SumOfLanes(df, acc));
  }
}

void CrqAxpysImpl(const float* HWY_RESTRICT w, int nr, const float* HWY_RESTRICT x, int d,
                  float* HWY_RESTRICT acc, size_t stride) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  for (int k = 0; k < nr; ++k) {
    if (w[k] == 0.0f) continue;
    const auto wk = hn::Set(df, w[k]);
    float* ak = acc + k * stride;
    for (int c = 0; c < d; c += N) {
      hn::StoreU(hn::MulAdd(wk, hn::LoadU(df, x + c), hn::LoadU(df, ak + c)), df, ak + c);
    }
  }
}

// Rows [k0, k0 + R) of CrqTileScores at lanes [l, l + N): every load of
// the tile feeds R multiply-adds (the loop is bound by loads, not by them).
template <int R>
HWY_INLINE void TileScoreRows(const float* HWY_RESTRICT levels, hn::Vec<DF> gain,
                              const float* HWY_RESTRICT cs, const float* HWY_RESTRICT sn,
                              int pairs, int d, const float* HWY_RESTRICT qr, size_t q_stride,
                              const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                              size_t m_stride, const float* HWY_RESTRICT fixed, int k0, int l,
                              float* HWY_RESTRICT out, size_t out_stride) {
  const DF df;
  hn::Vec<DF> dot[R], mean[R];
  for (int r = 0; r < R; ++r) {
    dot[r] = hn::Zero(df);
    mean[r] = hn::Set(df, fixed[k0 + r]);
  }
  for (int c = 0; c < d; ++c) {
    const auto x = hn::LoadU(df, levels + c * kCrqTile + l);
    for (int r = 0; r < R; ++r) {
      dot[r] = hn::MulAdd(hn::Set(df, qr[(k0 + r) * q_stride + c]), x, dot[r]);
    }
  }
  for (int j = 0; j < pairs; ++j) {
    const auto c = hn::LoadU(df, cs + j * kCrqTile + l);
    const auto s = hn::LoadU(df, sn + j * kCrqTile + l);
    for (int r = 0; r < R; ++r) {
      mean[r] = hn::MulAdd(hn::Set(df, a[(k0 + r) * m_stride + j]), c, mean[r]);
      mean[r] = hn::MulAdd(hn::Set(df, b[(k0 + r) * m_stride + j]), s, mean[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    hn::StoreU(hn::MulAdd(gain, dot[r], mean[r]), df, out + (k0 + r) * out_stride + l);
  }
}

void CrqTileScoresImpl(const float* HWY_RESTRICT levels, const float* HWY_RESTRICT gain,
                       const float* HWY_RESTRICT cs, const float* HWY_RESTRICT sn, int pairs,
                       int d, const float* HWY_RESTRICT qr, size_t q_stride,
                       const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                       size_t m_stride, const float* HWY_RESTRICT fixed, int nr,
                       float* HWY_RESTRICT out, size_t out_stride) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  for (int l = 0; l < kCrqTile; l += N) {
    const auto g = hn::LoadU(df, gain + l);
    int k = 0;
    for (; k + 4 <= nr; k += 4) {
      TileScoreRows<4>(levels, g, cs, sn, pairs, d, qr, q_stride, a, b, m_stride, fixed, k, l,
                       out, out_stride);
    }
    // The last one to three rows (a decode step's GQA group) together.
    switch (nr - k) {
      case 3:
        TileScoreRows<3>(levels, g, cs, sn, pairs, d, qr, q_stride, a, b, m_stride, fixed, k, l,
                         out, out_stride);
        break;
      case 2:
        TileScoreRows<2>(levels, g, cs, sn, pairs, d, qr, q_stride, a, b, m_stride, fixed, k, l,
                         out, out_stride);
        break;
      case 1:
        TileScoreRows<1>(levels, g, cs, sn, pairs, d, qr, q_stride, a, b, m_stride, fixed, k, l,
                         out, out_stride);
        break;
      default:
        break;
    }
  }
}

void CrqTileFoldMeanImpl(const float* HWY_RESTRICT levels, const float* HWY_RESTRICT gain,
                         const float* HWY_RESTRICT cs, const float* HWY_RESTRICT sn,
                         const int* HWY_RESTRICT first, const int* HWY_RESTRICT second,
                         int pairs, const float* HWY_RESTRICT mu,
                         const float* HWY_RESTRICT signs_norm, int d, float* HWY_RESTRICT z) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  for (int l = 0; l < kCrqTile; l += N) {
    auto at = [&](int c) { return z + c * kCrqTile + l; };
    // R_p mu: channels that do not rotate keep mu.
    for (int c = 0; c < d; ++c) hn::StoreU(hn::Set(df, mu[c]), df, at(c));
    for (int j = 0; j < pairs; ++j) {
      const auto c = hn::LoadU(df, cs + j * kCrqTile + l);
      const auto s = hn::LoadU(df, sn + j * kCrqTile + l);
      const auto mf = hn::Set(df, mu[first[j]]);
      const auto ms = hn::Set(df, mu[second[j]]);
      hn::StoreU(hn::NegMulAdd(ms, s, hn::Mul(mf, c)), df, at(first[j]));
      hn::StoreU(hn::MulAdd(ms, c, hn::Mul(mf, s)), df, at(second[j]));
    }
    for (int c = 0; c < d; ++c) {
      hn::StoreU(hn::Mul(hn::LoadU(df, at(c)), hn::Set(df, signs_norm[c])), df, at(c));
    }
    // Walsh-Hadamard over the coordinates: every butterfly is one add and
    // one subtract of whole vectors of keys.
    for (int len = 1; len < d; len <<= 1) {
      for (int i = 0; i < d; i += len << 1) {
        for (int c = i; c < i + len; ++c) {
          const auto a = hn::LoadU(df, at(c));
          const auto b = hn::LoadU(df, at(c + len));
          hn::StoreU(hn::Add(a, b), df, at(c));
          hn::StoreU(hn::Sub(a, b), df, at(c + len));
        }
      }
    }
    const auto g = hn::LoadU(df, gain + l);
    for (int c = 0; c < d; ++c) {
      hn::StoreU(hn::MulAdd(g, hn::LoadU(df, levels + c * kCrqTile + l), hn::LoadU(df, at(c))), df,
                 at(c));
    }
  }
}

void CrqTileAxpysImpl(const float* HWY_RESTRICT w, size_t w_stride, int nr,
                      const float* HWY_RESTRICT x, int m, int d, float* HWY_RESTRICT acc,
                      size_t stride) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  // A row's weights broadcast once, kept in registers across its
  // coordinates (unused keys weigh zero).
  hn::Vec<DF> wv[kCrqTile];
  for (int k = 0; k < nr; ++k) {
    const float* wk = w + k * w_stride;
    for (int i = 0; i < kCrqTile; ++i) wv[i] = hn::Set(df, i < m ? wk[i] : 0.0f);
    float* ak = acc + k * stride;
    for (int c = 0; c < d; c += N) {
      auto v = hn::LoadU(df, ak + c);
      for (int i = 0; i < m; ++i) v = hn::MulAdd(wv[i], hn::LoadU(df, x + i * d + c), v);
      hn::StoreU(v, df, ak + c);
    }
  }
}

float CrqMaxImpl(const float* HWY_RESTRICT x, int n) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  auto m = hn::Set(df, -std::numeric_limits<float>::infinity());
  int i = 0;
  for (; i + N <= n; i += N) m = hn::Max(m, hn::LoadU(df, x + i));
  float r = hn::GetLane(hn::MaxOfLanes(df, m));
  for (; i < n; ++i) r = std::max(r, x[i]);
  return r;
}

float CrqSumImpl(const float* HWY_RESTRICT x, int n) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  auto s0 = hn::Zero(df), s1 = hn::Zero(df);
  int i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    s0 = hn::Add(s0, hn::LoadU(df, x + i));
    s1 = hn::Add(s1, hn::LoadU(df, x + i + N));
  }
  if (i + N <= n) {
    s0 = hn::Add(s0, hn::LoadU(df, x + i));
    i += N;
  }
  float r = hn::GetLane(hn::SumOfLanes(df, hn::Add(s0, s1)));
  for (; i < n; ++i) r += x[i];
  return r;
}

void CrqExpShiftedImpl(float* HWY_RESTRICT x, int n, float shift) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const auto m = hn::Set(df, shift);
  int i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Exp(df, hn::Sub(hn::LoadU(df, x + i), m)), df, x + i);
  for (; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

void CrqTurnPairsImpl(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, int nr, int n,
                      const float* HWY_RESTRICT c0, const float* HWY_RESTRICT s0,
                      float* HWY_RESTRICT ta, float* HWY_RESTRICT tb) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  for (int j = 0; j < n; j += N) {
    const auto c = hn::LoadU(df, c0 + j);
    const auto s = hn::LoadU(df, s0 + j);
    for (int k = 0; k < nr; ++k) {
      const size_t at = static_cast<size_t>(k) * n + j;
      const auto x = hn::LoadU(df, a + at);
      const auto y = hn::LoadU(df, b + at);
      hn::StoreU(hn::MulAdd(x, c, hn::Mul(y, s)), df, ta + at);
      hn::StoreU(hn::MulSub(y, c, hn::Mul(x, s)), df, tb + at);
    }
  }
}

// out[c * 8 + i] = rows[i * stride + c] for i < 8, c < d (a multiple of 8):
// 8 x 8 blocks turned by two rounds of interleaves within 128-bit halves
// (32-bit, then 64-bit lanes) and one exchange of halves.
void CrqTransposeTileImpl(const float* HWY_RESTRICT rows, size_t stride, int d,
                          float* HWY_RESTRICT out) {
  static_assert(kCrqTile == 8, "a tile is one 8 x 8 block per 8 channels");
  const DF df;
  if (HWY_TARGET == HWY_SCALAR || hn::Lanes(df) < 8) {
    for (int c = 0; c < d; ++c) {
      for (int i = 0; i < 8; ++i) out[c * 8 + i] = rows[i * stride + c];
    }
    return;
  }
#if HWY_TARGET != HWY_SCALAR  // No interleaves or halves of one lane.
  const hn::Repartition<double, DF> dd;
  const auto lo64 = [&](auto a, auto b) {
    return hn::BitCast(df, hn::InterleaveLower(dd, hn::BitCast(dd, a), hn::BitCast(dd, b)));
  };
  const auto hi64 = [&](auto a, auto b) {
    return hn::BitCast(df, hn::InterleaveUpper(dd, hn::BitCast(dd, a), hn::BitCast(dd, b)));
  };
  for (int c = 0; c < d; c += 8) {
    hn::Vec<DF> r[8];
    for (int i = 0; i < 8; ++i) r[i] = hn::LoadU(df, rows + i * stride + c);
    // t[2j], t[2j + 1]: rows 2j and 2j + 1 interleaved, channels {0, 1, 4, 5}
    // and {2, 3, 6, 7}.
    hn::Vec<DF> t[8];
    for (int j = 0; j < 4; ++j) {
      t[2 * j] = hn::InterleaveLower(df, r[2 * j], r[2 * j + 1]);
      t[2 * j + 1] = hn::InterleaveUpper(df, r[2 * j], r[2 * j + 1]);
    }
    // u[4h + k]: channel k (low half) and k + 4 (high half) of rows 4h..4h+3.
    hn::Vec<DF> u[8];
    for (int h = 0; h < 2; ++h) {
      u[4 * h + 0] = lo64(t[4 * h], t[4 * h + 2]);
      u[4 * h + 1] = hi64(t[4 * h], t[4 * h + 2]);
      u[4 * h + 2] = lo64(t[4 * h + 1], t[4 * h + 3]);
      u[4 * h + 3] = hi64(t[4 * h + 1], t[4 * h + 3]);
    }
    float* o = out + static_cast<size_t>(c) * 8;
    for (int k = 0; k < 4; ++k) {
      hn::StoreU(hn::ConcatLowerLower(df, u[4 + k], u[k]), df, o + k * 8);
      hn::StoreU(hn::ConcatUpperUpper(df, u[4 + k], u[k]), df, o + (k + 4) * 8);
    }
  }
#endif
}

void CrqRopeWalkImpl(double* HWY_RESTRICT cs, double* HWY_RESTRICT sn,
                     const double* HWY_RESTRICT step_c, const double* HWY_RESTRICT step_s, int n,
                     float* HWY_RESTRICT csf, float* HWY_RESTRICT snf) {
  const DD dd;
  const hn::Rebind<float, DD> df;
  const int N = static_cast<int>(hn::Lanes(dd));
  int j = 0;
  for (; j + N <= n; j += N) {
    const auto c0 = hn::LoadU(dd, cs + j);
    const auto s0 = hn::LoadU(dd, sn + j);
    const auto sc = hn::LoadU(dd, step_c + j);
    const auto ss = hn::LoadU(dd, step_s + j);
    hn::StoreU(hn::DemoteTo(df, c0), df, csf + j);
    hn::StoreU(hn::DemoteTo(df, s0), df, snf + j);
    hn::StoreU(hn::Sub(hn::Mul(c0, sc), hn::Mul(s0, ss)), dd, cs + j);
    hn::StoreU(hn::Add(hn::Mul(c0, ss), hn::Mul(s0, sc)), dd, sn + j);
  }
  for (; j < n; ++j) {
    const double c0 = cs[j];
    csf[j] = static_cast<float>(c0);
    snf[j] = static_cast<float>(sn[j]);
    cs[j] = c0 * step_c[j] - sn[j] * step_s[j];
    sn[j] = c0 * step_s[j] + sn[j] * step_c[j];
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq {
namespace cpu {

HWY_EXPORT(CrqDecodeRowImpl);
HWY_EXPORT(CrqDotsImpl);
HWY_EXPORT(CrqAxpysImpl);
HWY_EXPORT(CrqTileScoresImpl);
HWY_EXPORT(CrqTileFoldMeanImpl);
HWY_EXPORT(CrqTileAxpysImpl);
HWY_EXPORT(CrqRopeWalkImpl);
HWY_EXPORT(CrqTransposeTileImpl);
HWY_EXPORT(CrqTurnPairsImpl);
HWY_EXPORT(CrqExpShiftedImpl);
HWY_EXPORT(CrqMaxImpl);
HWY_EXPORT(CrqSumImpl);

void CrqDecodeRow(const uint8_t* row, int d, int half_bits, const CrqRowLevels& levels,
                  float gain, uint8_t* codes, float* out) {
  HWY_DYNAMIC_DISPATCH(CrqDecodeRowImpl)(row, d, half_bits, levels, gain, codes, out);
}

void CrqDots(const float* x, const float* rows, size_t stride, int nr, int d, float* out) {
  HWY_DYNAMIC_DISPATCH(CrqDotsImpl)(x, rows, stride, nr, d, out);
}

void CrqAxpys(const float* w, int nr, const float* x, int d, float* acc, size_t stride) {
  HWY_DYNAMIC_DISPATCH(CrqAxpysImpl)(w, nr, x, d, acc, stride);
}

void CrqTileScores(const float* levels, const float* gain, const float* cs, const float* sn,
                   int pairs, int d, const float* qr, size_t q_stride, const float* a,
                   const float* b, size_t m_stride, const float* fixed, int nr, float* out,
                   size_t out_stride) {
  HWY_DYNAMIC_DISPATCH(CrqTileScoresImpl)(levels, gain, cs, sn, pairs, d, qr, q_stride, a, b,
                                          m_stride, fixed, nr, out, out_stride);
}

void CrqTileFoldMean(const float* levels, const float* gain, const float* cs, const float* sn,
                     const int* first, const int* second, int pairs, const float* mu,
                     const float* signs_norm, int d, float* z) {
  HWY_DYNAMIC_DISPATCH(CrqTileFoldMeanImpl)(levels, gain, cs, sn, first, second, pairs, mu,
                                            signs_norm, d, z);
}

void CrqTileAxpys(const float* w, size_t w_stride, int nr, const float* x, int m, int d,
                  float* acc, size_t stride) {
  HWY_DYNAMIC_DISPATCH(CrqTileAxpysImpl)(w, w_stride, nr, x, m, d, acc, stride);
}

void CrqExpShifted(float* x, int n, float shift) {
  HWY_DYNAMIC_DISPATCH(CrqExpShiftedImpl)(x, n, shift);
}

float CrqMax(const float* x, int n) { return HWY_DYNAMIC_DISPATCH(CrqMaxImpl)(x, n); }

float CrqSum(const float* x, int n) { return HWY_DYNAMIC_DISPATCH(CrqSumImpl)(x, n); }

void CrqRopeWalk(double* cs, double* sn, const double* step_c, const double* step_s, int n,
                 float* csf, float* snf) {
  HWY_DYNAMIC_DISPATCH(CrqRopeWalkImpl)(cs, sn, step_c, step_s, n, csf, snf);
}

void CrqTurnPairs(const float* a, const float* b, int nr, int n, const float* c0,
                  const float* s0, float* ta, float* tb) {
  HWY_DYNAMIC_DISPATCH(CrqTurnPairsImpl)(a, b, nr, n, c0, s0, ta, tb);
}

void CrqTransposeTile(const float* rows, size_t stride, int d, float* out) {
  HWY_DYNAMIC_DISPATCH(CrqTransposeTileImpl)(rows, stride, d, out);
}

}  // namespace cpu
}  // namespace kvq
#endif
