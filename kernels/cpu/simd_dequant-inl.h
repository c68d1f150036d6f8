// Per-target SIMD dequantization of page rows (Highway "-inl" header: it is
// included once per target by the files that foreach_target over it).
//
// Everything here reproduces DequantizeRowsRef bit for bit: the same fp16 /
// bf16 / fp8 conversions (exact), and for affine codes `zero + scale * level`
// as a multiply then an add (never a fused multiply-add; the files compile
// with -ffp-contract=off), so the fetch path and the generic attention tiles
// see exactly the values the reference sees.
//
// Layout assumptions (kernels/page_layout.h): code rows are token-major; a
// b-bit plane of P = head_dim*b/8 bytes holds channel j + P*m of byte j at
// bit m*b, so unpacking is a shift and a mask per m over runs of P bytes,
// with channels in natural order.

// Per-target include guard (the Highway idiom).
#if defined(KVQ_KERNELS_CPU_SIMD_DEQUANT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVQ_KERNELS_CPU_SIMD_DEQUANT_INL_H_
#undef KVQ_KERNELS_CPU_SIMD_DEQUANT_INL_H_
#else
#define KVQ_KERNELS_CPU_SIMD_DEQUANT_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "hwy/highway.h"
#include "kernels/cpu/crq_cpu.h"
#include "kernels/group_params.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"
#include "kernels/page_layout.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::CappedTag<float, 8>;  // 256-bit on AVX3 too (simd_targets.h).

// ---------------------------------------------------------------------------
// Row conversions. `n` is a multiple of 16 (head_dim is).

HWY_INLINE void HalfRowToFloat(const uint16_t* HWY_RESTRICT src, int n,
                               float* HWY_RESTRICT dst) {
  int c = 0;
#if HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128
  // (Highway's portable conversion reads the Inf / NaN exponent as a normal
  // one, 0x7c00 -> 65536: the portable targets convert element by element.)
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const int N = static_cast<int>(hn::Lanes(df));
  for (; c + N <= n; c += N) {
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(src + c))),
               df, dst + c);
  }
#endif
  for (; c < n; ++c) dst[c] = HalfToFloat(Load16(src, c));  // src may be misaligned.
}

// Group parameters of `entries` entries from `entry` as floats, per entry
// scale[n] then zero[n]: fp16 ones converted here, p8 ones decoded by the
// shared scalar code (a few bytes per block; exact either way).
HWY_INLINE void LoadParams(const PageLayout& L, const SideLayout& S, const uint8_t* page,
                           int entry, int entries, float* HWY_RESTRICT out) {
  const int n = L.ParamsPerEntry(S);
  if (S.param_bits == 16) {
    HalfRowToFloat(L.Params(page, S, entry), 2 * n * entries, out);
    return;
  }
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  if (n % N != 0) {
    LoadGroupParams(L, S, page, entry, entries, out);
    return;
  }
  // Whole vectors of codes (per-channel keys: n = head_dim): widen in lanes.
  const hn::Rebind<uint8_t, DF> d8;
  const hn::Rebind<int32_t, DF> di;
  const int per_block = L.EntriesPerBlock(S);
  for (int e = 0; e < entries; ++e) {
    const uint8_t* block = L.ParamBlock(page, S, (entry + e) / per_block);
    const Params8Steps h = ReadParams8Steps(block);
    const auto ss = hn::Set(df, h.scale_step);
    const auto zb = hn::Set(df, h.zero_base);
    const auto zs = hn::Set(df, h.zero_step);
    const uint8_t* sc = block + kParams8HeaderBytes + ((entry + e) % per_block) * n;
    const uint8_t* zc = sc + static_cast<size_t>(per_block) * n;
    float* o = out + static_cast<size_t>(e) * 2 * n;
    for (int c = 0; c < n; c += N) {
      const auto sv = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, sc + c)));
      const auto zv = hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, zc + c)));
      hn::StoreU(hn::Mul(sv, ss), df, o + c);
      hn::StoreU(hn::Add(zb, hn::Mul(zv, zs)), df, o + n + c);
    }
  }
}

