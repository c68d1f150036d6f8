// SIMD decode / chunk attention over one stream: the kernels behind
// CpuBackend().Attend (cpu_backend.cc plans, threads and merges around them).
//
// Shape of the computation (flash-decoding): keys are visited in tiles of at
// most kTile tokens that never cross a page (or, for kivi, a G-token block).
// Up to kMaxRows query rows (the GQA group, times the queries of a chunk)
// share every loaded tile. Per tile: scores S[r][t] = q_r . k_t (q already
// carries the softmax scale), an online-softmax update (running max m_r, sum
// l_r, output acc_r rescaled by exp(m_old - m_new); on AVX-512 m_r moves only
// when a score passes it by kLazyMaxSlack), then acc_r += sum_t p_rt v_t.
// The whole dequantized KV is never materialized: at most one tile of floats
// lives in a thread-local buffer.
//
// Paths, chosen per side of a page:
//  * fp16 / bf16 pages and the fp16 sink and tail rows: the float tile kernel
//    reads the 16-bit rows directly (F16C / shift conversion + FMA), and
//    requests a page's next tile into L2 while it reads one (PrefetchRowsToL2).
//  * keys of kivi with per-channel groups, uniform levels, post-RoPE (AVX2):
//    the per-channel scales fold into the query, which is quantized to int16
//    per block; integer dot products on the codes (see "kivi fast path").
//    Sparse outliers correct the affected scores afterwards.
//  * values with per-token groups, uniform or (<= 3 bits) nuq levels: kivi
//    and int8 (AVX2): scales fold into the softmax weights, zeros into one
//    float per group; codes (or levels) convert to float once per token for
//    all rows, float FMAs.
//  * everything else (fp8, int8 keys, pre_rope or ktok or nuq keys, 4-bit nuq
//    values, the portable targets): the generic tile path dequantizes one
//    tile to float (packed keys straight from the bit planes in
//    KiviKeyTileToFloat on AVX2, else simd_dequant-inl.h, bit-identical to
//    the reference), applies RoPE to keys, and runs the float tile kernel.
// The AVX2 paths also run on AVX3 (AVX-512), where the integer key scores,
// the value accumulation and the float tile kernel (fp16, bf16 and float
// rows) use 512-bit registers (KVQ_X86_AVX3 blocks); every other loop keeps
// 8 float lanes there (simd_targets.h). AVX3_DL adds VNNI: 2- and 4-bit key
// scores run with 16 tokens in the lanes of a vector (KiviKeyScoresLanes,
// vpdpbusd, no per-token reduction), other key widths multiply-add in one
// instruction (vpdpwssd), and the values of uniform kivi run as integer dot
// products too (KiviValueDot, vpdpbusd).
// Keys and values may have different code widths (vN): each side's kernel
// is instantiated for its own width (KiviSegment<key bits, value bits, D>).
// Only the integer paths round anything beyond float arithmetic (the key
// path's int16 queries, AVX3_DL's 15-bit value weights): their output is
// within ~5e-4 of the reference (contract: 5e-3), every other path within
// float rounding (~3e-6; contract 1e-4).
//
// RoPE (pre_rope keys) without a sin/cos per element: angles are linear in
// the position, so R(t0 + j) = R(t0) R(j). Key j of a tile starting at t0 is
// rotated by R(j) from a small cached table, and R(t0) moves to the query
// (q . R(t0) y = R(-t0) q . y), rotated once per tile; cos/sin of the tile
// base angle advance by the same table in double precision.

#include "kernels/cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/simd_attention.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/cpu/simd_dequant-inl.h"
#include "kernels/cpu/simd_kernels.h"
#include "kernels/group_params.h"
#include "kernels/numeric.h"
#include "kernels/rope.h"

#if HWY_TARGET == HWY_AVX3_DL && defined(__clang__)
// Highway's AVX3_DL target string names only the VEX form of VNNI; the
// 512-bit dot products need avx512vnni (which its CPU check requires).
// Clang takes one target attribute per function (a nested push is
// ignored), so it gets Highway's string with avx512vnni added.
HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR ",avx512vnni")
#else
HWY_BEFORE_NAMESPACE();
#if HWY_TARGET == HWY_AVX3_DL
#pragma GCC target("avx512vnni")  // As above, for GCC.
#endif
#endif
namespace kvq {
namespace cpu {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::CappedTag<float, 8>;
using VF = hn::Vec<DF>;

constexpr int kTile = 32;             // Tokens per tile.
constexpr int kSLd = kTile + 16;      // Leading dimension of score rows (padding).
// Token stride of the per-group rows of a tile's value scales and zero points
// (Scratch::vparams), which KiviValueAccumulate fills and ValueOutliers reads.
constexpr int kValueParamsLd = kTile + 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Lines [0, lines) from p, requested at once (a burst: at most what the
// line-fill buffers can take while the work that follows reads nothing).
HWY_INLINE void PrefetchLines(const uint8_t* p, size_t lines) {
  for (size_t i = 0; i < lines; ++i) hwy::Prefetch(p + 64 * i);
}

// Lines [0, lines) from p, requested a few per step of a loop of `steps`
// (a burst fills the line-fill buffers and stalls the pipeline): one
// division per loop, none per step.
class SpreadPrefetch {
 public:
  SpreadPrefetch(const uint8_t* p, size_t lines, size_t steps)
      : p_(p), lines_(lines), per_(steps > 0 ? (lines + steps - 1) / steps : lines) {}
  HWY_INLINE void Step() {
    const size_t end = std::min(lines_, next_ + per_);
    for (; next_ < end; ++next_) hwy::Prefetch(p_ + 64 * next_);
  }

 private:
  const uint8_t* p_;
  size_t lines_, per_, next_ = 0;
};

// Rows [t, t + n) of `rows` (row_bytes apart) requested into L2 only
// (prefetcht1 on x86), nothing when `rows` is nullptr: the 16-bit rows of
// the next tile, a few per step of the loops that read this one. On the
// Zen 4 machine of KERNELS.md section 4 these made the fp16 path 1.8-2.2x faster
// at 32k. The same requests into L1 (prefetcht0) gained
// about a tenth (a tile's 16 KiB of keys and values plus the next one's is
// all of L1), and a burst at the tile's start kept less than half the gain.
HWY_INLINE void PrefetchRowsToL2(const uint8_t* rows, size_t row_bytes, int t, int n) {
  if (rows == nullptr) return;
  const uint8_t* p = rows + static_cast<size_t>(t) * row_bytes;
  const size_t bytes = static_cast<size_t>(n) * row_bytes;
  for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 2);
}

// ---------------------------------------------------------------------------
// Row loaders of the float tile kernel.

// Load: 8 lanes (DF); Load16: 16 lanes, for the AVX-512 tile loops.
struct F16Rows {
  using T = uint16_t;
  static HWY_INLINE VF Load(DF df, const uint16_t* HWY_RESTRICT p) {
    return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::float16_t, DF>(),
                                       reinterpret_cast<const hwy::float16_t*>(p)));
  }
#if KVQ_X86_AVX3
  static HWY_INLINE __m512 Load16(const uint16_t* HWY_RESTRICT p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#endif
};
struct Bf16Rows {
  using T = uint16_t;
  static HWY_INLINE VF Load(DF df, const uint16_t* HWY_RESTRICT p) {
    return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::bfloat16_t, DF>(),
                                       reinterpret_cast<const hwy::bfloat16_t*>(p)));
  }
#if KVQ_X86_AVX3
  static HWY_INLINE __m512 Load16(const uint16_t* HWY_RESTRICT p) {  // bf16: the high half.
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
#endif
};
struct F32Rows {
  using T = float;
  static HWY_INLINE VF Load(DF df, const float* HWY_RESTRICT p) { return hn::LoadU(df, p); }
#if KVQ_X86_AVX3
  static HWY_INLINE __m512 Load16(const float* HWY_RESTRICT p) { return _mm512_loadu_ps(p); }
#endif
};

// ---------------------------------------------------------------------------
// Thread-local scratch: nothing is allocated per call once it has grown.

struct RopeTables {
  bool valid = false;
  RopeConfig config;
  int head_dim = 0;
  int pairs = 0;
  // cos / sin of Angle(i, j) for j <= kTile: double for advancing the tile
  // base angle, float [j][i] (pair-major) and [j][c] (channel layout for the
  // adjacent pairing: c_dup = cos, s_sgn = -sin / +sin).
  std::vector<double> cos_d, sin_d;
  std::vector<float> cos_f, sin_f;
  std::vector<float> cos_ch, sin_ch;
};

struct Scratch {
  int d = 0;
  std::vector<float> acc;    // [kMaxRows][d]
  std::vector<float> S;      // [kMaxRows][kSLd]
  std::vector<float> part;   // [kTile][kMaxRows][lanes]
  std::vector<float> kbuf;   // [kTile][d]
  std::vector<float> vbuf;   // [kTile][d]
  std::vector<float> qrot;   // [kMaxRows][d]
  std::vector<double> base_c, base_s;  // cos / sin of the tile base angle per pair.
  std::vector<float> base_cf, base_sf;  // The same as floats (channel layout when adjacent).
  SideContext kctx, vctx;
  RopeTables rope;
  // kivi fast path.
  std::vector<float> kparams;   // scale[d], zero[d] of the current key block.
  std::vector<int16_t> qi;      // [kMaxRows][d]
  std::vector<uint8_t> qb;      // [kMaxRows][2][d]: (qi + 128) >> 8, then qi's low byte.
  std::vector<int32_t> ipart;   // [kTile][kMaxRows][8]
  std::vector<float> vparams;   // [2][ng][kValueParamsLd]: scale then zero, per group over tokens.
  std::vector<float> wf;        // [kMaxRows][ng][kValueParamsLd]
  std::vector<float> zsum;      // [kMaxRows][ng]
  // KiviValueDot (AVX3_DL).
  std::vector<uint8_t> vcodes;  // [kTile / 4][16-byte plane block][64]: codes of 4 tokens.
  std::vector<uint8_t> wq;      // [kMaxRows][ng][64]: weight low bytes [32], high bytes [32].
  std::vector<float> wstep;     // [kMaxRows][ng]
  // Row padding (see AttendRangeImpl).
  std::vector<float> qpad, outpad;  // [kMaxRows][d]
  int32_t vispad[kMaxRows];
  float lsepad[kMaxRows];

  void Prepare(int head_dim) {
    if (d == head_dim) return;
    d = head_dim;
    const size_t D = static_cast<size_t>(d);
    acc.assign(kMaxRows * D, 0.0f);
    S.assign(kMaxRows * kSLd, 0.0f);
    part.assign(static_cast<size_t>(kTile) * kMaxRows * hn::Lanes(DF()), 0.0f);
    kbuf.assign(kTile * D, 0.0f);
    vbuf.assign(kTile * D, 0.0f);
    qrot.assign(kMaxRows * D, 0.0f);
    base_c.assign(D, 0.0);
    base_s.assign(D, 0.0);
    base_cf.assign(D, 0.0f);
    base_sf.assign(D, 0.0f);
    kparams.assign(2 * D, 0.0f);
    qi.assign(kMaxRows * D, 0);
    qb.assign(kMaxRows * 2 * D, 0);
    ipart.assign(static_cast<size_t>(kTile) * kMaxRows * 8, 0);
    vparams.assign(2 * D * kValueParamsLd, 0.0f);
    wf.assign(kMaxRows * D * kValueParamsLd, 0.0f);
    zsum.assign(kMaxRows * D, 0.0f);
    vcodes.assign(static_cast<size_t>(kTile / 4) * D * 4, 0);
    wq.assign(kMaxRows * D * 64, 0);
    wstep.assign(kMaxRows * D, 0.0f);
    qpad.assign(kMaxRows * D, 0.0f);
    outpad.assign(kMaxRows * D, 0.0f);
  }
};

Scratch& ThreadScratch(int head_dim) {
  static thread_local Scratch scratch;
  scratch.Prepare(head_dim);
  return scratch;
}

void PrepareRopeTables(const Rope& rope, RopeTables& t) {
  if (t.valid && t.config == rope.config() && t.head_dim == rope.head_dim()) return;
  t.valid = true;
  t.config = rope.config();
  t.head_dim = rope.head_dim();
  t.pairs = rope.rotary_dim() / 2;
  const int np = t.pairs;
  const int rot = rope.rotary_dim();
  t.cos_d.resize(static_cast<size_t>(kTile + 1) * np);
  t.sin_d.resize(t.cos_d.size());
  t.cos_f.resize(t.cos_d.size());
  t.sin_f.resize(t.cos_d.size());
  t.cos_ch.resize(static_cast<size_t>(kTile + 1) * rot);
  t.sin_ch.resize(t.cos_ch.size());
  for (int j = 0; j <= kTile; ++j) {
    for (int i = 0; i < np; ++i) {
      const double a = rope.Angle(i, j);
      const size_t k = static_cast<size_t>(j) * np + i;
      t.cos_d[k] = std::cos(a);
      t.sin_d[k] = std::sin(a);
      t.cos_f[k] = static_cast<float>(t.cos_d[k]);
      t.sin_f[k] = static_cast<float>(t.sin_d[k]);
      const size_t c0 = static_cast<size_t>(j) * rot + 2 * i;
      t.cos_ch[c0] = t.cos_ch[c0 + 1] = t.cos_f[k];
      t.sin_ch[c0] = -t.sin_f[k];
      t.sin_ch[c0 + 1] = t.sin_f[k];
    }
  }
}

// Rotates rows [0, n) of a key tile in place by R(j) (row j), both pairings.
void RopeTileKeys(const Rope& rope, const RopeTables& t, float* HWY_RESTRICT k, int n, int d) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const int np = t.pairs;
  const int rot = 2 * np;
  const bool adjacent = rope.config().pairing == RopeConfig::Pairing::kAdjacent;
  for (int j = 0; j < n; ++j) {
    float* x = k + static_cast<size_t>(j) * d;
    if (adjacent) {
      const float* cc = t.cos_ch.data() + static_cast<size_t>(j) * rot;
      const float* ss = t.sin_ch.data() + static_cast<size_t>(j) * rot;
      int c = 0;
#if HWY_TARGET != HWY_SCALAR
      for (; c + N <= rot; c += N) {
        const VF v = hn::LoadU(df, x + c);
        const VF y = hn::MulAdd(hn::Shuffle2301(v), hn::LoadU(df, ss + c),
                                hn::Mul(v, hn::LoadU(df, cc + c)));
        hn::StoreU(y, df, x + c);
      }
#endif
      for (; c < rot; c += 2) {
        const float x0 = x[c], x1 = x[c + 1];
        x[c] = x0 * cc[c] + x1 * ss[c];
        x[c + 1] = x1 * cc[c + 1] + x0 * ss[c + 1];
      }
    } else {
      const float* cc = t.cos_f.data() + static_cast<size_t>(j) * np;
      const float* ss = t.sin_f.data() + static_cast<size_t>(j) * np;
      float* x1p = x + np;
      int i = 0;
      for (; i + N <= np; i += N) {
        const VF x0 = hn::LoadU(df, x + i);
        const VF x1 = hn::LoadU(df, x1p + i);
        const VF c = hn::LoadU(df, cc + i);
        const VF s = hn::LoadU(df, ss + i);
        hn::StoreU(hn::NegMulAdd(x1, s, hn::Mul(x0, c)), df, x + i);
        hn::StoreU(hn::MulAdd(x0, s, hn::Mul(x1, c)), df, x1p + i);
      }
      for (; i < np; ++i) {
        const float x0 = x[i], x1 = x1p[i];
        x[i] = x0 * cc[i] - x1 * ss[i];
        x1p[i] = x0 * ss[i] + x1 * cc[i];
      }
    }
  }
}

// Tracks cos/sin of the base angle A_i(t0) of consecutive tiles in double.
struct RopeBase {
  const Rope* rope = nullptr;
  int pos = -1;  // Position the base angle is for; -1: not started.

  void MoveTo(int t0, const RopeTables& t, Scratch& sc) {
    const int np = t.pairs;
    double* c = sc.base_c.data();
    double* s = sc.base_s.data();
    const int delta = t0 - pos;
    if (pos >= 0 && delta >= 0 && delta <= kTile) {
      const double* cd = t.cos_d.data() + static_cast<size_t>(delta) * np;
      const double* sd = t.sin_d.data() + static_cast<size_t>(delta) * np;
      for (int i = 0; i < np; ++i) {
        const double c0 = c[i], s0 = s[i];
        c[i] = c0 * cd[i] - s0 * sd[i];
        s[i] = s0 * cd[i] + c0 * sd[i];
      }
    } else {
      for (int i = 0; i < np; ++i) {
        const double a = rope->Angle(i, t0);
        c[i] = std::cos(a);
        s[i] = std::sin(a);
      }
    }
    pos = t0;
  }
};