// Writes the sparse outliers of page rows [row0, row0 + n) over their
// dequantized values in out (row r at out + r * stride): floats, or fp16
// bits (an outlier is an fp16 value, so both are exact).
template <typename OutT>
HWY_INLINE void WriteOutliers(const PageLayout& L, const SideLayout& S, const uint8_t* page,
                              int row0, int n, OutT* HWY_RESTRICT out, size_t stride) {
  const int k = L.outliers_per_block;
  if (k == 0 || n == 0) return;
  const int g = L.block_tokens;
  const int d = L.head_dim;
  for (int b = row0 / g; b <= (row0 + n - 1) / g; ++b) {
    const uint16_t* table = L.Outliers(page, S, b);
    for (int e = 0; e < k; ++e) {
      const int row = b * g + table[e] / d;
      if (row < row0 || row >= row0 + n) continue;
      const size_t at = static_cast<size_t>(row - row0) * stride + table[e] % d;
      if constexpr (std::is_same_v<OutT, float>) {
        out[at] = HalfToFloat(table[k + e]);
      } else {
        Store16(out, at, table[k + e]);  // fp16 rows may sit misaligned in a message.
      }
    }
  }
}

HWY_INLINE void Bf16RowToFloat(const uint16_t* HWY_RESTRICT src, int n,
                               float* HWY_RESTRICT dst) {
  const DF df;
  const hn::Rebind<hwy::bfloat16_t, DF> db;
  const int N = static_cast<int>(hn::Lanes(df));
  int c = 0;
  for (; c + N <= n; c += N) {
    hn::StoreU(hn::PromoteTo(df, hn::LoadU(db, reinterpret_cast<const hwy::bfloat16_t*>(src + c))),
               df, dst + c);
  }
  for (; c < n; ++c) dst[c] = Bf16ToFloat(src[c]);
}

// fp8 e4m3 -> float, exactly: with its sign moved to bit 15 and exponent and
// mantissa to bits 7..13, an e4m3 byte is the fp16 number 2^-8 times its value
// (normal and subnormal alike: both formats have the same mantissa alignment
// and fp16's bias is 8 larger). So x = half(bits) * (256 * scale), one
// rounding, as in the reference (Fp8E4m3ToFloat(b) * scale). The NaN code
// 0x7f never occurs: the quantizer saturates at 448.
HWY_INLINE void Fp8RowToFloat(const uint8_t* HWY_RESTRICT src, int n, float scale,
                              float* HWY_RESTRICT dst) {
  const DF df;
  const hn::Rebind<int8_t, DF> d8;
  const hn::Rebind<int16_t, DF> d16;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const int N = static_cast<int>(hn::Lanes(df));
  const auto mul = hn::Set(df, scale * 256.0f);
  const auto mask = hn::Set(d16, static_cast<int16_t>(0xBF80));
  int c = 0;
  for (; c + N <= n; c += N) {
    const auto b = hn::PromoteTo(d16, hn::LoadU(d8, reinterpret_cast<const int8_t*>(src + c)));
    const auto h = hn::And(hn::ShiftLeft<7>(b), mask);
    hn::StoreU(hn::Mul(hn::PromoteTo(df, hn::BitCast(dh, h)), mul), df, dst + c);
  }
  for (; c < n; ++c) dst[c] = Fp8E4m3ToFloat(src[c]) * scale;
}

// ---------------------------------------------------------------------------
// Bit-plane unpacking of one row into n byte codes (natural channel order).

template <class D8>
HWY_INLINE void UnpackPlaneVec(D8 d8, const uint8_t* HWY_RESTRICT plane, int bytes, int b,
                               int shift, bool first, uint8_t* HWY_RESTRICT codes) {
  const int per_byte = 8 / b;
  const auto mask = hn::Set(d8, static_cast<uint8_t>((1 << b) - 1));
  const int N = static_cast<int>(hn::Lanes(d8));
  for (int j = 0; j < bytes; j += N) {
    const auto x = hn::LoadU(d8, plane + j);
    for (int m = 0; m < per_byte; ++m) {
      auto v = hn::And(hn::ShiftRightSame(x, m * b), mask);
      if (shift) v = hn::ShiftLeftSame(v, shift);
      uint8_t* dst = codes + j + bytes * m;
      if (!first) v = hn::Or(v, hn::LoadU(d8, dst));
      hn::StoreU(v, d8, dst);
    }
  }
}