// qrot[r] = R(-t0) q[r] (only the rotary channels change): x0' = x0 c + x1 s,
// x1' = x1 c - x0 s per pair, vectorized in the layout of each pairing.
void RotateQueries(const Rope& rope, Scratch& sc, int rows, const float* q, int d,
                   float* qrot) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const int np = rope.rotary_dim() / 2;
  const int rot = 2 * np;
  float* cf = sc.base_cf.data();
  float* sf = sc.base_sf.data();
  std::memcpy(qrot, q, sizeof(float) * rows * d);
  if (rope.config().pairing == RopeConfig::Pairing::kAdjacent) {
    for (int i = 0; i < np; ++i) {  // Channel layout: c dup'ed, s as +s / -s.
      cf[2 * i] = cf[2 * i + 1] = static_cast<float>(sc.base_c[i]);
      sf[2 * i] = static_cast<float>(sc.base_s[i]);
      sf[2 * i + 1] = -sf[2 * i];
    }
    for (int r = 0; r < rows; ++r) {
      const float* x = q + r * d;
      float* y = qrot + r * d;
      int c = 0;
#if HWY_TARGET != HWY_SCALAR
      for (; c + N <= rot; c += N) {
        const VF v = hn::LoadU(df, x + c);
        hn::StoreU(hn::MulAdd(hn::Shuffle2301(v), hn::LoadU(df, sf + c), hn::Mul(v, hn::LoadU(df, cf + c))),
                   df, y + c);
      }
#endif
      for (; c < rot; c += 2) {
        y[c] = x[c] * cf[c] + x[c + 1] * sf[c];
        y[c + 1] = x[c + 1] * cf[c + 1] + x[c] * sf[c + 1];
      }
    }
    return;
  }
  for (int i = 0; i < np; ++i) {
    cf[i] = static_cast<float>(sc.base_c[i]);
    sf[i] = static_cast<float>(sc.base_s[i]);
  }
  for (int r = 0; r < rows; ++r) {
    const float* x = q + r * d;
    float* y = qrot + r * d;
    int i = 0;
    for (; i + N <= np; i += N) {
      const VF x0 = hn::LoadU(df, x + i);
      const VF x1 = hn::LoadU(df, x + np + i);
      const VF c = hn::LoadU(df, cf + i);
      const VF s = hn::LoadU(df, sf + i);
      hn::StoreU(hn::MulAdd(x1, s, hn::Mul(x0, c)), df, y + i);
      hn::StoreU(hn::NegMulAdd(x0, s, hn::Mul(x1, c)), df, y + np + i);
    }
    for (; i < np; ++i) {
      y[i] = x[i] * cf[i] + x[np + i] * sf[i];
      y[np + i] = x[np + i] * cf[i] - x[i] * sf[i];
    }
  }
}

// ---------------------------------------------------------------------------
// Float tile kernel.

#if KVQ_X86_AVX2
// Sums of 8 vectors of 8 floats (p, p + stride, ...): one vector of 8 sums.
HWY_INLINE __m256 TransposeSum8(const float* p, size_t stride) {
  const __m256 a0 = _mm256_hadd_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + stride));
  const __m256 a1 = _mm256_hadd_ps(_mm256_loadu_ps(p + 2 * stride), _mm256_loadu_ps(p + 3 * stride));
  const __m256 a2 = _mm256_hadd_ps(_mm256_loadu_ps(p + 4 * stride), _mm256_loadu_ps(p + 5 * stride));
  const __m256 a3 = _mm256_hadd_ps(_mm256_loadu_ps(p + 6 * stride), _mm256_loadu_ps(p + 7 * stride));
  const __m256 b0 = _mm256_hadd_ps(a0, a1);
  const __m256 b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
HWY_INLINE __m256i TransposeSum8(const int32_t* p, size_t stride) {
  auto ld = [](const int32_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); };
  const __m256i a0 = _mm256_hadd_epi32(ld(p), ld(p + stride));
  const __m256i a1 = _mm256_hadd_epi32(ld(p + 2 * stride), ld(p + 3 * stride));
  const __m256i a2 = _mm256_hadd_epi32(ld(p + 4 * stride), ld(p + 5 * stride));
  const __m256i a3 = _mm256_hadd_epi32(ld(p + 6 * stride), ld(p + 7 * stride));
  const __m256i b0 = _mm256_hadd_epi32(a0, a1);
  const __m256i b1 = _mm256_hadd_epi32(a2, a3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20),
                          _mm256_permute2x128_si256(b0, b1, 0x31));
}
#endif

// S[r][t] = sum of the lanes of part[t][r][:], t < n.
template <int R>
HWY_INLINE void ReduceParts(const float* HWY_RESTRICT part, int n, float* HWY_RESTRICT S) {
  const DF df;
  const size_t N = hn::Lanes(df);
  int t = 0;
#if KVQ_X86_AVX2
  for (; t + 8 <= n; t += 8) {
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(S + r * kSLd + t, TransposeSum8(part + (static_cast<size_t>(t) * R + r) * 8, R * 8));
    }
  }
#endif
  for (; t < n; ++t) {
    for (int r = 0; r < R; ++r) {
      S[r * kSLd + t] = hn::GetLane(hn::SumOfLanes(df, hn::LoadU(df, part + (static_cast<size_t>(t) * R + r) * N)));
    }
  }
}

#if KVQ_X86_AVX3
// TileScores' loop in 16 lanes: half the FMAs of the 8-lane loop, and for
// 16-bit rows (fp16 / bf16 pages, the sink and the tail) half the
// conversions. Each 16-lane sum folds into the 8 lanes of `part` that
// ReduceParts reads.
template <int R, int TS, class KL>
HWY_INLINE void TileScoresX16(const typename KL::T* HWY_RESTRICT k, size_t kstride, int n,
                              const float* HWY_RESTRICT q, int d, float* HWY_RESTRICT part,
                              const uint8_t* ahead) {
  const size_t row_bytes = kstride * sizeof(typename KL::T);
  auto fold = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  };
  int t = 0;
  for (; t + TS <= n; t += TS) {
    __m512 acc[TS][R];
    for (int u = 0; u < TS; ++u) {
      for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
    }
    const typename KL::T* kt = k + static_cast<size_t>(t) * kstride;
    PrefetchRowsToL2(ahead, row_bytes, t, TS);
    for (int c = 0; c < d; c += 16) {
      __m512 qv[R];
      for (int r = 0; r < R; ++r) qv[r] = _mm512_loadu_ps(q + r * d + c);
      for (int u = 0; u < TS; ++u) {
        const __m512 kv = KL::Load16(kt + u * kstride + c);
        for (int r = 0; r < R; ++r) acc[u][r] = _mm512_fmadd_ps(kv, qv[r], acc[u][r]);
      }
    }
    for (int u = 0; u < TS; ++u) {
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(part + (static_cast<size_t>(t + u) * R + r) * 8, fold(acc[u][r]));
      }
    }
  }
  for (; t < n; ++t) {
    PrefetchRowsToL2(ahead, row_bytes, t, 1);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
      const __m512 kv = KL::Load16(k + static_cast<size_t>(t) * kstride + c);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(q + r * d + c), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(part + (static_cast<size_t>(t) * R + r) * 8, fold(acc[r]));
    }
  }
}
#endif

// S[r][t] = q_r . k_t for t < n. TS tokens per step keep several
// independent FMA chains in flight, and with R <= 4 the chunk of each query
// row stays in a register across the TS tokens (loads, not FMAs, are the
// limit when every FMA reads q from memory). `ahead` (or nullptr): rows of
// kstride elements to request into L2 as these are read, row t with row t.
template <int R, class KL>
HWY_NOINLINE void TileScores(const typename KL::T* HWY_RESTRICT k, size_t kstride, int n,
                           const float* HWY_RESTRICT q, int d, float* HWY_RESTRICT part,
                           float* HWY_RESTRICT S, const uint8_t* ahead = nullptr) {
#if KVQ_X86_AVX3
  // 32 registers: R * TS16 accumulators, R query chunks, the key chunks.
  constexpr int TS16 = R <= 4 ? 4 : 2;
  TileScoresX16<R, TS16, KL>(k, kstride, n, q, d, part, ahead);
  ReduceParts<R>(part, n, S);
#else
  constexpr int TS = R == 1 ? 4 : (R <= 2 ? 4 : (R <= 4 ? 2 : 1));
  const size_t row_bytes = kstride * sizeof(typename KL::T);
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  int t = 0;
  for (; t + TS <= n; t += TS) {
    VF acc[TS][R];
    for (int u = 0; u < TS; ++u) {
      for (int r = 0; r < R; ++r) acc[u][r] = hn::Zero(df);
    }
    const typename KL::T* kt = k + static_cast<size_t>(t) * kstride;
    PrefetchRowsToL2(ahead, row_bytes, t, TS);
    for (int c = 0; c < d; c += N) {
      VF qv[R];
      for (int r = 0; r < R; ++r) qv[r] = hn::LoadU(df, q + r * d + c);
      for (int u = 0; u < TS; ++u) {
        const VF kv = KL::Load(df, kt + u * kstride + c);
        for (int r = 0; r < R; ++r) acc[u][r] = hn::MulAdd(kv, qv[r], acc[u][r]);
      }
    }
    for (int u = 0; u < TS; ++u) {
      for (int r = 0; r < R; ++r) hn::StoreU(acc[u][r], df, part + (static_cast<size_t>(t + u) * R + r) * N);
    }
  }
  for (; t < n; ++t) {
    PrefetchRowsToL2(ahead, row_bytes, t, 1);
    VF acc[R];
    for (int r = 0; r < R; ++r) acc[r] = hn::Zero(df);
    for (int c = 0; c < d; c += N) {
      const VF kv = KL::Load(df, k + static_cast<size_t>(t) * kstride + c);
      for (int r = 0; r < R; ++r) acc[r] = hn::MulAdd(kv, hn::LoadU(df, q + r * d + c), acc[r]);
    }
    for (int r = 0; r < R; ++r) hn::StoreU(acc[r], df, part + (static_cast<size_t>(t) * R + r) * N);
  }
  ReduceParts<R>(part, n, S);
#endif
}

// acc[r][:] += sum_t P[r][t] v_t for t < n. W vectors per channel chunk keep
// R*W accumulators in registers. `ahead` as in TileScores, requested in the
// first pass over the tokens.
template <int R, class VL>
HWY_NOINLINE void TileAccumulate(const typename VL::T* HWY_RESTRICT v, size_t vstride, int n,
                               const float* HWY_RESTRICT P, float* HWY_RESTRICT acc, int d,
                               const uint8_t* ahead = nullptr) {
  const size_t row_bytes = vstride * sizeof(typename VL::T);
#if KVQ_X86_AVX3
  // 16 lanes, W vectors per channel block so that R * W = 16 accumulators
  // stay in registers over the tile: each weight broadcast feeds W FMAs and
  // each converted row chunk R of them.
  constexpr int W = R >= 8 ? 2 : 16 / R;
  int c = 0;
  auto block = [&](auto w_tag) {
    constexpr int WB = decltype(w_tag)::value;
    __m512 a[R][WB];
    for (int r = 0; r < R; ++r) {
      for (int w = 0; w < WB; ++w) a[r][w] = _mm512_loadu_ps(acc + r * d + c + 16 * w);
    }
    for (int t = 0; t < n; ++t) {
      if (c == 0) PrefetchRowsToL2(ahead, row_bytes, t, 1);
      __m512 x[WB];
      for (int w = 0; w < WB; ++w) x[w] = VL::Load16(v + static_cast<size_t>(t) * vstride + c + 16 * w);
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(P[r * kSLd + t]);
        for (int w = 0; w < WB; ++w) a[r][w] = _mm512_fmadd_ps(p, x[w], a[r][w]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int w = 0; w < WB; ++w) _mm512_storeu_ps(acc + r * d + c + 16 * w, a[r][w]);
    }
  };
  for (; c + 16 * W <= d; c += 16 * W) block(std::integral_constant<int, W>());
  for (; c < d; c += 16) block(std::integral_constant<int, 1>());
#else
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  constexpr int W = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  int c = 0;
  for (; c + W * N <= d; c += W * N) {
    VF a[R][W];
    for (int r = 0; r < R; ++r) {
      for (int w = 0; w < W; ++w) a[r][w] = hn::LoadU(df, acc + r * d + c + w * N);
    }
    for (int t = 0; t < n; ++t) {
      if (c == 0) PrefetchRowsToL2(ahead, row_bytes, t, 1);
      VF x[W];
      for (int w = 0; w < W; ++w) x[w] = VL::Load(df, v + static_cast<size_t>(t) * vstride + c + w * N);
      for (int r = 0; r < R; ++r) {
        const VF p = hn::Set(df, P[r * kSLd + t]);
        for (int w = 0; w < W; ++w) a[r][w] = hn::MulAdd(p, x[w], a[r][w]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int w = 0; w < W; ++w) hn::StoreU(a[r][w], df, acc + r * d + c + w * N);
    }
  }
  for (; c < d; c += N) {
    VF a[R];
    for (int r = 0; r < R; ++r) a[r] = hn::LoadU(df, acc + r * d + c);
    for (int t = 0; t < n; ++t) {
      const VF x = VL::Load(df, v + static_cast<size_t>(t) * vstride + c);
      for (int r = 0; r < R; ++r) a[r] = hn::MulAdd(hn::Set(df, P[r * kSLd + t]), x, a[r]);
    }
    for (int r = 0; r < R; ++r) hn::StoreU(a[r], df, acc + r * d + c);
  }
#endif
}

// ---------------------------------------------------------------------------
// Online softmax.

struct RowState {
  float m[kMaxRows];
  float l[kMaxRows];
  // AVX-512: the sum of each row per lane, added into l once, in Finish.
  alignas(64) float lanes[kMaxRows][16];
};

// The AVX-512 softmax moves a row's running max only when a score exceeds
// it by more than this (natural log units): probabilities then stay below
// e^8, and a tile that leaves the max where it is needs no reduction.
constexpr float kLazyMaxSlack = 8.0f;

#if KVQ_X86_AVX3
// exp(x) in 16 lanes for x <= 80, -inf included (-> +0): 2^t with t = x log2 e,
// split into n = round(t) and f = t - n in [-1/2, 1/2]; 2^f from its Taylor
// polynomial of degree 6 (truncation below 1.3e-7 relative) and 2^n applied
// by vscalefps, which rounds results below the smallest denormal to +0.
// Eleven instructions where Highway's Exp, accurate to an ulp over the whole
// float range, takes about 36 (the softmax runs it on every score).
HWY_INLINE __m512 ExpUpTo80(__m512 x) {
  // exp(-150) is +0 in float; the clamp also turns -inf into a finite t.
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381608e-4f);                 // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));   // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));   // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));     // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));     // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// Turns the scores of a tile (tokens t0 .. t0+n) into probabilities in place,
// masking keys beyond each row's visible end, and rescales l and acc to the
// new running max. Returns false when no row sees any key of the tile.
HWY_NOINLINE bool SoftmaxTile(int R, int n, int t0, const int32_t* HWY_RESTRICT visible_end,
                            float* HWY_RESTRICT S, RowState& st, float* HWY_RESTRICT acc, int d) {
#if KVQ_X86_AVX3
  // 16 lanes (half the exp polynomials): rows are padded to kSLd >= 2 * 16
  // and head_dim is a multiple of 16; lanes past n hold p = 0.
  const hn::CappedTag<float, 16> df;
  using VF = hn::Vec<decltype(df)>;
#else
  const DF df;
#endif
  const int N = static_cast<int>(hn::Lanes(df));
  const int npad = (n + N - 1) / N * N;
  bool any = false;
  for (int r = 0; r < R; ++r) {
    float* s = S + r * kSLd;
    const int nv = std::clamp(visible_end[r] - t0, 0, n);
    if (nv == 0) {
      std::fill(s, s + npad, 0.0f);
      continue;
    }
    any = true;
    for (int t = nv; t < npad; ++t) s[t] = kNegInf;
#if KVQ_X86_AVX3
    // No horizontal step on the common path: scores are exponentiated
    // against the running max m, which moves only when a score exceeds
    // m + kLazyMaxSlack (softmax is the same for any shift; only m + log l
    // must be the one the probabilities were taken against). The first tile
    // of a row, and a tile that raises the max that much, reduce to the
    // exact new max and rescale the sums and the output. Sums stay per lane
    // (RowState::lanes).
    const __m512 lim = _mm512_set1_ps(st.m[r] + kLazyMaxSlack);  // -inf: every score.
    __m512 x[2] = {_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16)};
    const int nvec = npad / 16;
    __mmask16 over = _mm512_cmp_ps_mask(x[0], lim, _CMP_GT_OQ);
    if (nvec > 1) over |= _mm512_cmp_ps_mask(x[1], lim, _CMP_GT_OQ);
    __m512 lanes = _mm512_load_ps(st.lanes[r]);
    if (over != 0) {
      const __m512 top = nvec > 1 ? _mm512_max_ps(x[0], x[1]) : x[0];
      const float m_new = std::max(st.m[r], _mm512_reduce_max_ps(top));
      const float corr = st.m[r] == kNegInf ? 0.0f : std::exp(st.m[r] - m_new);
      lanes = _mm512_mul_ps(lanes, _mm512_set1_ps(corr));
      st.l[r] *= corr;
      st.m[r] = m_new;
      const __m512 vc = _mm512_set1_ps(corr);
      float* a = acc + r * d;
      for (int c = 0; c < d; c += 16) _mm512_storeu_ps(a + c, _mm512_mul_ps(_mm512_loadu_ps(a + c), vc));
    }
    const __m512 vm = _mm512_set1_ps(st.m[r]);
    for (int v = 0; v < nvec; ++v) {
      const __m512 p = ExpUpTo80(_mm512_sub_ps(x[v], vm));
      lanes = _mm512_add_ps(lanes, p);
      _mm512_storeu_ps(s + 16 * v, p);
    }
    _mm512_store_ps(st.lanes[r], lanes);
#else
    // A score that overflowed float is NaN (inf - inf in its dot product),
    // or +inf, which makes its lane NaN below (inf - inf), or -inf, which
    // does the same when every visible score of the row is -inf (the max
    // stays -inf, and -inf - -inf is NaN). Exp converts its
    // argument to an integer, which for NaN is undefined behaviour on the
    // portable targets: in such a tile, NaN lanes take weight 0 and the
    // row's sum becomes NaN instead, so the call fails in
    // CheckAttentionResults as it does on AVX-512. Found in the max pass,
    // which reads the scores anyway; the exp loop stays as it was.
    VF vmax = hn::Set(df, kNegInf);
    VF vnan = hn::Zero(df);
    for (int t = 0; t < npad; t += N) {
      const VF v = hn::LoadU(df, s + t);
      vmax = hn::Max(vmax, v);
      vnan = hn::Or(vnan, hn::VecFromMask(df, hn::IsNaN(v)));
    }
    const float tile_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
    const float m_new = std::max(st.m[r], tile_max);
    // The row sees a key of this tile, so a max that is not finite came
    // from overflowed scores.
    const bool overflowed = !hn::AllFalse(df, hn::MaskFromVec(vnan)) || !std::isfinite(m_new);
    // Once the running max settles (early, where sink tokens draw the
    // attention) most tiles leave it unchanged: no libm exp for them.
    const float corr =
        st.m[r] == kNegInf ? 0.0f : (m_new == st.m[r] ? 1.0f : std::exp(st.m[r] - m_new));
    const VF vm = hn::Set(df, m_new);
    VF vsum = hn::Zero(df);
    for (int t = 0; t < npad; t += N) {
      VF x = hn::Sub(hn::LoadU(df, s + t), vm);
      if (overflowed) x = hn::IfThenElse(hn::IsNaN(x), hn::Set(df, kNegInf), x);
      const VF p = hn::Exp(df, x);
      vsum = hn::Add(vsum, p);
      hn::StoreU(p, df, s + t);
    }
    const float sum = overflowed ? std::numeric_limits<float>::quiet_NaN()
                                 : hn::GetLane(hn::SumOfLanes(df, vsum));
    st.l[r] = st.l[r] * corr + sum;
    st.m[r] = m_new;
    if (corr != 1.0f) {
      const VF vc = hn::Set(df, corr);
      float* a = acc + r * d;
      for (int c = 0; c < d; c += N) hn::StoreU(hn::Mul(hn::LoadU(df, a + c), vc), df, a + c);
    }
#endif
  }
  return any;
}