HWY_INLINE void UnpackPlaneScalar(const uint8_t* HWY_RESTRICT plane, int bytes, int b, int shift,
                                  bool first, uint8_t* HWY_RESTRICT codes) {
  const int per_byte = 8 / b;
  const uint8_t mask = static_cast<uint8_t>((1 << b) - 1);
  for (int j = 0; j < bytes; ++j) {
    for (int m = 0; m < per_byte; ++m) {
      const uint8_t v = static_cast<uint8_t>(((plane[j] >> (m * b)) & mask) << shift);
      uint8_t& dst = codes[j + bytes * m];
      dst = first ? v : static_cast<uint8_t>(dst | v);
    }
  }
}

HWY_INLINE void UnpackPlane(const uint8_t* HWY_RESTRICT plane, int bytes, int b, int shift,
                            bool first, uint8_t* HWY_RESTRICT codes) {
  const hn::CappedTag<uint8_t, 32> d8;
  const hn::CappedTag<uint8_t, 16> d16;
  const hn::CappedTag<uint8_t, 8> d8x8;
  if (bytes % static_cast<int>(hn::Lanes(d8)) == 0) {
    UnpackPlaneVec(d8, plane, bytes, b, shift, first, codes);
  } else if (bytes % static_cast<int>(hn::Lanes(d16)) == 0) {
    UnpackPlaneVec(d16, plane, bytes, b, shift, first, codes);
  } else if (bytes % static_cast<int>(hn::Lanes(d8x8)) == 0) {
    UnpackPlaneVec(d8x8, plane, bytes, b, shift, first, codes);
  } else {
    UnpackPlaneScalar(plane, bytes, b, shift, first, codes);
  }
}

// Same result as kvq::UnpackCodes.
HWY_INLINE void UnpackRow(const uint8_t* HWY_RESTRICT row, int n, int bits,
                          uint8_t* HWY_RESTRICT codes) {
  switch (bits) {
    case 8:
      std::memcpy(codes, row, n);
      return;
    case 4:
    case 2:
      UnpackPlane(row, n * bits / 8, bits, 0, true, codes);
      return;
    case 3:
      UnpackPlane(row, n / 4, 2, 0, true, codes);
      UnpackPlane(row + n / 4, n / 8, 1, 2, false, codes);
      return;
  }
}

// ---------------------------------------------------------------------------
// Affine dequantization.

// Per-call context of one side: float copies of what the page does not hold.
struct SideContext {
  const KvStream* stream = nullptr;
  Side side = Side::kKey;
  int levels = 0;                 // 2^bits with nuq, else 0.
  std::vector<float> level_table;  // [head_dim][levels] (nuq).
  std::vector<float> level_rows;   // [levels][head_dim]: level k of every channel.
  std::vector<uint8_t> codes;      // One unpacked row.
  std::vector<float> params;       // scale[D], zero[D] of one block (or one row).
  std::vector<int32_t> index;      // [D]: c * levels, for gathers.

  void Init(const KvStream& s, Side sd) {
    stream = &s;
    side = sd;
    const int d = s.head_dim();
    codes.resize(d);
    params.resize(2 * static_cast<size_t>(d));
    levels = s.spec().nuq ? (1 << s.spec().bits) : 0;
    if (levels > 0) {
      level_table.resize(static_cast<size_t>(d) * levels);
      level_rows.resize(level_table.size());
      index.resize(d);
      for (int c = 0; c < d; ++c) {
        const uint16_t* h = s.levels(sd, c);
        for (int i = 0; i < levels; ++i) {
          level_table[static_cast<size_t>(c) * levels + i] = HalfToFloat(h[i]);
          level_rows[static_cast<size_t>(i) * d + c] = HalfToFloat(h[i]);
        }
        index[c] = c * levels;
      }
    }
  }
};

// out[c] = float(codes[c]) for c < n (n multiple of the lane count).
HWY_INLINE hn::Vec<DF> CodesToFloat(const uint8_t* HWY_RESTRICT codes) {
  const DF df;
  const hn::Rebind<int32_t, DF> di;
  const hn::Rebind<uint8_t, DF> d8;
  return hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, codes)));
}

// nuq: x[c] = zero + scale * level_c[codes[c]] for c in [c0, c1), with
// per-channel (zero, scale arrays) or per-group (scalars) parameters. Up to 8
// levels a tree of blends on the code bits picks among the per-level rows
// (exact, and much cheaper than a gather); 16 levels gather.
template <int LV>
HWY_INLINE void NuqRange(const SideContext& ctx, const uint8_t* HWY_RESTRICT codes, int c0, int c1,
                         const float* HWY_RESTRICT scale, const float* HWY_RESTRICT zero, float s,
                         float z, float* HWY_RESTRICT x) {
  const DF df;
  const hn::Rebind<int32_t, DF> di;
  const hn::Rebind<uint8_t, DF> d8;
  const int N = static_cast<int>(hn::Lanes(df));
  const size_t d = ctx.index.size();
  const float* HWY_RESTRICT rows = ctx.level_rows.data();
  const float* HWY_RESTRICT table = ctx.level_table.data();
  const int32_t* HWY_RESTRICT index = ctx.index.data();
  const auto one = hn::Set(di, 1), two = hn::Set(di, 2), four = hn::Set(di, 4);
  const auto vs = hn::Set(df, s), vz = hn::Set(df, z);
  int c = c0;
  for (; c + N <= c1; c += N) {
    const auto code = hn::PromoteTo(di, hn::LoadU(d8, codes + c));
    hn::Vec<DF> level;
    if constexpr (LV <= 8) {
      const auto b0 = hn::RebindMask(df, hn::TestBit(code, one));
      const auto b1 = hn::RebindMask(df, hn::TestBit(code, two));
      auto pick4 = [&](const float* r) {
        const auto lo = hn::IfThenElse(b0, hn::LoadU(df, r + d), hn::LoadU(df, r));
        const auto hi = hn::IfThenElse(b0, hn::LoadU(df, r + 3 * d), hn::LoadU(df, r + 2 * d));
        return hn::IfThenElse(b1, hi, lo);
      };
      if constexpr (LV == 4) {
        level = pick4(rows + c);
      } else {
        const auto b2 = hn::RebindMask(df, hn::TestBit(code, four));
        level = hn::IfThenElse(b2, pick4(rows + 4 * d + c), pick4(rows + c));
      }
    } else {
      level = hn::GatherIndex(df, table, hn::Add(hn::LoadU(di, index + c), code));
    }
    if (scale != nullptr) {
      hn::StoreU(hn::Add(hn::LoadU(df, zero + c), hn::Mul(hn::LoadU(df, scale + c), level)), df, x + c);
    } else {
      hn::StoreU(hn::Add(vz, hn::Mul(vs, level)), df, x + c);
    }
  }
  for (; c < c1; ++c) {
    const float level = table[static_cast<size_t>(c) * LV + codes[c]];
    x[c] = scale != nullptr ? zero[c] + scale[c] * level : z + s * level;
  }
}

HWY_INLINE void NuqRangeAny(const SideContext& ctx, const uint8_t* HWY_RESTRICT codes, int c0, int c1,
                            const float* scale, const float* zero, float s, float z, float* x) {
  switch (ctx.levels) {
    case 4: return NuqRange<4>(ctx, codes, c0, c1, scale, zero, s, z, x);
    case 8: return NuqRange<8>(ctx, codes, c0, c1, scale, zero, s, z, x);
    default: return NuqRange<16>(ctx, codes, c0, c1, scale, zero, s, z, x);
  }
}