// ---------------------------------------------------------------------------
// kivi fast path (AVX2).
//
// Keys, per-channel uniform: within a G-token block k[t][c] = z_c + s_c *
// code[t][c], so q.k_t = sum_c (q_c s_c) code[t][c] + sum_c q_c z_c. Per block
// and row, q~ = q * s is quantized to int16 with one float scale
// a = max|q~| / 32767, the constant sum_c q_c z_c is a float dot, and per
// token the integer dot of q~ with the codes is vpmaddwd on codes widened to
// int16 (16 MACs per instruction, int32 sums: |sum| <= 256 * 32767 * 15 <
// 2^31). The rounding residual e of q~ is folded into the constant against
// the middle code m: a sum_c e_c m, so the error left, a sum_c e_c (code - m),
// is unbiased; scores move by ~1e-5 of their scale. (An int8 q~, as
// vpmaddubsw would take, measured 7e-3..1e-2 relative output error on keys
// with outlier channels: over the 5e-3 contract.)
//
// Values, per-token groups (kivi, and int8 with one group): v[t][c] = z_tg +
// s_tg * code[t][c] for the channel group g of c, so
// o_c = sum_t (p_t s_tg) code[t][c] + sum_t p_t z_tg: the scales fold into the
// softmax weights, the zeros into one float per (row, group), and each
// token's codes convert to float once (shift and mask of the bit plane, no
// dequantization) for all rows of the group. Float FMAs keep this path
// exact to float rounding: integer weights (int16 per tile) cost ~6e-5 and
// were no faster on AVX2, because every int16 multiply-add needs a separate
// add. AVX3_DL has that add fused (vpdpbusd: 4 byte products and the add):
// there the uniform 2- and 4-bit values take KiviValueDot instead.
//
// Codes come straight from the bit planes: for a run of channels starting at
// c0, the plane bytes c0 mod P .. zero-extended, shifted right by (c0 / P) * b
// and masked; channels stay in natural order.

#if KVQ_X86_AVX2

// Which sides of a stream's pages the kernels below take; the other side
// (or both) goes through the generic float tiles.
struct FastSides {
  bool key = false;    // kivi per-channel keys, uniform levels, post-RoPE.
  bool value = false;  // Per-token groups of >= 16 channels, uniform (kivi, int8).
};
FastSides ChooseFastSides(const KvStream& s) {
  const QuantSpec& spec = s.spec();
  const PageLayout& L = s.layout();
  const int d = L.head_dim;
  FastSides f;
  if (L.key.format != CodeFormat::kPacked && L.key.format != CodeFormat::kInt8) return f;
  const bool dims = d == 64 || d == 128 || d == 256;
  if (!dims) return f;
  f.key = L.key.axis == ParamAxis::kChannelGroups && !spec.pre_rope && !spec.nuq;
  // nuq values: up to 8 levels, picked by blends (NuqLevels8).
  f.value = L.value.axis == ParamAxis::kTokenGroups && L.value.group_channels % 16 == 0 &&
            (!spec.nuq || spec.bits <= 3);
  return f;
}

HWY_INLINE float HMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
HWY_INLINE float HSum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

HWY_INLINE __m256i Zx16(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Channels [16j, 16j + 16) of one code row widened to int16, natural order:
// the plane bytes c0 mod P .. +16 (P the plane's bytes per row) shifted right
// by (c0 / P) * b and masked; 3-bit codes add the 1-bit plane's bit << 2.
template <int kBits, int D>
HWY_INLINE __m256i WidenChunk(const uint8_t* HWY_RESTRICT row, int j) {
  const int c0 = 16 * j;
  if constexpr (kBits == 8) {
    return Zx16(row + c0);
  } else if constexpr (kBits == 4) {
    constexpr int P = D / 2;
    return c0 < P ? _mm256_and_si256(Zx16(row + c0), _mm256_set1_epi16(0x0F))
                  : _mm256_srli_epi16(Zx16(row + c0 - P), 4);
  } else {
    constexpr int P = D / 4;
    const int m = c0 / P;
    const __m256i x = Zx16(row + c0 % P);
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(x, _mm_cvtsi32_si128(2 * m)),
                                        _mm256_set1_epi16(0x03));
    if constexpr (kBits == 2) {
      return lo;
    } else {
      constexpr int P1 = D / 8;
      __m256i h;
      if constexpr (P1 >= 16) {
        const __m256i y = Zx16(row + P + c0 % P1);
        h = _mm256_srl_epi16(y, _mm_cvtsi32_si128(c0 / P1));
      } else {
        // head_dim 64: the high-bit plane is 8 bytes, so channels c0 .. c0+7
        // read bit c0/8 of bytes 0..7 and c0+8 .. c0+15 the next bit of the
        // same bytes: widen the 8 bytes twice, shift the upper 8 lanes (the
        // upper 128-bit half) one further.
        static_assert(P1 == 8, "head_dim 64");
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + P));
        const __m256i y = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(b, b));
        const __m256i h0 = _mm256_srl_epi16(y, _mm_cvtsi32_si128(c0 / P1));
        h = _mm256_blend_epi32(h0, _mm256_srli_epi16(h0, 1), 0xF0);
      }
      h = _mm256_and_si256(h, _mm256_set1_epi16(0x01));
      return _mm256_or_si256(lo, _mm256_slli_epi16(h, 2));
    }
  }
}

// Code of channel c in a packed row (scalar: sparse outlier corrections).
template <int kBits, int D>
HWY_INLINE int CodeAt(const uint8_t* HWY_RESTRICT row, int c) {
  if constexpr (kBits == 8) {
    return row[c];
  } else if constexpr (kBits == 4) {
    constexpr int P = D / 2;
    return (row[c % P] >> (4 * (c / P))) & 0x0F;
  } else {
    constexpr int P = D / 4;
    int v = (row[c % P] >> (2 * (c / P))) & 0x03;
    if constexpr (kBits == 3) {
      constexpr int P1 = D / 8;
      v |= ((row[P + c % P1] >> (c / P1)) & 1) << 2;
    }
    return v;
  }
}

#if KVQ_X86_AVX3
// Entries [e, e + 16) of a block's outlier table (k entries: positions
// token * D + channel, then their fp16 values), decoded 16 at a time for the
// tile of m tokens that starts `first` tokens into the block, whose code
// rows start at `codes` (row_bytes apart): each entry's token in the tile,
// channel, code and exact value; `in` marks the entries of the tile.
struct OutlierLanes {
  __m512i tt, c, code;
  __m512 value;
  __mmask16 in;
};
template <int kBits, int D>
HWY_INLINE OutlierLanes LoadOutlierLanes(const uint16_t* HWY_RESTRICT tab, int k, int e,
                                         int first, int m, const uint8_t* codes,
                                         size_t row_bytes) {
  constexpr int kShiftD = std::countr_zero(static_cast<unsigned>(D));
  const __mmask16 live =
      k - e >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (k - e)) - 1);
  const __m512i pos = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, tab + e));
  OutlierLanes o;
  o.tt = _mm512_sub_epi32(_mm512_srli_epi32(pos, kShiftD), _mm512_set1_epi32(first));
  o.c = _mm512_and_si512(pos, _mm512_set1_epi32(D - 1));
  o.in = _mm512_mask_cmplt_epu32_mask(live, o.tt, _mm512_set1_epi32(m));
  o.value = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, tab + k + e));
  // The byte that holds the entry's code (CodeAt's layout), read as 32 bits.
  // The 3 bytes after it are in the page: a page with outliers has its
  // parameter and outlier tables after the code rows of both sides.
  const __m512i row_at = _mm512_mullo_epi32(o.tt, _mm512_set1_epi32(static_cast<int>(row_bytes)));
  const auto byte = [&](__m512i offset) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), o.in,
                                       _mm512_add_epi32(row_at, offset), codes, 1);
  };
  if constexpr (kBits == 8) {
    o.code = _mm512_and_si512(byte(o.c), _mm512_set1_epi32(0xFF));
  } else {
    constexpr int kPlane = kBits == 4 ? D / 2 : D / 4;  // Bytes per plane of the row.
    constexpr int kShiftP = std::countr_zero(static_cast<unsigned>(kPlane));
    constexpr int kWidth = kBits == 4 ? 4 : 2;
    const __m512i in_plane = _mm512_and_si512(o.c, _mm512_set1_epi32(kPlane - 1));
    const __m512i shift =
        _mm512_mullo_epi32(_mm512_srli_epi32(o.c, kShiftP), _mm512_set1_epi32(kWidth));
    o.code = _mm512_and_si512(_mm512_srlv_epi32(byte(in_plane), shift),
                              _mm512_set1_epi32((1 << kWidth) - 1));
    if constexpr (kBits == 3) {
      constexpr int kPlane1 = D / 8;
      constexpr int kShiftP1 = std::countr_zero(static_cast<unsigned>(kPlane1));
      const __m512i hi_at = _mm512_add_epi32(_mm512_set1_epi32(kPlane),
                                             _mm512_and_si512(o.c, _mm512_set1_epi32(kPlane1 - 1)));
      const __m512i hi = _mm512_and_si512(
          _mm512_srlv_epi32(byte(hi_at), _mm512_srli_epi32(o.c, kShiftP1)), _mm512_set1_epi32(1));
      o.code = _mm512_or_si512(o.code, _mm512_slli_epi32(hi, 2));
    }
  }
  return o;
}

// x - (zero + scale * level) per entry, the scale and zero point gathered
// from `scale` and `zero` at `at` (as the scalar loops compute it).
HWY_INLINE __m512 OutlierDiffs(const OutlierLanes& o, __m512i at, const float* scale,
                               const float* zero, __m512 level) {
  const __m512 sg = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), o.in, at, scale, 4);
  const __m512 zg = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), o.in, at, zero, 4);
  return _mm512_sub_ps(o.value, _mm512_add_ps(zg, _mm512_mul_ps(sg, level)));
}

// Calls update(tt, c, diff) for each entry of the tile, in table order (the
// order of the scalar loops, so the sums are the same).
template <class Update>
HWY_INLINE void ForEachOutlierLane(const OutlierLanes& o, __m512 diff, Update&& update) {
  alignas(64) int32_t tts[16], cs[16];
  alignas(64) float diffs[16];
  _mm512_store_si512(tts, o.tt);
  _mm512_store_si512(cs, o.c);
  _mm512_store_ps(diffs, diff);
  for (unsigned bits = o.in; bits != 0; bits &= bits - 1) {
    const int j = std::countr_zero(bits);
    update(tts[j], cs[j], diffs[j]);
  }
}
#endif

#if KVQ_X86_AVX3
// Channels [32j, 32j + 32) of one code row widened to int16 (one zmm): where
// the 32 channels share one shift of one plane (8 bits; 4 bits; 2 bits at
// head_dim >= 128), one widening load, a shift and a mask instead of two
// WidenChunk halves and an insert.
template <int kBits, int D>
HWY_INLINE __m512i Widen32(const uint8_t* HWY_RESTRICT row, int j) {
  const int c0 = 32 * j;
  auto zx = [](const uint8_t* p) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  if constexpr (kBits == 8) {
    return zx(row + c0);
  } else if constexpr (kBits == 4) {
    constexpr int P = D / 2;
    return c0 < P ? _mm512_and_si512(zx(row + c0), _mm512_set1_epi16(0x0F))
                  : _mm512_srli_epi16(zx(row + c0 - P), 4);
  } else if constexpr (kBits == 2 && D >= 128) {
    constexpr int P = D / 4;
    return _mm512_and_si512(_mm512_srl_epi16(zx(row + c0 % P), _mm_cvtsi32_si128(2 * (c0 / P))),
                            _mm512_set1_epi16(0x03));
  } else {
    // Named first: clang defines _mm512_inserti64x4 as a macro, which would
    // split the template arguments' comma.
    const __m256i lo = WidenChunk<kBits, D>(row, 2 * j);
    const __m256i hi = WidenChunk<kBits, D>(row, 2 * j + 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}
#endif

#if KVQ_X86_AVX3
// A transpose of 16 tokens x 2^w dword columns held in 2^w registers
// (register i lane l = element 16 i + l of the token-major block) into one
// register per column (lane t = token t), as w rounds of two-source
// permutes: round s swaps register-index bit s with lane-index bit s; the
// last round's indices are found by search so that tokens come out in order.
struct DwordTransposePlan {
  int32_t idx[3][2][16] = {};
  bool ok = false;
};

constexpr DwordTransposePlan MakeDwordTransposePlan(int w) {
  DwordTransposePlan p;
  const int n = 1 << w;
  int tag[8][16] = {};  // Element (16 i + l) currently in register i', lane l'.
  for (int i = 0; i < n; ++i) {
    for (int l = 0; l < 16; ++l) tag[i][l] = 16 * i + l;
  }
  for (int s = 0; s < w; ++s) {
    const int bit = 1 << s;
    if (s + 1 < w) {
      for (int l = 0; l < 16; ++l) {
        const int from_b = (l >> s) & 1;
        p.idx[s][0][l] = (l & ~bit) | (from_b << 4);
        p.idx[s][1][l] = (l | bit) | (from_b << 4);
      }
    } else {
      // Output register k, lane t must hold token t's column k, element
      // t * n + k; it lies in register k & ~bit or k | bit. Take the
      // indices from the pair (0, bit) and check every pair agrees.
      for (int half = 0; half < 2; ++half) {
        const int k = half ? bit : 0;
        for (int t = 0; t < 16; ++t) {
          int found = -1;
          for (int l = 0; l < 16; ++l) {
            if (tag[0][l] == t * n + k) found = l;
            if (tag[bit][l] == t * n + k) found = 16 + l;
          }
          if (found < 0) return p;
          p.idx[s][half][t] = found;
        }
      }
    }
    int next[8][16] = {};
    for (int j = 0; j < n; ++j) {
      if (j & bit) continue;
      for (int half = 0; half < 2; ++half) {
        for (int l = 0; l < 16; ++l) {
          const int src = p.idx[s][half][l];
          next[j | (half ? bit : 0)][l] = src < 16 ? tag[j][src] : tag[j | bit][src - 16];
        }
      }
    }
    for (int j = 0; j < n; ++j) {
      for (int l = 0; l < 16; ++l) tag[j][l] = next[j][l];
    }
  }
  for (int k = 0; k < n; ++k) {
    for (int t = 0; t < 16; ++t) {
      if (tag[k][t] != t * n + k) return p;
    }
  }
  p.ok = true;
  return p;
}

template <int w>
inline constexpr DwordTransposePlan kDwordTranspose = MakeDwordTransposePlan(w);
static_assert(kDwordTranspose<2>.ok && kDwordTranspose<3>.ok);

template <int w>
HWY_INLINE void TransposeDwords(__m512i* HWY_RESTRICT x) {
  constexpr int n = 1 << w;
#pragma GCC unroll 3
  for (int s = 0; s < w; ++s) {
    const __m512i i0 = _mm512_loadu_si512(kDwordTranspose<w>.idx[s][0]);
    const __m512i i1 = _mm512_loadu_si512(kDwordTranspose<w>.idx[s][1]);
    __m512i y[n];
#pragma GCC unroll 8
    for (int j = 0; j < n; ++j) {
      if (j & (1 << s)) continue;
      y[j] = _mm512_permutex2var_epi32(x[j], i0, x[j | (1 << s)]);
      y[j | (1 << s)] = _mm512_permutex2var_epi32(x[j], i1, x[j | (1 << s)]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < n; ++j) x[j] = y[j];
  }
}
#endif  // KVQ_X86_AVX3

#if KVQ_X86_VNNI
// ---------------------------------------------------------------------------
// Key scores with tokens in lanes (AVX3_DL, 2- and 4-bit codes).
//
// The token-major rows give each token's dot product across the lanes of a
// vector, and every token then pays for a horizontal reduction. Here the
// codes of 16 tokens are transposed in registers instead: 32-bit column k of
// 16 rows becomes one vector whose lane t is dword k of token t. Byte i of
// that dword, shifted by b * m and masked, is the code of channel
// 4k + i + P m (P the plane's bytes per row), so one vpdpbusd against the
// four query bytes of those channels, broadcast, adds their products into
// each token's own lane: no reduction, 16 tokens per instruction.
//
// vpdpbusd multiplies unsigned by signed bytes: the codes are the unsigned
// operand, and the int16 query splits exactly into two signed bytes,
// qi = 256 hi + lo with lo the low byte read as signed and
// hi = (qi + 128) >> 8. hi fits a signed byte while |qi| <= 32639, which is
// why this target quantizes the query to that bound (kQiMax) rather than
// 32767. Both bytes are then the operand an instruction can broadcast from
// memory itself. The two int32 sums recombine to the integer the per-token
// path computes from the same qi, so the two paths give the same scores.

// qi's high bytes then its low bytes, per row, so four consecutive channels
// of either are one broadcastable dword.
template <int D>
HWY_INLINE void SplitQueryBytes(const int16_t* HWY_RESTRICT qi, int rows,
                                uint8_t* HWY_RESTRICT qb) {
  static_assert(D % 32 == 0);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < D; c += 32) {
      const __m512i x = _mm512_loadu_si512(qi + r * D + c);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 2 * r * D + c),
                          _mm512_cvtepi16_epi8(_mm512_srai_epi16(
                              _mm512_add_epi16(x, _mm512_set1_epi16(128)), 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 2 * r * D + D + c),
                          _mm512_cvtepi16_epi8(x));
    }
  }
}

// acc + vpdpbusd(u, the dword at p broadcast): the broadcast as the
// instruction's own memory operand ({1to16}), one fused uop where GCC emits a
// separate vpbroadcastd for the intrinsics.
HWY_INLINE __m512i DotBroadcast(__m512i acc, __m512i u, const uint8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Scores of tokens [row, row + 16 * (n / 16)) of one block from the split
// query bytes; returns how many tokens it scored.
template <int R, int kBits, int D>
HWY_INLINE int KiviKeyScoresLanes(const SideLayout& K, const uint8_t* page, int row, int n,
                                  const float* a, const float* cst,
                                  const uint8_t* HWY_RESTRICT qb, float* HWY_RESTRICT S,
                                  SpreadPrefetch& next_lines) {
  static_assert(kBits == 2 || kBits == 4);
  constexpr int kRowBytes = D * kBits / 8;  // One plane: P = kRowBytes.
  constexpr int kCols = kRowBytes / 4;      // Dword columns per row.
  constexpr int w = kCols >= 8 ? 3 : 2;
  constexpr int kPassCols = 1 << w;
  constexpr int kPasses = kCols / kPassCols;
  constexpr int kRowsPerReg = 16 / kPassCols;
  constexpr int kPerByte = 8 / kBits;
  // Two accumulators per (row, byte) where registers allow: a vpdpbusd chain
  // is latency-bound (5 cycles) at one per dword column and shift.
  constexpr int NA = R <= 4 ? 2 : 1;
  static_assert(kCols % kPassCols == 0 && kRowsPerReg * kPassCols == 16);
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << kBits) - 1));
  int t = 0;
  for (; t + 16 <= n; t += 16) {
    const uint8_t* codes = PageLayout::CodeRow(page, K, row + t);
    // Hide the query bytes' address from the optimizer, once per 16 tokens:
    // without this GCC hoists the broadcasts' addresses (or, for the
    // intrinsics, the broadcasts) out of the token loop and spills them
    // (10% slower at llama 2k); inside, each is a load folded into the
    // multiply-add.
    const uint8_t* qbt = qb;
    asm("" : "+r"(qbt));
    __m512i hi[R][NA], lo[R][NA];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < NA; ++u) hi[r][u] = lo[r][u] = _mm512_setzero_si512();
    }
    int issued = 0;
#pragma GCC unroll 4
    for (int h = 0; h < kPasses; ++h) {
      __m512i x[kPassCols];
#pragma GCC unroll 8
      for (int i = 0; i < kPassCols; ++i) {
        const uint8_t* p = codes + static_cast<size_t>(kRowsPerReg * i) * kRowBytes;
        if constexpr (kPasses == 1) {
          x[i] = _mm512_loadu_si512(p);
        } else {
          x[i] = _mm512_inserti64x4(
              _mm512_castsi256_si512(
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kRowBytes + 32 * h)), 1);
        }
      }
      TransposeDwords<w>(x);
#pragma GCC unroll 8
      for (int k = 0; k < kPassCols; ++k) {
        const int col = kPassCols * h + k;
#pragma GCC unroll 4
        for (int m = 0; m < kPerByte; ++m) {
          const __m512i c =
              _mm512_and_si512(m == 0 ? x[k] : _mm512_srli_epi16(x[k], kBits * m), mask);
          const int c0 = 4 * col + kRowBytes * m;
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const uint8_t* qr = qbt + 2 * r * D;
            hi[r][k % NA] = DotBroadcast(hi[r][k % NA], c, qr + c0);
            lo[r][k % NA] = DotBroadcast(lo[r][k % NA], c, qr + D + c0);
          }
        }
        // The next page's share, about one step per token as in the
        // per-token loop, spread over the columns.
        for (; issued < 16 && issued * kCols < 16 * (col + 1); ++issued) next_lines.Step();
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512i sh = hi[r][0], sl = lo[r][0];
      if constexpr (NA == 2) {
        sh = _mm512_add_epi32(sh, hi[r][1]);
        sl = _mm512_add_epi32(sl, lo[r][1]);
      }
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl);
      _mm512_storeu_ps(S + r * kSLd + t, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                                         _mm512_set1_ps(a[r]),
                                                         _mm512_set1_ps(cst[r])));
    }
  }
  return t;
}
#endif  // KVQ_X86_VNNI

#if KVQ_X86_AVX3
// Four rows' 16-lane vectors reduced together to four floats (lane r = row
// r): one tree of unpacks and block shuffles instead of four reductions,
// each a chain of shuffles and dependent adds.
template <class Op>
HWY_INLINE __m128 ReduceRows4(const __m512* v, Op op) {
  const __m512 t01 = op(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 t23 = op(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512d d01 = _mm512_castps_pd(t01), d23 = _mm512_castps_pd(t23);
  // Per 128-bit block: [r0 r1 r2 r3] over that block's lanes.
  __m512 u = op(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  u = op(u, _mm512_shuffle_f32x4(u, u, 0x4E));
  u = op(u, _mm512_shuffle_f32x4(u, u, 0xB1));
  return _mm512_castps512_ps128(u);
}
#endif

// Per-block key setup: int16 q~ per row, its scale and the constant term.
// The constant also carries the rounding residual of q~ against the middle
// code m = (2^bits - 1) / 2: sum_c q~_c code_c = a sum_c qi_c code_c +
// a sum_c e_c code_c, and a sum_c e_c m is added exactly, so what is left of
// the rounding error is a sum_c e_c (code_c - m), small and unbiased.
#if KVQ_X86_VNNI
constexpr float kQiMax = 32639.0f;  // The split into signed bytes (KiviKeyScoresLanes).
#else
constexpr float kQiMax = 32767.0f;
#endif

template <int R, int D>
HWY_NOINLINE void KiviKeyBlock(const KvStream& s, const uint8_t* page, int block,
                               const float* HWY_RESTRICT q, Scratch& sc, float* a, float* cst) {
  const PageLayout& L = s.layout();
  const float mid = 0.5f * static_cast<float>((1 << L.key.bits) - 1);
  float* scale = sc.kparams.data();
  float* zero = scale + D;
#if KVQ_X86_AVX3
  // 16 channels per step, rows four at a time with their reductions in one
  // tree (ReduceRows4): the same arithmetic per element; the maxima are
  // exact, the constant's dot product and the residual's sum add in
  // another order than on AVX2.
  if constexpr (D % 16 == 0) {
    if (L.key.param_bits == 16) {
      const uint16_t* p = L.Params(page, L.key, block);
      for (int c = 0; c < 2 * D; c += 16) {
        _mm512_storeu_ps(scale + c, _mm512_cvtph_ps(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(p + c))));
      }
    } else {
      LoadParams(L, L.key, page, block, 1, scale);
    }
    const auto max_op = [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); };
    const auto add_op = [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); };
    for (int r0 = 0; r0 < R; r0 += 4) {
      constexpr int kRows = R < 4 ? R : 4;
      __m512 vmax[4], vc[4], resid[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        vmax[k] = vc[k] = resid[k] = _mm512_setzero_ps();
        if (k >= kRows) continue;
        const float* qr = q + (r0 + k) * D;
#pragma GCC unroll 16
        for (int c = 0; c < D; c += 16) {
          const __m512 qv = _mm512_loadu_ps(qr + c);
          vmax[k] = _mm512_max_ps(vmax[k],
                                  _mm512_abs_ps(_mm512_mul_ps(qv, _mm512_loadu_ps(scale + c))));
          vc[k] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(zero + c), vc[k]);
        }
      }
      alignas(16) float amax[4], inv[4], res[4];
      const __m128 vamax = ReduceRows4(vmax, max_op);
      _mm_store_ps(amax, vamax);
      _mm_store_ps(inv, _mm_div_ps(_mm_set1_ps(kQiMax), vamax));
      _mm_storeu_ps(cst + r0, ReduceRows4(vc, add_op));  // cst has kMaxRows entries.
#pragma GCC unroll 4
      for (int k = 0; k < kRows; ++k) {
        const int r = r0 + k;
        int16_t* qi = sc.qi.data() + r * D;
        if (!(amax[k] > 0.0f)) {
          a[r] = 0.0f;
          std::memset(qi, 0, sizeof(int16_t) * D);
          continue;
        }
        a[r] = amax[k] / kQiMax;
        const __m512 vinv = _mm512_set1_ps(inv[k]);
        const float* qr = q + r * D;
#pragma GCC unroll 16
        for (int c = 0; c < D; c += 16) {
          const __m512 x = _mm512_mul_ps(
              _mm512_mul_ps(_mm512_loadu_ps(qr + c), _mm512_loadu_ps(scale + c)), vinv);
          const __m512 rx = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          resid[k] = _mm512_add_ps(resid[k], _mm512_sub_ps(x, rx));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + c),
                              _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(rx)));
        }
      }
      _mm_store_ps(res, ReduceRows4(resid, add_op));
      for (int k = 0; k < kRows; ++k) cst[r0 + k] += mid * a[r0 + k] * res[k];
    }
#if KVQ_X86_VNNI
    SplitQueryBytes<D>(sc.qi.data(), R, sc.qb.data());
#endif
    return;
  }
#endif
  LoadParams(L, L.key, page, block, 1, scale);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int r = 0; r < R; ++r) {
    const float* qr = q + r * D;
    __m256 vmax = _mm256_setzero_ps();
    __m256 vc = _mm256_setzero_ps();
    for (int c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(qr + c);
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_mul_ps(qv, _mm256_loadu_ps(scale + c)), absmask));
      vc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(zero + c), vc);
    }
    const float amax = HMax(vmax);
    cst[r] = HSum(vc);
    int16_t* qi = sc.qi.data() + r * D;
    if (!(amax > 0.0f)) {
      a[r] = 0.0f;
      std::memset(qi, 0, sizeof(int16_t) * D);
      continue;
    }
    a[r] = amax / 32767.0f;
    const __m256 inv = _mm256_set1_ps(32767.0f / amax);
    __m256 resid = _mm256_setzero_ps();
    for (int c = 0; c < D; c += 16) {
      const __m256 x0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(qr + c), _mm256_loadu_ps(scale + c)), inv);
      const __m256 x1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(qr + c + 8), _mm256_loadu_ps(scale + c + 8)), inv);
      const __m256 r0 = _mm256_round_ps(x0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 r1 = _mm256_round_ps(x1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      resid = _mm256_add_ps(resid, _mm256_add_ps(_mm256_sub_ps(x0, r0), _mm256_sub_ps(x1, r1)));
      // packs interleaves 128-bit lanes; the permute restores channel order.
      const __m256i p = _mm256_permute4x64_epi64(
          _mm256_packs_epi32(_mm256_cvtps_epi32(r0), _mm256_cvtps_epi32(r1)), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + c), p);
    }
    cst[r] += mid * a[r] * HSum(resid);
  }
}