// Dequantizes rows [row0, row0 + n) of an int8 / packed side.
#if KVQ_X86_AVX3
// Uniform 2-, 3- and 4-bit rows straight from the bit planes, 16 channels
// per vector (AVX-512): a 16-byte run of the plane zero-extended to 32-bit
// lanes, shifted by b m and masked, is channels [j0 + P m, j0 + P m + 16)
// (3 bits: the 2-bit plane's, with the high bit added by ThreeBitHigh16).
// The same separate multiply and add per element as DequantAffineRows, so
// the result is bit-identical; what goes is the unpacked-codes scratch row
// and the 8-lane loop. Rows go to out + r * stride as floats, or (OutT uint16_t) as
// fp16 rounded to nearest even, which is FloatToRow's conversion of those
// floats: one pass instead of a float row written and read back.
// The bit width and the parameter axis are template arguments: the
// unrolled inner loops run without the runtime tests (measured, 15-20% of
// a client's raw-page dequantization in `kvq-bench convert`).
// The high bit of the 3-bit codes of channels [c0, c0 + 16) of a row (c0 a
// multiple of 16), as bit 2 of each lane: it lives in the 1-bit plane after
// the 2-bit plane of the low bits (d / 8 bytes; byte j holds channels
// j + (d / 8) m at bit m). At head_dim 64 that plane is 8 bytes, so lanes
// 8-15 read the same bytes one bit higher.
inline __m512i ThreeBitHigh16(const uint8_t* HWY_RESTRICT row, int d, int c0) {
  const int pb = d / 8;
  const uint8_t* plane_b = row + d / 4;
  __m512i high;
  if (pb >= 16) {
    high = _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                 reinterpret_cast<const __m128i*>(plane_b + c0 % pb))),
                             c0 / pb);
  } else {  // pb == 8: bytes 0-7 twice, lanes 8-15 one bit further.
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(plane_b));
    const __m512i shift = _mm512_add_epi32(
        _mm512_set1_epi32(c0 / pb),
        _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    high = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(bytes, bytes)), shift);
  }
  return _mm512_slli_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), 2);
}

template <typename OutT, int bits, bool per_channel>
inline void DequantUniformRowsOf(SideContext& ctx, const PageLayout& L, const SideLayout& S,
                                 const uint8_t* HWY_RESTRICT page, int row0, int n,
                                 OutT* HWY_RESTRICT out, size_t stride) {
  const int d = L.head_dim;
  // 3-bit rows: the loop walks the 2-bit plane of the low bits
  // (ThreeBitHigh16 adds the high bit from the 1-bit plane).
  constexpr int field = bits == 3 ? 2 : bits;  // Bits per code in the walked plane.
  const int plane = d * field / 8;
  constexpr int per_byte = 8 / field;
  const int g = L.block_tokens;
  const int gc = per_channel ? d : S.group_channels;
  const int ng = d / gc;
  const __m512i mask = _mm512_set1_epi32((1 << field) - 1);
  // Per-token groups: the group of each 16-channel vector, looked up rather
  // than divided: a runtime division per vector cost 4% of a dequantization
  // into an L1 tile (`kvq-bench convert`, its "reused tile" rows).
  int group_of[kMaxHeadDim / 16];
  for (int i = 0; i < d / 16; ++i) group_of[i] = 16 * i / gc;
  // Per-token groups: the n rows' scales and zeros converted in one call.
  if (!per_channel && ctx.params.size() < static_cast<size_t>(n) * 2 * ng) {
    ctx.params.resize(static_cast<size_t>(n) * 2 * ng);
  }
  if (!per_channel) LoadParams(L, S, page, row0, n, ctx.params.data());
  int cur_block = -1;
  for (int r = 0; r < n; ++r) {
    const int row = row0 + r;
    const uint8_t* codes = PageLayout::CodeRow(page, S, row);
    OutT* x = out + static_cast<size_t>(r) * stride;
    const float* params = ctx.params.data() + (per_channel ? 0 : static_cast<size_t>(r) * 2 * ng);
    if (per_channel && row / g != cur_block) {
      cur_block = row / g;
      LoadParams(L, S, page, cur_block, 1, ctx.params.data());
    }
    for (int j0 = 0; j0 < plane; j0 += 16) {
      const __m512i b =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j0)));
      for (int m = 0; m < per_byte; ++m) {
        const int c = j0 + plane * m;
        __m512i code = _mm512_and_si512(_mm512_srli_epi32(b, field * m), mask);
        if constexpr (bits == 3) code = _mm512_or_si512(code, ThreeBitHigh16(codes, d, c));
        const __m512 f = _mm512_cvtepi32_ps(code);
        __m512 v;
        if constexpr (per_channel) {
          v = _mm512_add_ps(_mm512_loadu_ps(params + d + c),
                            _mm512_mul_ps(_mm512_loadu_ps(params + c), f));
        } else {
          const int grp = group_of[c / 16];
          v = _mm512_add_ps(_mm512_set1_ps(params[ng + grp]),
                            _mm512_mul_ps(_mm512_set1_ps(params[grp]), f));
        }
        if constexpr (std::is_same_v<OutT, float>) {
          _mm512_storeu_ps(x + c, v);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + c),
                              _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
      }
    }
  }
}

template <typename OutT>
inline void DequantUniformRows512(SideContext& ctx, const PageLayout& L, const SideLayout& S,
                                  const uint8_t* HWY_RESTRICT page, int row0, int n,
                                  OutT* HWY_RESTRICT out, size_t stride) {
  const bool per_channel = S.axis == ParamAxis::kChannelGroups;
  if (S.bits == 2) {
    per_channel ? DequantUniformRowsOf<OutT, 2, true>(ctx, L, S, page, row0, n, out, stride)
                : DequantUniformRowsOf<OutT, 2, false>(ctx, L, S, page, row0, n, out, stride);
  } else if (S.bits == 3) {
    per_channel ? DequantUniformRowsOf<OutT, 3, true>(ctx, L, S, page, row0, n, out, stride)
                : DequantUniformRowsOf<OutT, 3, false>(ctx, L, S, page, row0, n, out, stride);
  } else {
    per_channel ? DequantUniformRowsOf<OutT, 4, true>(ctx, L, S, page, row0, n, out, stride)
                : DequantUniformRowsOf<OutT, 4, false>(ctx, L, S, page, row0, n, out, stride);
  }
}

// Whether DequantUniformRows512 serves this side: uniform 2-, 3- or 4-bit
// codes whose planes and groups come in whole 16-channel vectors (3 bits:
// a 2-bit plane of at least 16 bytes, head_dim 64 and up).
// The walk takes the plane 16 bytes at a time: a plane of another length
// (2 and 3 bits at head_dim 96: 24 bytes) would read past it into the next
// and write channels past head_dim; those take the general loop.
inline bool UniformRows512Applies(const SideContext& ctx, const SideLayout& S, int d) {
  const int plane_bits = S.bits == 3 ? 2 : S.bits;
  return ctx.levels == 0 && (S.bits == 2 || S.bits == 3 || S.bits == 4) && d % 16 == 0 &&
         (d * plane_bits / 8) % 16 == 0 &&
         (S.axis == ParamAxis::kChannelGroups ||
          (S.axis == ParamAxis::kTokenGroups && S.group_channels % 16 == 0));
}
#endif