// Integer key scores of tokens [row, row + n) of one block. Lines
// [pf, pf + 64 * pf_lines) (the next page's share) are requested a few per
// token: issued in one burst they filled the line-fill buffers and stalled
// the pipeline on the prefetches (measured: kivi4 -16% at llama 32k).
template <int R, int kBits, int D>
HWY_NOINLINE void KiviKeyScores(const KvStream& s, const uint8_t* page, int row, int n,
                                const float* a, const float* cst, Scratch& sc,
                                float* HWY_RESTRICT S, const uint8_t* pf = nullptr,
                                size_t pf_lines = 0) {
  constexpr int NV = D / 16;
  const SideLayout& K = s.layout().key;
  int32_t* ipart = sc.ipart.data();
  const int16_t* qi = sc.qi.data();
  SpreadPrefetch next_lines(pf, pf_lines, n);
#if KVQ_X86_AVX3
  // 32 channels per vpmaddwd (AVX3_DL: vpdpwssd, the add included): half
  // the multiply-adds and adds of AVX2.
  constexpr int NW = D / 32;
  int t0 = 0;
#if KVQ_X86_VNNI
  if constexpr (kBits == 2 || kBits == 4) {
    t0 = KiviKeyScoresLanes<R, kBits, D>(K, page, row, n, a, cst, sc.qb.data(), S, next_lines);
  }
#endif
  if constexpr (R == 4) {
    // 4 tokens x 4 rows at a time: their 16 sums reduce in one tree of
    // unpacks and block shuffles to one vector, lanes [token][row], instead
    // of a half-vector store per (token, row) and a transpose later.
    const __m512 va = _mm512_castps128_ps512(_mm_loadu_ps(a));
    const __m512 vas = _mm512_shuffle_f32x4(va, va, 0);
    const __m512 vcs = _mm512_shuffle_f32x4(_mm512_castps128_ps512(_mm_loadu_ps(cst)),
                                            _mm512_castps128_ps512(_mm_loadu_ps(cst)), 0);
    // Lanes [token][row] -> [row][token].
    const __m512i to_rows =
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; t0 + 4 <= n; t0 += 4) {
      __m512i v[4];
      for (int k = 0; k < 4; ++k) {
        next_lines.Step();
        const uint8_t* rowp = PageLayout::CodeRow(page, K, row + t0 + k);
        __m512i codes[NW];
#pragma GCC unroll 8
        for (int j = 0; j < NW; ++j) codes[j] = Widen32<kBits, D>(rowp, j);
        __m512i acc[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {
          const int16_t* qr = qi + r * D;
          __m512i s0 = _mm512_madd_epi16(codes[0], _mm512_loadu_si512(qr));
#pragma GCC unroll 8
          for (int j = 1; j < NW; ++j) {
#if KVQ_X86_VNNI
            s0 = _mm512_dpwssd_epi32(s0, codes[j], _mm512_loadu_si512(qr + 32 * j));
#else
            s0 = _mm512_add_epi32(s0, _mm512_madd_epi16(codes[j], _mm512_loadu_si512(qr + 32 * j)));
#endif
          }
          acc[r] = s0;
        }
        // Per 128-bit block: [r0 r1 r2 r3] partial sums.
        const __m512i p01 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[0], acc[1]),
                                             _mm512_unpackhi_epi32(acc[0], acc[1]));
        const __m512i p23 = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2], acc[3]),
                                             _mm512_unpackhi_epi32(acc[2], acc[3]));
        v[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(p01, p23), _mm512_unpackhi_epi64(p01, p23));
      }
      // Sum the 4 blocks of each token: block k of w is token k's rows.
      const __m512i u01 = _mm512_add_epi32(_mm512_shuffle_i32x4(v[0], v[1], 0x44),
                                           _mm512_shuffle_i32x4(v[0], v[1], 0xEE));
      const __m512i u23 = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2], v[3], 0x44),
                                           _mm512_shuffle_i32x4(v[2], v[3], 0xEE));
      const __m512i w = _mm512_add_epi32(_mm512_shuffle_i32x4(u01, u23, 0x88),
                                         _mm512_shuffle_i32x4(u01, u23, 0xDD));
      const __m512 sc4 =
          _mm512_permutexvar_ps(to_rows, _mm512_fmadd_ps(_mm512_cvtepi32_ps(w), vas, vcs));
      _mm_storeu_ps(S + 0 * kSLd + t0, _mm512_castps512_ps128(sc4));
      _mm_storeu_ps(S + 1 * kSLd + t0, _mm512_extractf32x4_ps(sc4, 1));
      _mm_storeu_ps(S + 2 * kSLd + t0, _mm512_extractf32x4_ps(sc4, 2));
      _mm_storeu_ps(S + 3 * kSLd + t0, _mm512_extractf32x4_ps(sc4, 3));
    }
  }
  for (int t = t0; t < n; ++t) {
    next_lines.Step();
    const uint8_t* rowp = PageLayout::CodeRow(page, K, row + t);
    __m512i codes[NW];
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j) codes[j] = Widen32<kBits, D>(rowp, j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int16_t* qr = qi + r * D;
#if KVQ_X86_VNNI
      __m512i s0 = _mm512_madd_epi16(codes[0], _mm512_loadu_si512(qr));
#pragma GCC unroll 8
      for (int j = 1; j < NW; ++j) s0 = _mm512_dpwssd_epi32(s0, codes[j], _mm512_loadu_si512(qr + 32 * j));
#else
      __m512i s0 = _mm512_madd_epi16(codes[0], _mm512_loadu_si512(qr));
#pragma GCC unroll 8
      for (int j = 1; j < NW; ++j) {
        s0 = _mm512_add_epi32(s0, _mm512_madd_epi16(codes[j], _mm512_loadu_si512(qr + 32 * j)));
      }
#endif
      const __m256i h =
          _mm256_add_epi32(_mm512_castsi512_si256(s0), _mm512_extracti64x4_epi64(s0, 1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ipart + (t * R + r) * 8), h);
    }
  }
#else
  const int t0 = 0;
  for (int t = 0; t < n; ++t) {
    next_lines.Step();
    const uint8_t* rowp = PageLayout::CodeRow(page, K, row + t);
    __m256i codes[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) codes[j] = WidenChunk<kBits, D>(rowp, j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i* qv = reinterpret_cast<const __m256i*>(qi + r * D);
      __m256i s0 = _mm256_madd_epi16(codes[0], _mm256_loadu_si256(qv));
      __m256i s1 = _mm256_madd_epi16(codes[1], _mm256_loadu_si256(qv + 1));
#pragma GCC unroll 16
      for (int j = 2; j < NV; j += 2) {
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(codes[j], _mm256_loadu_si256(qv + j)));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(codes[j + 1], _mm256_loadu_si256(qv + j + 1)));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ipart + (t * R + r) * 8), _mm256_add_epi32(s0, s1));
    }
  }
#endif
  int t = t0;
  for (; t + 8 <= n; t += 8) {
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_cvtepi32_ps(TransposeSum8(ipart + (t * R + r) * 8, R * 8));
      _mm256_storeu_ps(S + r * kSLd + t, _mm256_fmadd_ps(v, _mm256_set1_ps(a[r]), _mm256_set1_ps(cst[r])));
    }
  }
  for (; t < n; ++t) {
    for (int r = 0; r < R; ++r) {
      const int32_t* p = ipart + (t * R + r) * 8;
      int32_t sum = 0;
      for (int i = 0; i < 8; ++i) sum += p[i];
      S[r * kSLd + t] = static_cast<float>(sum) * a[r] + cst[r];
    }
  }
}

// Codes of channels [c0, c0 + 8) of one row as floats (c0 a multiple of 8),
// straight from the bit planes: bytes c0 mod P .. +8 zero-extended to int32,
// shifted right by (c0 / P) * b and masked.
template <int kBits, int D>
HWY_INLINE __m256 CodesToFloat8(const uint8_t* HWY_RESTRICT row, int c0) {
  auto zx = [](const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  };
  __m256i v;
  if constexpr (kBits == 8) {
    v = zx(row + c0);
  } else if constexpr (kBits == 4) {
    constexpr int P = D / 2;
    v = c0 < P ? _mm256_and_si256(zx(row + c0), _mm256_set1_epi32(0x0F))
               : _mm256_srli_epi32(zx(row + c0 - P), 4);
  } else {
    constexpr int P = D / 4;
    v = _mm256_and_si256(_mm256_srl_epi32(zx(row + c0 % P), _mm_cvtsi32_si128(2 * (c0 / P))),
                         _mm256_set1_epi32(0x03));
    if constexpr (kBits == 3) {
      constexpr int P1 = D / 8;
      const __m256i h = _mm256_and_si256(
          _mm256_srl_epi32(zx(row + P + c0 % P1), _mm_cvtsi32_si128(c0 / P1)), _mm256_set1_epi32(0x01));
      v = _mm256_or_si256(v, _mm256_slli_epi32(h, 2));
    }
  }
  return _mm256_cvtepi32_ps(v);
}

// Channels [16j, 16j + 16) of a code row as floats, in x[0] (the first 8)
// and x[1]. 3-bit codes unpack their two bit planes once in 16-bit lanes
// (WidenChunk) and then widen; two CodesToFloat8 would unpack each plane
// twice over 8 lanes (18 instructions against 13 per 16 codes). The other
// widths are as cheap either way.
template <int kBits, int D>
HWY_INLINE void CodesToFloat16(const uint8_t* HWY_RESTRICT row, int j, __m256* x) {
  if constexpr (kBits == 3) {
    const __m256i w = WidenChunk<kBits, D>(row, j);
    x[0] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w)));
    x[1] = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(w, 1)));
  } else {
    x[0] = CodesToFloat8<kBits, D>(row, 16 * j);
    x[1] = CodesToFloat8<kBits, D>(row, 16 * j + 8);
  }
}

// nuq: the levels of channels [c0, c0 + 8) for the codes of one row, exact:
// a tree of blends on the code bits (each bit shifted into the sign, which is
// all vblendvps reads) over rows[k][c], level k of every channel.
template <int kBits, int D>
HWY_INLINE __m256 NuqLevels8(const uint8_t* HWY_RESTRICT row, int c0, const float* HWY_RESTRICT rows) {
  static_assert(kBits == 2 || kBits == 3, "blends cover up to 8 levels");
  auto zx = [](const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  };
  constexpr int P = D / 4;
  __m256i v = _mm256_srl_epi32(zx(row + c0 % P), _mm_cvtsi32_si128(2 * (c0 / P)));
  if constexpr (kBits == 3) {
    constexpr int P1 = D / 8;
    const __m256i h = _mm256_srl_epi32(zx(row + P + c0 % P1), _mm_cvtsi32_si128(c0 / P1));
    v = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0x03)), _mm256_slli_epi32(h, 2));
  }
  const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 31));
  const __m256 b1 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 30));
  const float* r = rows + c0;
  auto pick4 = [&](const float* q) {
    const __m256 lo = _mm256_blendv_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(q + D), b0);
    const __m256 hi = _mm256_blendv_ps(_mm256_loadu_ps(q + 2 * D), _mm256_loadu_ps(q + 3 * D), b0);
    return _mm256_blendv_ps(lo, hi, b1);
  };
  if constexpr (kBits == 2) {
    return pick4(r);
  } else {
    const __m256 b2 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 29));
    return _mm256_blendv_ps(pick4(r), pick4(r + 4 * D), b2);
  }
}

#if KVQ_X86_AVX3
// Channels [16j, 16j + 16) of a code row as 16 floats (one zmm): the bytes
// unpacked straight to int32, as CodesToFloat8 does for 8. (Widening
// WidenChunk's int16 lanes once more, one shuffle more per 16 codes, measured
// 1-3% slower at llama 32k.)
template <int kBits, int D>
HWY_INLINE __m512 CodesToFloat16x(const uint8_t* HWY_RESTRICT row, int j) {
  const int c0 = 16 * j;
  auto zx = [](const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  __m512i v;
  if constexpr (kBits == 8) {
    v = zx(row + c0);
  } else if constexpr (kBits == 4) {
    constexpr int P = D / 2;
    v = c0 < P ? _mm512_and_si512(zx(row + c0), _mm512_set1_epi32(0x0F))
               : _mm512_srli_epi32(zx(row + c0 - P), 4);
  } else if constexpr (kBits == 2) {
    constexpr int P = D / 4;
    v = _mm512_and_si512(_mm512_srl_epi32(zx(row + c0 % P), _mm_cvtsi32_si128(2 * (c0 / P))),
                         _mm512_set1_epi32(0x03));
  } else {  // 3 bits: two planes, unpacked once in 16-bit lanes.
    v = _mm512_cvtepi16_epi32(WidenChunk<kBits, D>(row, j));
  }
  return _mm512_cvtepi32_ps(v);
}

// nuq: the levels of channels [16j, 16j + 16) for the codes of one row, as
// NuqLevels8 picks them, with mask blends (one uop each, where vblendvps
// takes several).
template <int kBits, int D>
HWY_INLINE __m512 NuqLevels16(const uint8_t* HWY_RESTRICT row, int j,
                              const float* HWY_RESTRICT rows) {
  static_assert(kBits == 2 || kBits == 3, "blends cover up to 8 levels");
  const int c0 = 16 * j;
  __m512i v;
  if constexpr (kBits == 2) {
    constexpr int P = D / 4;
    v = _mm512_srl_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c0 % P))),
        _mm_cvtsi32_si128(2 * (c0 / P)));
  } else {
    v = _mm512_cvtepi16_epi32(WidenChunk<kBits, D>(row, j));
  }
  const __mmask16 b0 = _mm512_test_epi32_mask(v, _mm512_set1_epi32(1));
  const __mmask16 b1 = _mm512_test_epi32_mask(v, _mm512_set1_epi32(2));
  const float* r = rows + c0;
  auto pick4 = [&](const float* q) {
    const __m512 lo = _mm512_mask_blend_ps(b0, _mm512_loadu_ps(q), _mm512_loadu_ps(q + D));
    const __m512 hi =
        _mm512_mask_blend_ps(b0, _mm512_loadu_ps(q + 2 * D), _mm512_loadu_ps(q + 3 * D));
    return _mm512_mask_blend_ps(b1, lo, hi);
  };
  if constexpr (kBits == 2) {
    return pick4(r);
  } else {
    const __mmask16 b2 = _mm512_test_epi32_mask(v, _mm512_set1_epi32(4));
    return _mm512_mask_blend_ps(b2, pick4(r), pick4(r + 4 * D));
  }
}

#endif

// Keys the integer path does not take (pre_rope, per-token groups, nuq)
// with packed codes, dequantized for the float tile kernel straight from
// the bit planes: one FMA per 8 channels, no unpacked byte row (nuq levels
// picked by NuqLevels8 for per-channel groups of up to 8 levels). (The
// DequantizeRows API stays bit-exact with the reference, multiply then add;
// attention only needs float accuracy.) Sparse outliers are written over
// their codes' values afterwards, before RoPE, as the reference does.
template <int kBits, int D>
HWY_NOINLINE void KiviKeyTileToFloat(const KvStream& s, const uint8_t* page, int row, int m,
                                     Scratch& sc, float* HWY_RESTRICT kb,
                                     const uint8_t* pf = nullptr, size_t pf_lines = 0) {
  const PageLayout& L = s.layout();
  const SideLayout& K = L.key;
  const int g = L.block_tokens;
  float* p = sc.kparams.data();
  SpreadPrefetch next_lines(pf, pf_lines, m);
  if (K.axis == ParamAxis::kChannelGroups) {
    int cur = -1;
    for (int j = 0; j < m; ++j) {
      next_lines.Step();  // The next page's share (see KiviKeyScores).
      if ((row + j) / g != cur) {
        cur = (row + j) / g;
        LoadParams(L, K, page, cur, 1, p);
      }
      const uint8_t* codes = PageLayout::CodeRow(page, K, row + j);
      float* x = kb + static_cast<size_t>(j) * D;
      if constexpr (kBits == 2 || kBits == 3) {
        if (s.spec().nuq) {  // Per-channel levels in [0, 1] of the group's range.
          const float* levels = sc.kctx.level_rows.data();
#if KVQ_X86_AVX3
          for (int c = 0; c < D; c += 16) {
            _mm512_storeu_ps(x + c,
                             _mm512_fmadd_ps(NuqLevels16<kBits, D>(codes, c / 16, levels),
                                             _mm512_loadu_ps(p + c), _mm512_loadu_ps(p + D + c)));
          }
          continue;
#endif
          for (int c = 0; c < D; c += 8) {
            _mm256_storeu_ps(x + c, _mm256_fmadd_ps(NuqLevels8<kBits, D>(codes, c, levels),
                                                    _mm256_loadu_ps(p + c),
                                                    _mm256_loadu_ps(p + D + c)));
          }
          continue;
        }
      }
      for (int c = 0; c < D; c += 16) {
        __m256 v[2];
        CodesToFloat16<kBits, D>(codes, c / 16, v);
        _mm256_storeu_ps(x + c, _mm256_fmadd_ps(v[0], _mm256_loadu_ps(p + c),
                                                _mm256_loadu_ps(p + D + c)));
        _mm256_storeu_ps(x + c + 8, _mm256_fmadd_ps(v[1], _mm256_loadu_ps(p + c + 8),
                                                    _mm256_loadu_ps(p + D + c + 8)));
      }
    }
  } else {
    const int gc = K.group_channels;
    const int ng = D / gc;
    for (int j = 0; j < m; ++j) {
      next_lines.Step();
      LoadParams(L, K, page, row + j, 1, p);
      const uint8_t* codes = PageLayout::CodeRow(page, K, row + j);
      float* x = kb + static_cast<size_t>(j) * D;
      for (int grp = 0; grp < ng; ++grp) {
        const __m256 vs = _mm256_set1_ps(p[grp]), vz = _mm256_set1_ps(p[ng + grp]);
        for (int c = grp * gc; c < (grp + 1) * gc; c += 8) {
          _mm256_storeu_ps(x + c, _mm256_fmadd_ps(CodesToFloat8<kBits, D>(codes, c), vs, vz));
        }
      }
    }
  }
  WriteOutliers(L, K, page, row, m, kb, static_cast<size_t>(L.head_dim));
}

#if KVQ_X86_AVX3
// KiviValueRows with 16-float vectors: 64-channel chunks (4 zmm per row,
// 16 accumulators for 4 rows in the 32 registers), tokens inner; a chunk
// may span several channel groups, each with its own weights and zero sum.
template <int RG, int kBits, int D, bool kNuq>
HWY_INLINE void KiviValueRows512(const uint8_t* HWY_RESTRICT codes0, size_t row_bytes, int n,
                                 int r0, int ng, int gc_shift, int ld, const float* HWY_RESTRICT w,
                                 const float* zsum, const float* HWY_RESTRICT levels,
                                 float* HWY_RESTRICT acc) {
  static_assert(D % 64 == 0, "head_dim 64, 128 or 256");
  for (int c0 = 0; c0 < D; c0 += 64) {
    __m512 a[RG][4];
    const float* wr[RG][4];
    for (int r = 0; r < RG; ++r) {
      for (int k = 0; k < 4; ++k) {
        const int g = (c0 + 16 * k) >> gc_shift;
        a[r][k] = _mm512_add_ps(_mm512_loadu_ps(acc + (r0 + r) * D + c0 + 16 * k),
                                _mm512_set1_ps(zsum[(r0 + r) * ng + g]));
        wr[r][k] = w + (static_cast<size_t>(r0 + r) * ng + g) * ld;
      }
    }
    const uint8_t* p = codes0;
    for (int t = 0; t < n; ++t, p += row_bytes) {
      __m512 x[4];
      for (int k = 0; k < 4; ++k) {
        if constexpr (kNuq) {
          x[k] = NuqLevels16<kBits, D>(p, c0 / 16 + k, levels);
        } else {
          x[k] = CodesToFloat16x<kBits, D>(p, c0 / 16 + k);
        }
      }
      for (int r = 0; r < RG; ++r) {
        for (int k = 0; k < 4; ++k) {
          a[r][k] = _mm512_fmadd_ps(_mm512_set1_ps(wr[r][k][t]), x[k], a[r][k]);
        }
      }
    }
    for (int r = 0; r < RG; ++r) {
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc + (r0 + r) * D + c0 + 16 * k, a[r][k]);
    }
  }
}
#endif

// Rows [r0, r0 + RG) of the value accumulation: 16-channel chunks outer,
// tokens inner, 2*RG float accumulators; the converted codes of a token are
// shared by the RG rows.
template <int RG, int kBits, int D, bool kNuq>
HWY_INLINE void KiviValueRows(const uint8_t* HWY_RESTRICT codes0, size_t row_bytes, int n, int r0,
                              int ng, int gc_shift, int ld, const float* HWY_RESTRICT w,
                              const float* zsum, const float* HWY_RESTRICT levels,
                              float* HWY_RESTRICT acc) {
  for (int j = 0; j < D / 16; ++j) {
    const int c0 = 16 * j;
    const int g = c0 >> gc_shift;
    __m256 a[RG][2];
    const float* wr[RG];
    for (int r = 0; r < RG; ++r) {
      float* ar = acc + (r0 + r) * D + c0;
      const __m256 z = _mm256_set1_ps(zsum[(r0 + r) * ng + g]);
      a[r][0] = _mm256_add_ps(_mm256_loadu_ps(ar), z);
      a[r][1] = _mm256_add_ps(_mm256_loadu_ps(ar + 8), z);
      wr[r] = w + (static_cast<size_t>(r0 + r) * ng + g) * ld;
    }
    const uint8_t* p = codes0;
    for (int t = 0; t < n; ++t, p += row_bytes) {
      __m256 x0, x1;
      if constexpr (kNuq) {
        x0 = NuqLevels8<kBits, D>(p, c0, levels);
        x1 = NuqLevels8<kBits, D>(p, c0 + 8, levels);
      } else {
        __m256 v[2];
        CodesToFloat16<kBits, D>(p, j, v);
        x0 = v[0];
        x1 = v[1];
      }
      for (int r = 0; r < RG; ++r) {
        const __m256 wv = _mm256_broadcast_ss(wr[r] + t);
        a[r][0] = _mm256_fmadd_ps(wv, x0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(wv, x1, a[r][1]);
      }
    }
    for (int r = 0; r < RG; ++r) {
      float* ar = acc + (r0 + r) * D + c0;
      _mm256_storeu_ps(ar, a[r][0]);
      _mm256_storeu_ps(ar + 8, a[r][1]);
    }
  }
}

#if KVQ_X86_VNNI
// Values as integer dot products (AVX3_DL; uniform 2- and 4-bit codes, rows
// of 16, 32 or 64 bytes). With the scales folded into the weights,
// o_c = sum_t w_tg code[t][c]: the weights of a tile are quantized to 15
// bits per (row, group), w ~ step * (256 hi + lo) with both bytes signed
// (lo the low byte, hi = (q + 128) >> 8), and vpdpbusd multiplies the codes
// of 4 tokens (unsigned bytes, 0..15) with one weight byte of each of those
// 4 tokens, broadcast from memory by the instruction itself, and adds: 64
// multiply-adds per instruction where the float path does 16 per FMA after
// converting every code to float. The codes of 4 tokens are interleaved
// once per tile (byte 4j + k = plane byte j of token k, one or two byte
// permutes per 64 bytes); each plane shift of a 16-byte block of that is 16
// consecutive channels, one group.
// step = max_t p s / 32639 per (row, group), so a weight is within step / 2
// of its value: ~1.5e-5 of the largest weight of its row and group in the
// tile. (A bound from max_t p * max_t s instead saved a reduction per row
// and group, but where the largest weight and the largest scale sit on
// different tokens, as in real models, it left far fewer levels: +0.9%
// perplexity for kivi4:pre_rope:sink=4 in kvq-eval --quick.) int32 sums of
// one tile cannot overflow: a code masked in place is at most 240 (15 << 4,
// or 3 << 6), a weight byte at most 128 in magnitude, so 256 hi + lo over 32
// tokens stays within 257 * 32 * 240 * 128 < 2^28.
constexpr bool ValueDotTakes(int bits, int row_bytes) {
  return (bits == 2 || bits == 4) && (row_bytes == 16 || row_bytes == 32 || row_bytes == 64);
}
template <int kBits, int D>
struct ValueDotShape {
  static constexpr int kRowBytes = D * kBits / 8;  // One plane: 2 or 4 bits.
  static constexpr int kBlocks = kRowBytes / 16;   // 16-byte blocks of a row.
  static constexpr bool kOk = ValueDotTakes(kBits, kRowBytes);
};

// Byte-permute indices: Interleave4 of 16-byte rows (vpermb over 64 bytes),
// of 32-byte rows (block h of a vpermt2b over rows 0-1 | rows 2-3), of
// 64-byte rows (vpermt2b pairing two rows' bytes [32i, 32i + 32), then
// vpermt2w pairing the pairs); and the weight bytes' order (WeightBytes).
struct DotIndices {
  alignas(64) uint8_t r16[64];
  alignas(64) uint8_t r32[2][64];
  alignas(64) uint8_t pair[2][64];
  alignas(64) uint16_t quad[2][32];
  alignas(64) uint8_t wbytes[64];
  DotIndices() {
    for (int j = 0; j < 16; ++j) {
      for (int k = 0; k < 4; ++k) {
        r16[4 * j + k] = static_cast<uint8_t>(16 * k + j);
        for (int h = 0; h < 2; ++h) {
          r32[h][4 * j + k] = static_cast<uint8_t>((k >= 2 ? 64 : 0) + 32 * (k % 2) + 16 * h + j);
        }
      }
      for (int h = 0; h < 2; ++h) {
        for (int k = 0; k < 2; ++k) quad[h][2 * j + k] = static_cast<uint16_t>(32 * k + 16 * h + j);
      }
    }
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 32; ++j) {
        for (int k = 0; k < 2; ++k) pair[i][2 * j + k] = static_cast<uint8_t>(64 * k + 32 * i + j);
      }
    }
    // vpackusdw(q[0..15], q[16..31]) puts token t at word 8 (t % 16 / 4) +
    // 4 (t / 16) + t % 4; low bytes of tokens 0..31 from the words of q,
    // then high bytes from the words of q + 128 (the second table).
    for (int t = 0; t < 32; ++t) {
      const int w = 8 * (t % 16 / 4) + 4 * (t / 16) + t % 4;
      wbytes[t] = static_cast<uint8_t>(2 * w);
      wbytes[32 + t] = static_cast<uint8_t>(64 + 2 * w + 1);
    }
  }
};
const DotIndices& Indices() {
  static const DotIndices idx;
  return idx;
}

// Codes of tokens [4i, 4i + 4) (m of them valid, the rest zero) of rows
// `rb` bytes apart, interleaved: out[h] holds plane bytes [16h, 16h + 16).
template <int kRowBytes>
HWY_INLINE void Interleave4(const uint8_t* HWY_RESTRICT rows, int m, __m512i* out) {
  const DotIndices& ix = Indices();
  auto ld = [&](int k) {  // Row k, zero when past the tile.
    return k < m ? _mm512_maskz_loadu_epi8(kRowBytes == 64 ? ~0ULL : (1ULL << kRowBytes) - 1,
                                           rows + k * kRowBytes)
                 : _mm512_setzero_si512();
  };
  if constexpr (kRowBytes == 16) {
    const __mmask64 valid = m >= 4 ? ~0ULL : (1ULL << (16 * m)) - 1;
    out[0] = _mm512_permutexvar_epi8(_mm512_load_si512(ix.r16), _mm512_maskz_loadu_epi8(valid, rows));
  } else if constexpr (kRowBytes == 32) {
    const int b01 = std::min(m, 2) * 32, b23 = std::clamp(m - 2, 0, 2) * 32;
    const __m512i x = _mm512_maskz_loadu_epi8(b01 == 64 ? ~0ULL : (1ULL << b01) - 1, rows);
    const __m512i y = _mm512_maskz_loadu_epi8(b23 == 64 ? ~0ULL : (1ULL << b23) - 1, rows + 64);
    for (int h = 0; h < 2; ++h) {
      out[h] = _mm512_permutex2var_epi8(x, _mm512_load_si512(ix.r32[h]), y);
    }
  } else {
    static_assert(kRowBytes == 64, "16, 32 or 64 bytes");
    const __m512i r0 = ld(0), r1 = ld(1), r2 = ld(2), r3 = ld(3);
    for (int i = 0; i < 2; ++i) {
      const __m512i pi = _mm512_load_si512(ix.pair[i]);
      const __m512i p01 = _mm512_permutex2var_epi8(r0, pi, r1);
      const __m512i p23 = _mm512_permutex2var_epi8(r2, pi, r3);
      for (int h = 0; h < 2; ++h) {
        out[2 * i + h] = _mm512_permutex2var_epi16(p01, _mm512_load_si512(ix.quad[h]), p23);
      }
    }
  }
}

// acc[r] += sum_t P[r][t] v_t for tokens [0, n) of the tile whose code rows
// start at codes0 (n <= kTile); vs, vz: scales and zeros [ng][ld].
constexpr float kWeightMax = 32639.0f;  // Splits into two signed bytes.

template <int R, int kBits, int D>
HWY_INLINE void KiviValueDot(const uint8_t* HWY_RESTRICT codes0, int n, int ng, int gc_shift,
                             int ld, const float* HWY_RESTRICT vs, const float* HWY_RESTRICT vz,
                             const float* HWY_RESTRICT P, Scratch& sc, float* HWY_RESTRICT acc,
                             const uint8_t* pf, size_t pf_lines) {
  using Shape = ValueDotShape<kBits, D>;
  constexpr int RB = Shape::kRowBytes;
  constexpr int H = Shape::kBlocks;
  const int groups4 = (n + 3) / 4;
  // Half of the next page's lines given to this kernel go out now, ahead
  // of the weights (which read nothing from memory), the rest spread over
  // the dot loop (see KiviSegment).
  const size_t pf_burst = pf_lines / 2;
  PrefetchLines(pf, pf_burst);
  pf += 64 * pf_burst;
  pf_lines -= pf_burst;
  uint8_t* ibuf = sc.vcodes.data();
  for (int i = 0; i < groups4; ++i) {
    __m512i blk[H];
    Interleave4<RB>(codes0 + static_cast<size_t>(4 * i) * RB, n - 4 * i, blk);
    for (int h = 0; h < H; ++h) _mm512_storeu_si512(ibuf + (i * H + h) * 64, blk[h]);
  }
  // Weights: 15 bits per (row, group) against that row and group's largest,
  // q in [0, 32639], split into two signed bytes as the key query is
  // (KiviKeyScoresLanes): low byte, and (q + 128) >> 8. Signed, both are the
  // operand vpdpbusd broadcasts from memory itself, with the codes the
  // unsigned one. The zero term sum_t p z of each (row, group) in the same
  // pass.
  const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
  const __m512i wperm = _mm512_load_si512(Indices().wbytes);
  uint8_t* wq = sc.wq.data();
  float* wstep = sc.wstep.data();
  float* zsum = sc.zsum.data();
  // (row, group) pairs four at a time: their sums and maxima reduce in one
  // tree each (ReduceRows4), the steps in one division.
  const int pairs = R * ng;
  // The rows' weights past n (stale scores) zeroed once per row, so the
  // pairs below load plain vectors: a masked load costs an extra vector uop.
  // Scales and zeros past n are finite (zeroed or an earlier tile's), so
  // their products with a zero weight are zero.
  float* pz = sc.wf.data();  // [R][32]; wf itself serves only the float value path.
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(pz + 32 * r, _mm512_maskz_loadu_ps(m0, P + r * kSLd));
    _mm512_storeu_ps(pz + 32 * r + 16, _mm512_maskz_loadu_ps(m1, P + r * kSLd + 16));
  }
  const auto max_op = [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); };
  const auto add_op = [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); };
  for (int c0 = 0; c0 < pairs; c0 += 4) {
    __m512 w[4][2], zt[4], top[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const int c = std::min(c0 + k, pairs - 1);  // Past the end: a repeat, unused.
      const float* pr = pz + 32 * (c / ng);
      const int g = c % ng;
      const __m512 p0 = _mm512_loadu_ps(pr), p1 = _mm512_loadu_ps(pr + 16);
      const float* zg = vz + g * ld;
      zt[k] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(zg), _mm512_mul_ps(p1, _mm512_loadu_ps(zg + 16)));
      const float* sg = vs + g * ld;
      w[k][0] = _mm512_mul_ps(p0, _mm512_loadu_ps(sg));
      w[k][1] = _mm512_mul_ps(p1, _mm512_loadu_ps(sg + 16));
      top[k] = _mm512_max_ps(w[k][0], w[k][1]);
    }
    const __m128 zs4 = ReduceRows4(zt, add_op);
    const __m128 top4 = ReduceRows4(top, max_op);
    // A pair with no weight (top 0) gets step 0 and factor 0: zero bytes.
    const __mmask8 live = _mm_cmp_ps_mask(top4, _mm_setzero_ps(), _CMP_GT_OQ);
    alignas(16) float f4[4], st4[4], z4[4];
    _mm_store_ps(f4, _mm_maskz_div_ps(live, _mm_set1_ps(kWeightMax), top4));
    _mm_store_ps(st4, _mm_maskz_div_ps(live, top4, _mm_set1_ps(kWeightMax)));
    _mm_store_ps(z4, zs4);
    const int nk = std::min(4, pairs - c0);
    for (int k = 0; k < nk; ++k) {
      const int c = c0 + k;
      zsum[c] = z4[k];
      wstep[c] = st4[k];
      const __m512 f = _mm512_set1_ps(f4[k]);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(w[k][0], f));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(w[k][1], f));
      const __m512i half = _mm512_set1_epi32(128);
      _mm512_storeu_si512(wq + c * 64, _mm512_permutex2var_epi8(
                                          _mm512_packus_epi32(q0, q1), wperm,
                                          _mm512_packus_epi32(_mm512_add_epi32(q0, half),
                                                              _mm512_add_epi32(q1, half))));
    }
  }
  // Two 16-channel chunks per pass, RG rows at a time; the next page's
  // lines left to this loop go out a few per step, as in the key loop.
  constexpr int RG = R < 4 ? R : 4;
  SpreadPrefetch next_lines(pf, pf_lines, static_cast<size_t>(D / 32 * groups4));
  // A chunk's codes are masked in place, not shifted down: the products
  // come out 2^shift times too large, and the step that scales the chunk's
  // int32 sums takes the factor out (the sums stay below 2^28, see
  // ValueDotTakes, and their float conversion rounds by at most 2^-24).
  for (int j0 = 0; j0 < D / 16; j0 += 2) {
    int hh[2], gg[2];
    __m512i cmask[2];
    float unscale[2];  // 2^-shift: what the chunk's masked codes are scaled by.
    for (int k = 0; k < 2; ++k) {
      const int c0 = 16 * (j0 + k);
      const int sh = kBits * (c0 / RB);
      hh[k] = (c0 % RB) / 16;
      gg[k] = c0 >> gc_shift;
      cmask[k] = _mm512_set1_epi8(static_cast<char>(((1 << kBits) - 1) << sh));
      unscale[k] = 1.0f / static_cast<float>(1 << sh);
    }
    for (int r0 = 0; r0 < R; r0 += RG) {
      __m512i lo[RG][2], hi[RG][2];
      for (int r = 0; r < RG; ++r) {
        for (int k = 0; k < 2; ++k) lo[r][k] = hi[r][k] = _mm512_setzero_si512();
      }
      const uint8_t* w0 = wq + ((r0)*ng + gg[0]) * 64;
      const uint8_t* w1 = wq + ((r0)*ng + gg[1]) * 64;
      // Both chunks in one channel group (groups of >= 32 channels): they
      // share every weight dword, so each is broadcast once into a register
      // (a load-port uop alone) for both multiply-adds instead of being
      // loaded by each.
      const auto quads = [&](auto shared) {
        for (int i = 0; i < groups4; ++i) {
          if (r0 == 0) next_lines.Step();
          __m512i x[2];
          for (int k = 0; k < 2; ++k) {
            x[k] = _mm512_and_si512(_mm512_loadu_si512(ibuf + (i * H + hh[k]) * 64), cmask[k]);
          }
          for (int r = 0; r < RG; ++r) {
            const uint8_t* wr[2] = {w0 + r * ng * 64, w1 + r * ng * 64};
            if constexpr (decltype(shared)::value) {
              int32_t wl, wh;
              std::memcpy(&wl, wr[0] + 4 * i, 4);
              std::memcpy(&wh, wr[0] + 32 + 4 * i, 4);
              const __m512i bl = _mm512_set1_epi32(wl), bh = _mm512_set1_epi32(wh);
              for (int k = 0; k < 2; ++k) {
                lo[r][k] = _mm512_dpbusd_epi32(lo[r][k], x[k], bl);
                hi[r][k] = _mm512_dpbusd_epi32(hi[r][k], x[k], bh);
              }
            } else {
              for (int k = 0; k < 2; ++k) {
                lo[r][k] = DotBroadcast(lo[r][k], x[k], wr[k] + 4 * i);
                hi[r][k] = DotBroadcast(hi[r][k], x[k], wr[k] + 32 + 4 * i);
              }
            }
          }
        }
      };
      if (gg[0] == gg[1]) {
        quads(std::true_type{});
      } else {
        quads(std::false_type{});
      }
      for (int r = 0; r < RG; ++r) {
        const int row = r0 + r;
        for (int k = 0; k < 2; ++k) {
          float* a = acc + row * D + 16 * (j0 + k);
          const __m512 v = _mm512_cvtepi32_ps(
              _mm512_add_epi32(_mm512_slli_epi32(hi[r][k], 8), lo[r][k]));
          const __m512 base = _mm512_add_ps(_mm512_loadu_ps(a), _mm512_set1_ps(zsum[row * ng + gg[k]]));
          const float step = wstep[row * ng + gg[k]] * unscale[k];
          _mm512_storeu_ps(a, _mm512_fmadd_ps(v, _mm512_set1_ps(step), base));
        }
      }
    }
  }
}
#endif