inline HWY_NOINLINE void DequantAffineRows(SideContext& ctx, const uint8_t* HWY_RESTRICT page, int row0,
                                  int n, float* HWY_RESTRICT out) {
  const KvStream& s = *ctx.stream;
  const PageLayout& L = s.layout();
  const SideLayout& S = L.side(ctx.side);
  const int d = L.head_dim;
  const int bits = S.bits;
  const int g = L.block_tokens;
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  uint8_t* codes = ctx.codes.data();
  float* scale = ctx.params.data();
  float* zero = scale + d;
  const int lv = ctx.levels;
#if KVQ_X86_AVX3
  if (UniformRows512Applies(ctx, S, d)) {
    DequantUniformRows512(ctx, L, S, page, row0, n, out, static_cast<size_t>(d));
    WriteOutliers(L, S, page, row0, n, out, static_cast<size_t>(d));
    return;
  }
#endif
  int cur_block = -1;
  for (int r = 0; r < n; ++r) {
    const int row = row0 + r;
    float* x = out + static_cast<size_t>(r) * d;
    UnpackRow(PageLayout::CodeRow(page, S, row), d, bits, codes);
    if (S.axis == ParamAxis::kChannelGroups) {
      if (row / g != cur_block) {
        cur_block = row / g;
        LoadParams(L, S, page, cur_block, 1, scale);
      }
      int c = 0;
      if (lv > 0) {
        NuqRangeAny(ctx, codes, 0, d, scale, zero, 0.0f, 0.0f, x);
      } else {
        for (; c + N <= d; c += N) {
          const auto v = hn::Mul(hn::LoadU(df, scale + c), CodesToFloat(codes + c));
          hn::StoreU(hn::Add(hn::LoadU(df, zero + c), v), df, x + c);
        }
        for (; c < d; ++c) x[c] = zero[c] + scale[c] * static_cast<float>(codes[c]);
      }
    } else {
      const int gc = S.group_channels;
      const int ng = d / gc;
      // This row's scales then zeros, converted at once.
      float* pr = ctx.params.data();
      LoadParams(L, S, page, row, 1, pr);
      for (int j = 0; j < ng; ++j) {
        const float sj = pr[j];
        const float zj = pr[ng + j];
        const auto vs = hn::Set(df, sj);
        const auto vz = hn::Set(df, zj);
        int c = j * gc;
        const int ce = c + gc;
        if (lv > 0) {
          NuqRangeAny(ctx, codes, c, ce, nullptr, nullptr, sj, zj, x);
        } else {
          for (; c + N <= ce; c += N) {
            hn::StoreU(hn::Add(vz, hn::Mul(vs, CodesToFloat(codes + c))), df, x + c);
          }
          for (; c < ce; ++c) x[c] = zj + sj * static_cast<float>(codes[c]);
        }
      }
    }
  }
  WriteOutliers(L, S, page, row0, n, out, static_cast<size_t>(d));
}

// Dequantizes page rows [row0, row0 + n) of any format.
inline HWY_NOINLINE void DequantRows(SideContext& ctx, const uint8_t* HWY_RESTRICT page, int row0, int n,
                            float* HWY_RESTRICT out) {
  const KvStream& s = *ctx.stream;
  const SideLayout& S = s.layout().side(ctx.side);
  const int d = s.head_dim();
  switch (S.format) {
    case CodeFormat::kFp16:
      for (int r = 0; r < n; ++r) {
        HalfRowToFloat(reinterpret_cast<const uint16_t*>(PageLayout::CodeRow(page, S, row0 + r)), d,
                       out + static_cast<size_t>(r) * d);
      }
      return;
    case CodeFormat::kBf16:
      for (int r = 0; r < n; ++r) {
        Bf16RowToFloat(reinterpret_cast<const uint16_t*>(PageLayout::CodeRow(page, S, row0 + r)), d,
                       out + static_cast<size_t>(r) * d);
      }
      return;
    case CodeFormat::kFp8E4m3: {
      const float scale = s.fp8_scale(ctx.side);
      for (int r = 0; r < n; ++r) {
        Fp8RowToFloat(PageLayout::CodeRow(page, S, row0 + r), d, scale,
                      out + static_cast<size_t>(r) * d);
      }
      return;
    }
    case CodeFormat::kInt8:
    case CodeFormat::kPacked:
      DequantAffineRows(ctx, page, row0, n, out);
      return;
    case CodeFormat::kCrq:
      ::kvq::cpu::DequantizeCrqRows(s, ctx.side, page, row0, n, out);
      return;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#endif  // KVQ_KERNELS_CPU_SIMD_DEQUANT_INL_H_