// acc[r] += sum_t P[r][t] v_t over tokens [row, row + n) of a page with
// per-token groups: the scales fold into the weights (w = p * s per group)
// and the zero points into one float per (row, group), so the codes only
// need converting to float once per token for all rows.
template <int R, int kBits, int D>
HWY_NOINLINE void KiviValueAccumulate(const KvStream& s, const uint8_t* page, int row, int n,
                                    const float* HWY_RESTRICT P, Scratch& sc,
                                    float* HWY_RESTRICT acc, const uint8_t* pf = nullptr,
                                    size_t pf_lines = 0) {
  const PageLayout& L = s.layout();
  const SideLayout& V = L.value;
  const int gc = V.group_channels;
  const int ng = D / gc;
  const int ld = kValueParamsLd;
  float* vs = sc.vparams.data();                  // [ng][ld] scales
  float* vz = vs + static_cast<size_t>(ng) * ld;  // [ng][ld] zeros
  // The tile's parameters are contiguous, [t][scale[ng], zero[ng]]: convert
  // them at once, then transpose to per-group rows over tokens (an 8x8
  // transpose per 8 tokens when 2 * ng == 8, the common case).
  float* flat = sc.vbuf.data();
  const int np = 2 * ng;
  const int npad = (n + 7) / 8 * 8;
  if (V.param_bits == 8) {
    // p8: the tile lies in one block (tiles never cross one), so one header;
    // the codes of its rows are contiguous, [t][group], and decode straight
    // into the per-group rows (exact products, as LoadGroupParams).
    const int pb = L.block_tokens;
    const uint8_t* blk = L.ParamBlock(page, V, row / pb);
    const Params8Steps h = ReadParams8Steps(blk);
    const __m256 ss = _mm256_set1_ps(h.scale_step);
    const __m256 zb = _mm256_set1_ps(h.zero_base);
    const __m256 zs = _mm256_set1_ps(h.zero_step);
    const uint8_t* sc8 = blk + kParams8HeaderBytes + static_cast<size_t>(row % pb) * ng;
    const uint8_t* zc8 = sc8 + static_cast<size_t>(pb) * ng;
    alignas(32) uint8_t su[kTile + 8], zu[kTile + 8];
    for (int g = 0; g < ng; ++g) {
      for (int t = 0; t < npad; ++t) {
        su[t] = t < n ? sc8[t * ng + g] : 0;
        zu[t] = t < n ? zc8[t * ng + g] : 0;
      }
      for (int t = 0; t < npad; t += 8) {
        const __m256 sv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(su + t))));
        const __m256 zv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(zu + t))));
        _mm256_storeu_ps(vs + g * ld + t, _mm256_mul_ps(sv, ss));
        _mm256_storeu_ps(vz + g * ld + t, _mm256_add_ps(zb, _mm256_mul_ps(zv, zs)));
      }
      for (int t = n; t < npad; ++t) vs[g * ld + t] = vz[g * ld + t] = 0.0f;  // As fp16's.
    }
  } else {
    LoadParams(L, V, page, row, n, flat);
    for (int i = n * np; i < npad * np; ++i) flat[i] = 0.0f;
    if (np == 8) {
      for (int t = 0; t < npad; t += 8) {
        const float* f = flat + t * 8;
        const __m256 r0 = _mm256_loadu_ps(f), r1 = _mm256_loadu_ps(f + 8);
        const __m256 r2 = _mm256_loadu_ps(f + 16), r3 = _mm256_loadu_ps(f + 24);
        const __m256 r4 = _mm256_loadu_ps(f + 32), r5 = _mm256_loadu_ps(f + 40);
        const __m256 r6 = _mm256_loadu_ps(f + 48), r7 = _mm256_loadu_ps(f + 56);
        const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
        const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
        const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
        const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        // Row k of the transpose: parameter k of tokens t .. t+7 (0-3 scales, 4-7 zeros).
        _mm256_storeu_ps(vs + 0 * ld + t, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_storeu_ps(vs + 1 * ld + t, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_storeu_ps(vs + 2 * ld + t, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_storeu_ps(vs + 3 * ld + t, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_storeu_ps(vz + 0 * ld + t, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_storeu_ps(vz + 1 * ld + t, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_storeu_ps(vz + 2 * ld + t, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_storeu_ps(vz + 3 * ld + t, _mm256_permute2f128_ps(u3, u7, 0x31));
      }
    } else {
      for (int t = 0; t < npad; ++t) {
        for (int g = 0; g < ng; ++g) {
          vs[g * ld + t] = flat[t * np + g];
          vz[g * ld + t] = flat[t * np + ng + g];
        }
      }
    }
  }
  // w[r][g][t] = p * s; the zero term per (row, group) is sum_t p z.
  float* w = sc.wf.data();
  float* zsum = sc.zsum.data();
  const uint8_t* codes0 = PageLayout::CodeRow(page, V, row);
  int gc_shift = 0;
  while ((1 << gc_shift) < gc) ++gc_shift;  // group_channels is a power of two.
#if KVQ_X86_VNNI
  if constexpr (ValueDotShape<kBits, D>::kOk) {
    if (!s.spec().nuq) {
      KiviValueDot<R, kBits, D>(codes0, n, ng, gc_shift, ld, vs, vz, P, sc, acc, pf, pf_lines);
      return;
    }
  }
#endif
  for (int r = 0; r < R; ++r) {
    const float* pr = P + r * kSLd;
    for (int g = 0; g < ng; ++g) {
      float* wrg = w + (static_cast<size_t>(r) * ng + g) * ld;
      __m256 vzs = _mm256_setzero_ps();
      for (int t = 0; t < npad; t += 8) {
        const __m256 pv = _mm256_loadu_ps(pr + t);
        _mm256_storeu_ps(wrg + t, _mm256_mul_ps(pv, _mm256_loadu_ps(vs + g * ld + t)));
        vzs = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vz + g * ld + t), vzs);
      }
      zsum[r * ng + g] = HSum(vzs);
    }
  }
  constexpr int RG = R < 4 ? R : 4;  // 8 accumulators + 2 codes + 1 weight.
  for (int r0 = 0; r0 < R; r0 += RG) {
    if constexpr (kBits == 2 || kBits == 3) {
      if (s.spec().nuq) {
#if KVQ_X86_AVX3
        KiviValueRows512<RG, kBits, D, true>(codes0, V.code_row_bytes, n, r0, ng, gc_shift, ld, w,
                                             zsum, sc.vctx.level_rows.data(), acc);
#else
        KiviValueRows<RG, kBits, D, true>(codes0, V.code_row_bytes, n, r0, ng, gc_shift, ld, w, zsum,
                                          sc.vctx.level_rows.data(), acc);
#endif
        continue;
      }
    }
#if KVQ_X86_AVX3
    KiviValueRows512<RG, kBits, D, false>(codes0, V.code_row_bytes, n, r0, ng, gc_shift, ld, w,
                                          zsum, nullptr, acc);
#else
    KiviValueRows<RG, kBits, D, false>(codes0, V.code_row_bytes, n, r0, ng, gc_shift, ld, w, zsum,
                                       nullptr, acc);
#endif
  }
}

#endif  // KVQ_X86_AVX2

// ---------------------------------------------------------------------------
// One pass over the key range for R rows.

template <int R>
class RowPass {
 public:
  RowPass(const KvStream& s, const float* q, const int32_t* visible_end, Scratch& sc,
          const PageCheck* page_check)
      : s_(s), d_(s.head_dim()), q_(q), vis_(visible_end), sc_(sc), rope_(s.rope()),
        page_check_(page_check) {
    for (int r = 0; r < R; ++r) {
      st_.m[r] = kNegInf;
      st_.l[r] = 0.0f;
      std::fill(st_.lanes[r], st_.lanes[r] + 16, 0.0f);
    }
    std::fill(sc_.acc.begin(), sc_.acc.begin() + R * d_, 0.0f);
    if (rope_) {
      PrepareRopeTables(*rope_, sc_.rope);
      base_.rope = rope_;
    }
    sc_.kctx.Init(s, Side::kKey);
    sc_.vctx.Init(s, Side::kValue);
#if KVQ_X86_AVX2
    fast_ = ChooseFastSides(s);
#if KVQ_X86_VNNI
    value_dot_ = fast_.value && !s.spec().nuq &&
                 ValueDotTakes(s.layout().value.bits, static_cast<int>(s.layout().value.code_row_bytes));
#endif
    outliers_ = s.layout().outliers_per_block > 0;
    // Packed key codes whose groups are 8-channel aligned (head_dim
    // 64/128/256 and groups of >= 8 channels), uniform or, per channel,
    // nuq with up to 8 levels: KiviKeyTileToFloat.
    {
      const SideLayout& K = s.layout().key;
      const int d = s.head_dim();
      const bool nuq_ok = !s.spec().nuq || (K.bits <= 3 && K.axis == ParamAxis::kChannelGroups);
      plain_key_codes_ = K.format == CodeFormat::kPacked && nuq_ok &&
                         (d == 64 || d == 128 || d == 256) &&
                         (K.axis == ParamAxis::kChannelGroups ||
                          (K.axis == ParamAxis::kTokenGroups && K.group_channels % 8 == 0));
    }
#endif
  }

  void Run(int begin, int end) {
    int vmax = 0;
    for (int r = 0; r < R; ++r) vmax = std::max(vmax, vis_[r]);
    end = std::min(end, vmax);
    int t = begin;
    const int sink_end = std::min(end, s_.sink_tokens());
    while (t < sink_end) {
      const int n = std::min(kTile, sink_end - t);
      Fp16Tile(s_.sink_row(Side::kKey, t), s_.sink_row(Side::kValue, t), n, t);
      t += n;
    }
    const int base = s_.page_base();
    const int qend = std::min(end, base + s_.quantized_tokens());
    const int pt = s_.layout().page_tokens;
    while (t < qend) {
      const int u = t - base;
      const int row = u % pt;
      const int n = std::min(qend - t, pt - row);
      next_page_ = t + n < qend ? s_.page(u / pt + 1) : nullptr;
      if (page_check_ != nullptr) page_check_->Check(s_, u / pt);
      PageSegment(s_.page(u / pt), row, n, t);
      t += n;
    }
    while (t < end) {
      const int i = t - base - s_.quantized_tokens();
      const int n = std::min(kTile, end - t);
      Fp16Tile(s_.tail_row(Side::kKey, i), s_.tail_row(Side::kValue, i), n, t);
      t += n;
    }
  }

  void Finish(float* out, float* lse) {
    const DF df;
    const int N = static_cast<int>(hn::Lanes(df));
    for (int r = 0; r < R; ++r) {
      float* o = out + static_cast<size_t>(r) * d_;
      for (float x : st_.lanes[r]) st_.l[r] += x;
      if (!(st_.l[r] > 0.0f)) {
        std::fill(o, o + d_, 0.0f);
        lse[r] = kNegInf;
        continue;
      }
      const VF inv = hn::Set(df, 1.0f / st_.l[r]);
      const float* a = sc_.acc.data() + r * d_;
      for (int c = 0; c < d_; c += N) hn::StoreU(hn::Mul(hn::LoadU(df, a + c), inv), df, o + c);
      lse[r] = st_.m[r] + std::log(st_.l[r]);
    }
  }

 private:
  // Requests the value rows (codes, per-token parameters) of tile rows
  // [row, row + m) and the key rows of the next tile (often in another page:
  // the hardware prefetcher restarts at every 4 KiB) while the keys of this
  // tile dequantize. fp16 / bf16 pages request the next tile's rows into
  // L2 from the tile loops instead (PrefetchRowsToL2).
  void PrefetchTile(const uint8_t* page, int row, int m, int n_left) {
    const PageLayout& L = s_.layout();
    auto lines = [](const void* p, size_t bytes) {
      const char* c = static_cast<const char*>(p);
      for (size_t i = 0; i < bytes; i += 64) hwy::Prefetch(c + i);
    };
    lines(PageLayout::CodeRow(page, L.value, row), L.value.code_row_bytes * m);
    if (L.value.axis == ParamAxis::kTokenGroups && L.value.param_bits == 16) {
      lines(L.Params(page, L.value, row), sizeof(uint16_t) * 2 * L.ParamsPerEntry(L.value) * m);
    } else if (L.value.axis == ParamAxis::kTokenGroups) {
      lines(L.ParamBlock(page, L.value, row / L.block_tokens), L.ParamBlockBytes(L.value));
    }
    if (n_left > m) {
      lines(PageLayout::CodeRow(page, L.key, row + m), L.key.code_row_bytes * std::min(kTile, n_left - m));
    } else if (next_page_ != nullptr) {
      lines(PageLayout::CodeRow(next_page_, L.key, 0), L.key.code_row_bytes * kTile);
    }
  }

  // A kivi page is read in four places (key codes, value codes, their
  // parameters) and every page is a separate allocation: the hardware
  // prefetcher restarts at each, and each cold section stalled a tile (a
  // profile put ~15% of the value kernel on its first parameter load).
  // While rows [row, row + m) of a page are processed, the same share of the
  // next page's bytes is requested, so the whole next page is on its way one
  // page ahead.
  void PrefetchNextPage(int row, int m) {
    const auto [p, lines] = NextPageShare(row, m);
    PrefetchLines(p, lines);
  }
  // The lines of the next page that go with rows [row, row + m).
  std::pair<const uint8_t*, size_t> NextPageShare(int row, int m) const {
    if (next_page_ == nullptr) return {nullptr, 0};
    const PageLayout& L = s_.layout();
    const size_t lines = (L.page_bytes + 63) / 64;
    const size_t pt = static_cast<size_t>(L.page_tokens);
    const size_t a = lines * static_cast<size_t>(row) / pt;
    const size_t b = lines * static_cast<size_t>(row + m) / pt;
    return {next_page_ + 64 * a, b - a};
  }

  // The query rows to score keys of a tile starting at t0 against.
  const float* TileQueries(int t0) {
    if (!rope_) return q_;
    base_.MoveTo(t0, sc_.rope, sc_);
    RotateQueries(*rope_, sc_, R, q_, d_, sc_.qrot.data());
    return sc_.qrot.data();
  }

  // A tile of n 16-bit key and value rows, `stride` elements apart, scored
  // against the queries as they are (no RoPE to apply); k_ahead / v_ahead:
  // the next tile's rows, requested into L2 meanwhile (or nullptr).
  template <class RL>
  void RowsTile(const uint16_t* k, const uint16_t* v, size_t stride, int n, int t0,
                const uint8_t* k_ahead = nullptr, const uint8_t* v_ahead = nullptr) {
    float* S = sc_.S.data();
    TileScores<R, RL>(k, stride, n, q_, d_, sc_.part.data(), S, k_ahead);
    if (!SoftmaxTile(R, n, t0, vis_, S, st_, sc_.acc.data(), d_)) return;
    TileAccumulate<R, RL>(v, stride, n, S, sc_.acc.data(), d_, v_ahead);
  }

  // Keys and values as fp16 rows (the sink, the tail).
  void Fp16Tile(const uint16_t* k, const uint16_t* v, int n, int t0) {
    if (!rope_) return RowsTile<F16Rows>(k, v, d_, n, t0);
    float* S = sc_.S.data();
    for (int j = 0; j < n; ++j) HalfRowToFloat(k + static_cast<size_t>(j) * d_, d_, sc_.kbuf.data() + static_cast<size_t>(j) * d_);
    RopeTileKeys(*rope_, sc_.rope, sc_.kbuf.data(), n, d_);
    TileScores<R, F32Rows>(sc_.kbuf.data(), d_, n, TileQueries(t0), d_, sc_.part.data(), S);
    if (!SoftmaxTile(R, n, t0, vis_, S, st_, sc_.acc.data(), d_)) return;
    TileAccumulate<R, F16Rows>(v, d_, n, S, sc_.acc.data(), d_);
  }

  // Page rows [row, row + n) holding tokens t0 .. t0 + n.
  void PageSegment(const uint8_t* page, int row, int n, int t0) {
    const PageLayout& L = s_.layout();
    float* S = sc_.S.data();
    if (L.key.format == CodeFormat::kFp16 || L.key.format == CodeFormat::kBf16) {
      const bool bf = L.key.format == CodeFormat::kBf16;
      const size_t stride = L.key.code_row_bytes / 2;
      for (int i = 0; i < n; i += kTile) {
        const int m = std::min(kTile, n - i);
        const auto* k = reinterpret_cast<const uint16_t*>(PageLayout::CodeRow(page, L.key, row + i));
        const auto* v = reinterpret_cast<const uint16_t*>(PageLayout::CodeRow(page, L.value, row + i));
        // The next tile: further rows of this page, or the next page's first.
        const uint8_t* k_ahead = nullptr;
        const uint8_t* v_ahead = nullptr;
        if (i + m < n) {
          k_ahead = PageLayout::CodeRow(page, L.key, row + i + m);
          v_ahead = PageLayout::CodeRow(page, L.value, row + i + m);
        } else if (next_page_ != nullptr) {
          k_ahead = PageLayout::CodeRow(next_page_, L.key, 0);
          v_ahead = PageLayout::CodeRow(next_page_, L.value, 0);
        }
        if (bf) {
          RowsTile<Bf16Rows>(k, v, stride, m, t0 + i, k_ahead, v_ahead);
        } else {
          RowsTile<F16Rows>(k, v, stride, m, t0 + i, k_ahead, v_ahead);
        }
      }
      return;
    }
#if KVQ_X86_AVX2
    if (fast_.key || fast_.value) {
      if (KiviFastSegment(L.key.bits, L.value.bits, page, row, n, t0)) return;
    }
#endif
    // Generic: dequantize a tile of K and V, rotate the keys, float kernel.
    for (int i = 0; i < n; i += kTile) {
      const int m = std::min(kTile, n - i);
      PrefetchTile(page, row + i, m, n - i);
      float* kb = sc_.kbuf.data();
      DequantRows(sc_.kctx, page, row + i, m, kb);
      const float* q = q_;
      if (rope_) {
        RopeTileKeys(*rope_, sc_.rope, kb, m, d_);
        q = TileQueries(t0 + i);
      }
      TileScores<R, F32Rows>(kb, d_, m, q, d_, sc_.part.data(), S);
      if (!SoftmaxTile(R, m, t0 + i, vis_, S, st_, sc_.acc.data(), d_)) continue;
      DequantRows(sc_.vctx, page, row + i, m, sc_.vbuf.data());
      TileAccumulate<R, F32Rows>(sc_.vbuf.data(), d_, m, S, sc_.acc.data(), d_);
    }
  }

#if KVQ_X86_AVX2
  // Page rows through the integer kernels on the side(s) that allow them and
  // the generic float tiles on the other. Tiles never cross a G-token block.
  template <int kKeyBits, int kValueBits, int D>
  void KiviSegment(const uint8_t* page, int row, int n, int t0) {
    const int g = s_.layout().block_tokens;
    float* S = sc_.S.data();
    int i = 0;
    while (i < n) {
      const int r = row + i;
      const int block = r / g;
      const int m = std::min({kTile, n - i, g > 1 ? (block + 1) * g - r : kTile});
      if (!fast_.key) PrefetchTile(page, r, m, n - i);  // Keys dequantize: slower, more traffic.
      // The key loops over packed codes request the next page's share a few
      // lines per token (KiviKeyScores, KiviKeyTileToFloat); the other
      // paths all at once, here.
      const bool spread = (fast_.key && kKeyBits != 8) || (!fast_.key && plain_key_codes_);
      if (!spread) PrefetchNextPage(r, m);
      bool key_done = false;
      if constexpr (kKeyBits != 8) {  // int8 keys are per token: generic.
        if (fast_.key) {
          key_done = true;
          // The next page's share of lines for these rows goes out over
          // the whole tile, since a burst of more lines than the line-fill
          // buffers hold stalls the core, and so does a loop that must
          // issue them faster than they drain: a quarter before the key
          // setup (which reads nothing from memory), then with the integer
          // values (AVX3_DL) 3/8 a few per token in the key loop and 3/8 in
          // the value kernel, else the rest in the key loop. (In the key
          // loop alone kivi4 was 6-10% slower; half there and half spread
          // over the value loop, 4-9% slower at llama 32k: KERNELS.md section 7.)
          const auto [pf, pf_lines] = NextPageShare(r, m);
          const size_t pf_first = pf_lines / 4;
          PrefetchLines(pf, pf_first);
          vpf_lines_ = value_dot_ ? pf_lines * 3 / 8 : 0;
          const size_t key_lines = pf_lines - pf_first - vpf_lines_;
          vpf_ = pf + 64 * (pf_first + key_lines);
          if (block != key_block_ || page != key_page_) {
            KiviKeyBlock<R, D>(s_, page, block, q_, sc_, ka_, kcst_);
            key_block_ = block;
            key_page_ = page;
          }
          KiviKeyScores<R, kKeyBits, D>(s_, page, r, m, ka_, kcst_, sc_, S, pf + 64 * pf_first,
                                        key_lines);
          if (outliers_) KeyOutliers<kKeyBits, D>(page, block, r, m, S);
        }
      }
      if (!key_done) {
        float* kb = sc_.kbuf.data();
        if (plain_key_codes_) {
          const auto [pf, pf_lines] = NextPageShare(r, m);
          KiviKeyTileToFloat<kKeyBits, D>(s_, page, r, m, sc_, kb, pf, pf_lines);
        } else {
          DequantRows(sc_.kctx, page, r, m, kb);
        }
        const float* q = q_;
        if (rope_) {
          RopeTileKeys(*rope_, sc_.rope, kb, m, D);
          q = TileQueries(t0 + i);
        }
        TileScores<R, F32Rows>(kb, D, m, q, D, sc_.part.data(), S);
      }
      if (SoftmaxTile(R, m, t0 + i, vis_, S, st_, sc_.acc.data(), D)) {
        if (fast_.value) {
          KiviValueAccumulate<R, kValueBits, D>(s_, page, r, m, S, sc_, sc_.acc.data(), vpf_, vpf_lines_);
          vpf_lines_ = 0;
          if (outliers_) ValueOutliers<kValueBits, D>(page, block, r, m, S);
        } else {
          DequantRows(sc_.vctx, page, r, m, sc_.vbuf.data());
          TileAccumulate<R, F32Rows>(sc_.vbuf.data(), D, m, S, sc_.acc.data(), D);
        }
      }
      i += m;
    }
  }

  // Dispatches page rows to KiviSegment<key bits, value bits, head_dim>;
  // false when no instantiation matches (the caller takes the generic path).
  bool KiviFastSegment(int key_bits, int value_bits, const uint8_t* page, int row, int n,
                       int t0) {
    switch (d_) {
      case 64: return KiviFastSegmentD<64>(key_bits, value_bits, page, row, n, t0);
      case 128: return KiviFastSegmentD<128>(key_bits, value_bits, page, row, n, t0);
      case 256: return KiviFastSegmentD<256>(key_bits, value_bits, page, row, n, t0);
    }
    return false;
  }
  template <int D>
  bool KiviFastSegmentD(int key_bits, int value_bits, const uint8_t* page, int row, int n,
                        int t0) {
    switch (key_bits * 10 + value_bits) {
      case 88: KiviSegment<8, 8, D>(page, row, n, t0); return true;
      case 44: KiviSegment<4, 4, D>(page, row, n, t0); return true;
      case 43: KiviSegment<4, 3, D>(page, row, n, t0); return true;
      case 42: KiviSegment<4, 2, D>(page, row, n, t0); return true;
      case 34: KiviSegment<3, 4, D>(page, row, n, t0); return true;
      case 33: KiviSegment<3, 3, D>(page, row, n, t0); return true;
      case 32: KiviSegment<3, 2, D>(page, row, n, t0); return true;
      case 24: KiviSegment<2, 4, D>(page, row, n, t0); return true;
      case 23: KiviSegment<2, 3, D>(page, row, n, t0); return true;
      case 22: KiviSegment<2, 2, D>(page, row, n, t0); return true;
    }
    return false;
  }

  // Sparse outliers: the integer kernels see the clamped codes; each table
  // entry of the tile then adds q_c (x - dequant(code)) to its token's score,
  // and p_t (x - dequant(code)) to channel c of the output.
  template <int kBits, int D>
  void KeyOutliers(const uint8_t* page, int block, int row, int m, float* S) {
    const PageLayout& L = s_.layout();
    const int k = L.outliers_per_block;
    const uint16_t* tab = L.Outliers(page, L.key, block);
    const int first = row - block * L.block_tokens;  // Tile start within the block.
    const float* scale = sc_.kparams.data();
    const float* zero = scale + D;
    int e = 0;
#if KVQ_X86_AVX3
    // 16 entries decoded at once (gathers), then updated one at a time with
    // the arithmetic of the scalar loop below, which takes the other targets.
    const uint8_t* codes = PageLayout::CodeRow(page, L.key, row);
    for (; e < k; e += 16) {
      const OutlierLanes o =
          LoadOutlierLanes<kBits, D>(tab, k, e, first, m, codes, L.key.code_row_bytes);
      const __m512 diffs = OutlierDiffs(o, o.c, scale, zero, _mm512_cvtepi32_ps(o.code));
      ForEachOutlierLane(o, diffs, [&](int tt, int c, float diff) {
        for (int r = 0; r < R; ++r) S[r * kSLd + tt] += q_[r * D + c] * diff;
      });
    }
#endif
    for (; e < k; ++e) {
      // Unsigned, one compare tells whether the entry's token is in the tile.
      const unsigned tt = static_cast<unsigned>(tab[e] / D - first);
      if (tt >= static_cast<unsigned>(m)) continue;
      const int c = tab[e] % D;
      const float deq = zero[c] + scale[c] * static_cast<float>(CodeAt<kBits, D>(PageLayout::CodeRow(page, L.key, row + tt), c));
      const float diff = _cvtsh_ss(tab[k + e]) - deq;  // F16C: exact, as HalfToFloat.
      for (int r = 0; r < R; ++r) S[r * kSLd + tt] += q_[r * D + c] * diff;
    }
  }
  // Runs after KiviValueAccumulate over the same tile, so it reads the
  // tile's scales and zero points from Scratch::vparams instead of decoding
  // each entry's row again (that, and a division per entry, was about a fifth
  // of a kivi2:outliers=1 decode: KERNELS.md section 7).
  template <int kBits, int D>
  void ValueOutliers(const uint8_t* page, int block, int row, int m, const float* P) {
    const PageLayout& L = s_.layout();
    const int k = L.outliers_per_block;
    const uint16_t* tab = L.Outliers(page, L.value, block);
    const int first = row - block * L.block_tokens;
    const int gc_shift = std::countr_zero(static_cast<unsigned>(L.value.group_channels));
    const int ng = D >> gc_shift;
    const float* vs = sc_.vparams.data();                          // [ng][ld] scales
    const float* vz = vs + static_cast<size_t>(ng) * kValueParamsLd;  // [ng][ld] zeros
    const bool nuq = s_.spec().nuq;
    float* acc = sc_.acc.data();
    int e = 0;
#if KVQ_X86_AVX3
    const uint8_t* codes = PageLayout::CodeRow(page, L.value, row);
    for (; e < k; e += 16) {  // As in KeyOutliers.
      const OutlierLanes o =
          LoadOutlierLanes<kBits, D>(tab, k, e, first, m, codes, L.value.code_row_bytes);
      const __m512 level =
          nuq ? _mm512_mask_i32gather_ps(
                    _mm512_setzero_ps(), o.in,
                    _mm512_add_epi32(_mm512_mullo_epi32(o.c, _mm512_set1_epi32(sc_.vctx.levels)),
                                     o.code),
                    sc_.vctx.level_table.data(), 4)
              : _mm512_cvtepi32_ps(o.code);
      const __m512i at_lanes = _mm512_add_epi32(
          _mm512_mullo_epi32(_mm512_srlv_epi32(o.c, _mm512_set1_epi32(gc_shift)),
                             _mm512_set1_epi32(kValueParamsLd)),
          o.tt);
      const __m512 diffs = OutlierDiffs(o, at_lanes, vs, vz, level);
      ForEachOutlierLane(o, diffs, [&](int tt, int c, float diff) {
        for (int r = 0; r < R; ++r) acc[r * D + c] += P[r * kSLd + tt] * diff;
      });
    }
#endif
    for (; e < k; ++e) {
      const unsigned tt = static_cast<unsigned>(tab[e] / D - first);
      if (tt >= static_cast<unsigned>(m)) continue;
      const int c = tab[e] % D;
      const int code = CodeAt<kBits, D>(PageLayout::CodeRow(page, L.value, row + tt), c);
      const float level = nuq ? sc_.vctx.level_table[static_cast<size_t>(c) * sc_.vctx.levels + code]
                              : static_cast<float>(code);
      const int at = (c >> gc_shift) * kValueParamsLd + tt;
      const float deq = vz[at] + vs[at] * level;
      const float diff = _cvtsh_ss(tab[k + e]) - deq;
      for (int r = 0; r < R; ++r) acc[r * D + c] += P[r * kSLd + tt] * diff;
    }
  }
  FastSides fast_;
  bool value_dot_ = false;  // KiviValueDot takes the values (AVX3_DL).
  const uint8_t* vpf_ = nullptr;  // The next page's lines left to the value loop.
  size_t vpf_lines_ = 0;
  bool plain_key_codes_ = false;  // Generic-path keys KiviKeyTileToFloat can take.
  bool outliers_ = false;
  const uint8_t* key_page_ = nullptr;
  int key_block_ = -1;
  float ka_[kMaxRows];
  float kcst_[kMaxRows];
#endif

  const uint8_t* next_page_ = nullptr;  // The page after the current segment's.
  const KvStream& s_;
  const int d_;
  const float* q_;
  const int32_t* vis_;
  Scratch& sc_;
  const Rope* rope_;
  const PageCheck* page_check_;
  RopeBase base_;
  RowState st_;
};

template <int R>
void RunRows(const KvStream& s, int begin, int end, const float* q, const int32_t* visible_end,
             float* out, float* lse, Scratch& sc, const PageCheck* page_check) {
  RowPass<R> pass(s, q, visible_end, sc, page_check);
  pass.Run(begin, end);
  pass.Finish(out, lse);
}

}  // namespace

// Rows go kMaxRows at a time; a block of another size is padded to the next
// of 1, 2, 4, 8 with masked rows (zero query, nothing visible), which keeps
// the number of kernel instantiations (and compile time) down.
void AttendRangeImpl(const RangeJob& job) {
  const KvStream& s = *job.stream;
  const int d = s.head_dim();
  Scratch& sc = ThreadScratch(d);
  for (int r0 = 0; r0 < job.rows; r0 += kMaxRows) {
    const int rows = std::min(kMaxRows, job.rows - r0);
    const int padded = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
    const float* q = job.q + static_cast<size_t>(r0) * d;
    const int32_t* vis = job.visible_end + r0;
    float* out = job.out + static_cast<size_t>(r0) * d;
    float* lse = job.lse + r0;
    if (padded != rows) {
      std::copy(q, q + static_cast<size_t>(rows) * d, sc.qpad.begin());
      std::fill(sc.qpad.begin() + static_cast<size_t>(rows) * d, sc.qpad.end(), 0.0f);
      std::copy(vis, vis + rows, sc.vispad);
      std::fill(sc.vispad + rows, sc.vispad + kMaxRows, 0);
      q = sc.qpad.data();
      vis = sc.vispad;
      out = sc.outpad.data();
      lse = sc.lsepad;
    }
    switch (padded) {
      case 1: RunRows<1>(s, job.begin, job.end, q, vis, out, lse, sc, job.page_check); break;
      case 2: RunRows<2>(s, job.begin, job.end, q, vis, out, lse, sc, job.page_check); break;
      case 4: RunRows<4>(s, job.begin, job.end, q, vis, out, lse, sc, job.page_check); break;
      default: RunRows<8>(s, job.begin, job.end, q, vis, out, lse, sc, job.page_check); break;
    }
    if (padded != rows) {
      std::copy(sc.outpad.begin(), sc.outpad.begin() + static_cast<size_t>(rows) * d,
                job.out + static_cast<size_t>(r0) * d);
      std::copy(sc.lsepad, sc.lsepad + rows, job.lse + r0);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq {
namespace cpu {

HWY_EXPORT(AttendRangeImpl);

void AttendRange(const RangeJob& job) { HWY_DYNAMIC_DISPATCH(AttendRangeImpl)(job); }

}  // namespace cpu
}  // namespace kvq
#endif
