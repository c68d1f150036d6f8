// SIMD decode / chunk attention over one stream: the kernels behind
// CpuBackend().Attend (cpu_backend.cc plans, threads and merges around them).
//
// Shape of the computation (flash-decoding): keys are visited in tiles of at
// most kTile tokens that never cross a page (or, for kivi, a G-token block).
// Up to kMaxRows query rows (the GQA group, times the queries of a chunk)
// share every loaded tile. Per tile: scores S[r][t] = q_r . k_t (q already
// carries the softmax scale), an online-softmax update (running max m_r, sum
// l_r, output acc_r rescaled by exp(m_old - m_new)), then acc_r += sum_t
// p_rt v_t. The whole dequantized KV is never materialized: at most one tile
// of floats lives in a thread-local buffer.
//
// Paths:
//  * fp16 / bf16 pages and the fp16 sink and tail rows: the float tile kernel
//    reads the 16-bit rows directly (F16C / shift conversion + FMA).
//  * kivi, uniform levels, per-channel keys, no pre_rope (AVX2): integer
//    kernels on the packed codes, see "kivi fast path" below for the math.
//  * everything else (int8, fp8, nuq, pre_rope, outliers, ktok, other
//    targets): the generic tile path dequantizes one tile of K and V to float
//    (simd_dequant-inl.h, bit-identical to the reference), applies RoPE to
//    the keys, and runs the float tile kernel.
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
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "kernels/cpu/simd_dequant-inl.h"
#include "kernels/cpu/simd_kernels.h"
#include "kernels/numeric.h"
#include "kernels/rope.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace cpu {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr int kTile = 32;             // Tokens per tile.
constexpr int kSLd = kTile + 16;      // Leading dimension of score rows (padding).
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------
// Row loaders of the float tile kernel.

struct F16Rows {
  using T = uint16_t;
  static HWY_INLINE VF Load(DF df, const uint16_t* HWY_RESTRICT p) {
    return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::float16_t, DF>(),
                                       reinterpret_cast<const hwy::float16_t*>(p)));
  }
};
struct Bf16Rows {
  using T = uint16_t;
  static HWY_INLINE VF Load(DF df, const uint16_t* HWY_RESTRICT p) {
    return hn::PromoteTo(df, hn::LoadU(hn::Rebind<hwy::bfloat16_t, DF>(),
                                       reinterpret_cast<const hwy::bfloat16_t*>(p)));
  }
};
struct F32Rows {
  using T = float;
  static HWY_INLINE VF Load(DF df, const float* HWY_RESTRICT p) { return hn::LoadU(df, p); }
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
  SideContext kctx, vctx;
  RopeTables rope;
  // kivi fast path.
  std::vector<float> kparams;   // scale[d], zero[d] of the current key block.
  std::vector<int16_t> qi;      // [kMaxRows][d]
  std::vector<int32_t> ipart;   // [kTile][kMaxRows][8]
  std::vector<float> vparams;   // [2][ng][kTile + 2]: scale then zero, token-major per group.
  std::vector<int16_t> wi;      // [kMaxRows][ng][kTile + 2]
  std::vector<float> zsum;      // [kMaxRows][ng]

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
    kparams.assign(2 * D, 0.0f);
    qi.assign(kMaxRows * D, 0);
    ipart.assign(static_cast<size_t>(kTile) * kMaxRows * 8, 0);
    vparams.assign(2 * D * (kTile + 2), 0.0f);
    wi.assign(kMaxRows * D * (kTile + 2), 0);
    zsum.assign(kMaxRows * D, 0.0f);
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

// qrot[r] = R(-t0) q[r] (only the rotary channels change).
void RotateQueries(const Rope& rope, const Scratch& sc, int rows, const float* q, int d,
                   float* qrot) {
  const int np = rope.rotary_dim() / 2;
  std::memcpy(qrot, q, sizeof(float) * rows * d);
  for (int i = 0; i < np; ++i) {
    const float c = static_cast<float>(sc.base_c[i]);
    const float s = static_cast<float>(sc.base_s[i]);
    const int a = rope.First(i);
    const int b = rope.Second(i);
    for (int r = 0; r < rows; ++r) {
      const float q0 = q[r * d + a], q1 = q[r * d + b];
      qrot[r * d + a] = q0 * c + q1 * s;
      qrot[r * d + b] = q1 * c - q0 * s;
    }
  }
}

// ---------------------------------------------------------------------------
// Float tile kernel.

#if HWY_TARGET == HWY_AVX2
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
#if HWY_TARGET == HWY_AVX2
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

// S[r][t] = q_r . k_t for t < n. TS tokens per step keep >= 4 independent
// FMA chains in flight whatever R is.
template <int R, class KL>
HWY_INLINE void TileScores(const typename KL::T* HWY_RESTRICT k, size_t kstride, int n,
                           const float* HWY_RESTRICT q, int d, float* HWY_RESTRICT part,
                           float* HWY_RESTRICT S) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  constexpr int TS = R == 1 ? 4 : (R <= 2 ? 4 : (R <= 4 ? 2 : 1));
  int t = 0;
  for (; t + TS <= n; t += TS) {
    VF acc[TS][R];
    for (int u = 0; u < TS; ++u) {
      for (int r = 0; r < R; ++r) acc[u][r] = hn::Zero(df);
    }
    for (int c = 0; c < d; c += N) {
      for (int u = 0; u < TS; ++u) {
        const VF kv = KL::Load(df, k + static_cast<size_t>(t + u) * kstride + c);
        for (int r = 0; r < R; ++r) acc[u][r] = hn::MulAdd(kv, hn::LoadU(df, q + r * d + c), acc[u][r]);
      }
    }
    for (int u = 0; u < TS; ++u) {
      for (int r = 0; r < R; ++r) hn::StoreU(acc[u][r], df, part + (static_cast<size_t>(t + u) * R + r) * N);
    }
  }
  for (; t < n; ++t) {
    VF acc[R];
    for (int r = 0; r < R; ++r) acc[r] = hn::Zero(df);
    for (int c = 0; c < d; c += N) {
      const VF kv = KL::Load(df, k + static_cast<size_t>(t) * kstride + c);
      for (int r = 0; r < R; ++r) acc[r] = hn::MulAdd(kv, hn::LoadU(df, q + r * d + c), acc[r]);
    }
    for (int r = 0; r < R; ++r) hn::StoreU(acc[r], df, part + (static_cast<size_t>(t) * R + r) * N);
  }
  ReduceParts<R>(part, n, S);
}

// acc[r][:] += sum_t P[r][t] v_t for t < n. W vectors per channel chunk keep
// R*W accumulators in registers.
template <int R, class VL>
HWY_INLINE void TileAccumulate(const typename VL::T* HWY_RESTRICT v, size_t vstride, int n,
                               const float* HWY_RESTRICT P, float* HWY_RESTRICT acc, int d) {
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
}

// ---------------------------------------------------------------------------
// Online softmax.

struct RowState {
  float m[kMaxRows];
  float l[kMaxRows];
};

// Turns the scores of a tile (tokens t0 .. t0+n) into probabilities in place,
// masking keys beyond each row's visible end, and rescales l and acc to the
// new running max. Returns false when no row sees any key of the tile.
HWY_INLINE bool SoftmaxTile(int R, int n, int t0, const int32_t* HWY_RESTRICT visible_end,
                            float* HWY_RESTRICT S, RowState& st, float* HWY_RESTRICT acc, int d) {
  const DF df;
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
    VF vmax = hn::Set(df, kNegInf);
    for (int t = 0; t < npad; t += N) vmax = hn::Max(vmax, hn::LoadU(df, s + t));
    const float tile_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
    const float m_new = std::max(st.m[r], tile_max);
    const float corr = st.m[r] == kNegInf ? 0.0f : std::exp(st.m[r] - m_new);
    const VF vm = hn::Set(df, m_new);
    VF vsum = hn::Zero(df);
    for (int t = 0; t < npad; t += N) {
      const VF p = hn::Exp(df, hn::Sub(hn::LoadU(df, s + t), vm));
      vsum = hn::Add(vsum, p);
      hn::StoreU(p, df, s + t);
    }
    const float sum = hn::GetLane(hn::SumOfLanes(df, vsum));
    st.l[r] = st.l[r] * corr + sum;
    st.m[r] = m_new;
    if (corr != 1.0f) {
      const VF vc = hn::Set(df, corr);
      float* a = acc + r * d;
      for (int c = 0; c < d; c += N) hn::StoreU(hn::Mul(hn::LoadU(df, a + c), vc), df, a + c);
    }
  }
  return any;
}

// ---------------------------------------------------------------------------
// kivi fast path (AVX2).
//
// Keys, per-channel uniform: within a G-token block k[t][c] = z_c + s_c *
// code[t][c], so q.k_t = sum_c (q_c s_c) code[t][c] + sum_c q_c z_c. Per block
// and row, q~ = q * s is quantized to int16 with one float scale
// a = max|q~| / 32767 (relative error ~1.5e-5, far inside the contract; an
// int8 q~ would cost ~1e-2 on keys with outlier channels), the constant
// sum_c q_c z_c is a float dot, and per token the integer dot of q~ with the
// codes is vpmaddwd on codes widened to int16 (16 MACs per instruction, int32
// sums: |sum| <= 256 * 32767 * 15 < 2^31).
//
// Values, per-token groups: v[t][c] = z_tg + s_tg * code[t][c] for the
// channel group g of c, so o_c = sum_t (p_t s_tg) code[t][c] + sum_t p_t z_tg.
// Per tile and row the weights w_tg = p_t s_tg are quantized to int16 with
// one scale (a = max w / 32767), the zero term is a float dot per group, and
// the integer sum runs over token pairs: codes of tokens t and t+1
// interleaved as int16 pairs times the broadcast pair (w_t, w_t+1), one
// vpmaddwd per 8 channels and 2 tokens.
//
// Codes widen straight from the bit planes: for a 16-channel run starting at
// c0, the plane bytes c0 mod P .. +16 zero-extended to int16, shifted right by
// (c0 / P) * b and masked; channels stay in natural order.

#if HWY_TARGET == HWY_AVX2

bool KiviFastPath(const KvStream& s) {
  const QuantSpec& spec = s.spec();
  const PageLayout& L = s.layout();
  const int d = L.head_dim;
  if (!spec.is_kivi() || spec.nuq || spec.pre_rope || spec.has_outliers()) return false;
  if (L.key.axis != ParamAxis::kChannelGroups || L.value.axis != ParamAxis::kTokenGroups) return false;
  if (L.value.group_channels % 16 != 0) return false;
  if (d > 256) return false;
  if (spec.bits == 3) return d % 128 == 0;
  return d % 64 == 0;
}

// Widens the codes of one row to int16, 16 channels per vector, natural order.
template <int kBits>
HWY_INLINE void WidenCodes(const uint8_t* HWY_RESTRICT row, int d, __m256i* HWY_RESTRICT out) {
  auto zx = [](const uint8_t* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  if constexpr (kBits == 4) {
    const int P = d / 2;
    const __m256i m4 = _mm256_set1_epi16(0x0F);
    for (int k = 0; k < P / 16; ++k) {
      const __m256i x = zx(row + 16 * k);
      out[k] = _mm256_and_si256(x, m4);
      out[P / 16 + k] = _mm256_srli_epi16(x, 4);
    }
  } else if constexpr (kBits == 2) {
    const int P = d / 4;
    const __m256i m2 = _mm256_set1_epi16(0x03);
    for (int k = 0; k < P / 16; ++k) {
      const __m256i x = zx(row + 16 * k);
      out[k] = _mm256_and_si256(x, m2);
      out[P / 16 + k] = _mm256_and_si256(_mm256_srli_epi16(x, 2), m2);
      out[2 * P / 16 + k] = _mm256_and_si256(_mm256_srli_epi16(x, 4), m2);
      out[3 * P / 16 + k] = _mm256_srli_epi16(x, 6);
    }
  } else {  // 3 bits: a 2-bit plane (low bits) then a 1-bit plane (high bit).
    const int P2 = d / 4;
    const int P1 = d / 8;
    WidenCodes<2>(row, d, out);
    const __m256i m4 = _mm256_set1_epi16(0x04);
    const uint8_t* hi = row + P2;
    for (int j = 0; j < d / 16; ++j) {
      const int c0 = 16 * j;
      const __m256i y = zx(hi + c0 % P1);
      const int bit = c0 / P1;
      const __m256i h = bit >= 2 ? _mm256_srli_epi16(y, bit - 2) : _mm256_slli_epi16(y, 2 - bit);
      out[j] = _mm256_or_si256(out[j], _mm256_and_si256(h, m4));
    }
  }
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

// Channels [16j, 16j + 16) of one row widened to int16 (as WidenCodes).
template <int kBits>
HWY_INLINE __m256i WidenChunk(const uint8_t* HWY_RESTRICT row, int d, int j) {
  auto zx = [](const uint8_t* p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  const int c0 = 16 * j;
  if constexpr (kBits == 4) {
    const int P = d / 2;
    return c0 < P ? _mm256_and_si256(zx(row + c0), _mm256_set1_epi16(0x0F))
                  : _mm256_srli_epi16(zx(row + c0 - P), 4);
  } else {
    const int P = d / 4;
    const __m256i x = zx(row + c0 % P);
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(x, _mm_cvtsi32_si128(2 * (c0 / P))),
                                        _mm256_set1_epi16(0x03));
    if constexpr (kBits == 2) {
      return lo;
    } else {
      const int P1 = d / 8;
      const __m256i y = zx(row + P + c0 % P1);
      const __m256i h = _mm256_and_si256(_mm256_srl_epi16(y, _mm_cvtsi32_si128(c0 / P1)),
                                         _mm256_set1_epi16(0x01));
      return _mm256_or_si256(lo, _mm256_slli_epi16(h, 2));
    }
  }
}

// Per-block key setup: int16 q~ per row, its scale and the zero-point dot.
HWY_INLINE void KiviKeyBlock(const KvStream& s, const uint8_t* page, int block, int R,
                             const float* HWY_RESTRICT q, Scratch& sc, float* a, float* cst) {
  const PageLayout& L = s.layout();
  const int d = L.head_dim;
  float* scale = sc.kparams.data();
  float* zero = scale + d;
  HalfRowToFloat(L.Params(page, L.key, block), 2 * d, scale);
  for (int r = 0; r < R; ++r) {
    const float* qr = q + r * d;
    __m256 vmax = _mm256_setzero_ps();
    __m256 vc = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int c = 0; c < d; c += 8) {
      const __m256 qv = _mm256_loadu_ps(qr + c);
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_mul_ps(qv, _mm256_loadu_ps(scale + c)), absmask));
      vc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(zero + c), vc);
    }
    const float amax = HMax(vmax);
    cst[r] = HSum(vc);
    int16_t* qi = sc.qi.data() + r * d;
    if (!(amax > 0.0f)) {
      a[r] = 0.0f;
      std::memset(qi, 0, sizeof(int16_t) * d);
      continue;
    }
    a[r] = amax / 32767.0f;
    const __m256 inv = _mm256_set1_ps(32767.0f / amax);
    for (int c = 0; c < d; c += 16) {
      const __m256 x0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(qr + c), _mm256_loadu_ps(scale + c)), inv);
      const __m256 x1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(qr + c + 8), _mm256_loadu_ps(scale + c + 8)), inv);
      const __m256i i0 = _mm256_cvtps_epi32(x0);
      const __m256i i1 = _mm256_cvtps_epi32(x1);
      // packs interleaves 128-bit lanes; permute restores channel order.
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + c), p);
    }
  }
}

// Integer key scores of tokens [row, row + n) of one block.
template <int R, int kBits>
HWY_INLINE void KiviKeyScores(const KvStream& s, const uint8_t* page, int row, int n,
                              const float* a, const float* cst, Scratch& sc, float* HWY_RESTRICT S) {
  const PageLayout& L = s.layout();
  const int d = L.head_dim;
  const int nv = d / 16;
  int32_t* ipart = sc.ipart.data();
  const int16_t* qi = sc.qi.data();
  __m256i codes[16];
  for (int t = 0; t < n; ++t) {
    WidenCodes<kBits>(PageLayout::CodeRow(page, L.key, row + t), d, codes);
    for (int r = 0; r < R; ++r) {
      const __m256i* qv = reinterpret_cast<const __m256i*>(qi + r * d);
      __m256i s0 = _mm256_madd_epi16(codes[0], _mm256_loadu_si256(qv));
      __m256i s1 = _mm256_madd_epi16(codes[1], _mm256_loadu_si256(qv + 1));
      for (int j = 2; j < nv; j += 2) {
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(codes[j], _mm256_loadu_si256(qv + j)));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(codes[j + 1], _mm256_loadu_si256(qv + j + 1)));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ipart + (t * R + r) * 8), _mm256_add_epi32(s0, s1));
    }
  }
  int t = 0;
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

// acc[r] += sum_t P[r][t] v_t over tokens [row, row + n) of a page, integer
// weights per (tile, row).
template <int R, int kBits>
HWY_INLINE void KiviValueAccumulate(const KvStream& s, const uint8_t* page, int row, int n,
                                    const float* HWY_RESTRICT P, Scratch& sc,
                                    float* HWY_RESTRICT acc) {
  const PageLayout& L = s.layout();
  const SideLayout& V = L.value;
  const int d = L.head_dim;
  const int gc = V.group_channels;
  const int ng = d / gc;
  const int ld = kTile + 2;  // Token stride of the per-group arrays (even, padded).
  float* vs = sc.vparams.data();            // [ng][ld] scales
  float* vz = vs + static_cast<size_t>(ng) * ld;  // [ng][ld] zeros
  for (int t = 0; t < n; ++t) {
    const uint16_t* p = L.Params(page, V, row + t);
    for (int g = 0; g < ng; ++g) {
      vs[g * ld + t] = HalfToFloat(p[g]);
      vz[g * ld + t] = HalfToFloat(p[ng + g]);
    }
  }
  const int npad = (n + 7) / 8 * 8;
  for (int g = 0; g < ng; ++g) {
    for (int t = n; t < npad; ++t) vs[g * ld + t] = vz[g * ld + t] = 0.0f;
  }
  // Weights per row: w = p * s (int16, one scale per row), zero term per group.
  float a[kMaxRows];
  int16_t* wi = sc.wi.data();
  float* zsum = sc.zsum.data();
  for (int r = 0; r < R; ++r) {
    const float* pr = P + r * kSLd;
    __m256 vmax = _mm256_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      __m256 vzs = _mm256_setzero_ps();
      for (int t = 0; t < npad; t += 8) {
        const __m256 pv = _mm256_loadu_ps(pr + t);
        vmax = _mm256_max_ps(vmax, _mm256_mul_ps(pv, _mm256_loadu_ps(vs + g * ld + t)));
        vzs = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vz + g * ld + t), vzs);
      }
      zsum[r * ng + g] = HSum(vzs);
    }
    const float wmax = HMax(vmax);
    a[r] = wmax > 0.0f ? wmax / 32767.0f : 0.0f;
    const __m256 inv = _mm256_set1_ps(wmax > 0.0f ? 32767.0f / wmax : 0.0f);
    for (int g = 0; g < ng; ++g) {
      int16_t* w = wi + (static_cast<size_t>(r) * ng + g) * ld;
      for (int t = 0; t < npad; t += 16) {
        const __m256 w0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(pr + t), _mm256_loadu_ps(vs + g * ld + t)), inv);
        const __m256 w1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(pr + t + 8), _mm256_loadu_ps(vs + g * ld + t + 8)), inv);
        const __m256i p16 = _mm256_permute4x64_epi64(
            _mm256_packs_epi32(_mm256_cvtps_epi32(w0), _mm256_cvtps_epi32(w1)), 0xD8);
        if (t + 16 <= ld) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), p16);
        } else {
          alignas(32) int16_t tmp[16];
          _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), p16);
          std::memcpy(w + t, tmp, sizeof(int16_t) * (ld - t));
        }
      }
      if (n % 2) w[n] = 0;  // The odd token pairs with a zero weight.
    }
  }
  // Integer accumulation: 16-channel chunks outer, token pairs inner.
  const int npairs = (n + 1) / 2;
  for (int j = 0; j < d / 16; ++j) {
    const int g = (16 * j) / gc;
    __m256i lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int pi = 0; pi < npairs; ++pi) {
      const int t = 2 * pi;
      const __m256i c0 = WidenChunk<kBits>(PageLayout::CodeRow(page, V, row + t), d, j);
      const __m256i c1 = t + 1 < n ? WidenChunk<kBits>(PageLayout::CodeRow(page, V, row + t + 1), d, j) : c0;
      const __m256i il = _mm256_unpacklo_epi16(c0, c1);
      const __m256i ih = _mm256_unpackhi_epi16(c0, c1);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, wi + (static_cast<size_t>(r) * ng + g) * ld + t, sizeof(pair));
        const __m256i wp = _mm256_set1_epi32(pair);
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(il, wp));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(ih, wp));
      }
    }
    for (int r = 0; r < R; ++r) {
      // lo holds channels {0-3, 8-11} of the chunk, hi {4-7, 12-15}.
      const __m256 va = _mm256_set1_ps(a[r]);
      const __m256 fl = _mm256_mul_ps(_mm256_cvtepi32_ps(lo[r]), va);
      const __m256 fh = _mm256_mul_ps(_mm256_cvtepi32_ps(hi[r]), va);
      const __m256 z = _mm256_set1_ps(zsum[r * ng + g]);
      float* ar = acc + r * d + 16 * j;
      _mm256_storeu_ps(ar, _mm256_add_ps(_mm256_loadu_ps(ar),
                                         _mm256_add_ps(_mm256_permute2f128_ps(fl, fh, 0x20), z)));
      _mm256_storeu_ps(ar + 8, _mm256_add_ps(_mm256_loadu_ps(ar + 8),
                                             _mm256_add_ps(_mm256_permute2f128_ps(fl, fh, 0x31), z)));
    }
  }
}

#endif  // HWY_TARGET == HWY_AVX2

// ---------------------------------------------------------------------------
// One pass over the key range for R rows.

template <int R>
class RowPass {
 public:
  RowPass(const KvStream& s, const RangeJob& job, int r0, Scratch& sc)
      : s_(s), d_(s.head_dim()), q_(job.q + static_cast<size_t>(r0) * s.head_dim()),
        vis_(job.visible_end + r0), sc_(sc), rope_(s.rope()) {
    for (int r = 0; r < R; ++r) {
      st_.m[r] = kNegInf;
      st_.l[r] = 0.0f;
    }
    std::fill(sc_.acc.begin(), sc_.acc.begin() + R * d_, 0.0f);
    if (rope_) {
      PrepareRopeTables(*rope_, sc_.rope);
      base_.rope = rope_;
    }
    sc_.kctx.Init(s, Side::kKey);
    sc_.vctx.Init(s, Side::kValue);
#if HWY_TARGET == HWY_AVX2
    fast_ = KiviFastPath(s);
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
  // The query rows to score keys of a tile starting at t0 against.
  const float* TileQueries(int t0) {
    if (!rope_) return q_;
    base_.MoveTo(t0, sc_.rope, sc_);
    RotateQueries(*rope_, sc_, R, q_, d_, sc_.qrot.data());
    return sc_.qrot.data();
  }

  // Keys and values as fp16 rows (the sink, the tail).
  void Fp16Tile(const uint16_t* k, const uint16_t* v, int n, int t0) {
    float* S = sc_.S.data();
    if (rope_) {
      for (int j = 0; j < n; ++j) HalfRowToFloat(k + static_cast<size_t>(j) * d_, d_, sc_.kbuf.data() + static_cast<size_t>(j) * d_);
      RopeTileKeys(*rope_, sc_.rope, sc_.kbuf.data(), n, d_);
      TileScores<R, F32Rows>(sc_.kbuf.data(), d_, n, TileQueries(t0), d_, sc_.part.data(), S);
    } else {
      TileScores<R, F16Rows>(k, d_, n, q_, d_, sc_.part.data(), S);
    }
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
        if (bf) {
          TileScores<R, Bf16Rows>(k, stride, m, q_, d_, sc_.part.data(), S);
        } else {
          TileScores<R, F16Rows>(k, stride, m, q_, d_, sc_.part.data(), S);
        }
        if (!SoftmaxTile(R, m, t0 + i, vis_, S, st_, sc_.acc.data(), d_)) continue;
        if (bf) {
          TileAccumulate<R, Bf16Rows>(v, stride, m, S, sc_.acc.data(), d_);
        } else {
          TileAccumulate<R, F16Rows>(v, stride, m, S, sc_.acc.data(), d_);
        }
      }
      return;
    }
#if HWY_TARGET == HWY_AVX2
    if (fast_) {
      switch (L.bits) {
        case 4: return KiviSegment<4>(page, row, n, t0);
        case 3: return KiviSegment<3>(page, row, n, t0);
        case 2: return KiviSegment<2>(page, row, n, t0);
      }
    }
#endif
    // Generic: dequantize a tile of K and V, rotate the keys, float kernel.
    for (int i = 0; i < n; i += kTile) {
      const int m = std::min(kTile, n - i);
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

#if HWY_TARGET == HWY_AVX2
  template <int kBits>
  void KiviSegment(const uint8_t* page, int row, int n, int t0) {
    const int g = s_.layout().block_tokens;
    float* S = sc_.S.data();
    int i = 0;
    while (i < n) {
      const int r = row + i;
      const int block = r / g;
      const int m = std::min({kTile, n - i, (block + 1) * g - r});
      if (block != key_block_ || page != key_page_) {
        KiviKeyBlock(s_, page, block, R, q_, sc_, ka_, kcst_);
        key_block_ = block;
        key_page_ = page;
      }
      KiviKeyScores<R, kBits>(s_, page, r, m, ka_, kcst_, sc_, S);
      if (SoftmaxTile(R, m, t0 + i, vis_, S, st_, sc_.acc.data(), d_)) {
        KiviValueAccumulate<R, kBits>(s_, page, r, m, S, sc_, sc_.acc.data());
      }
      i += m;
    }
  }
  bool fast_ = false;
  const uint8_t* key_page_ = nullptr;
  int key_block_ = -1;
  float ka_[kMaxRows];
  float kcst_[kMaxRows];
#endif

  const KvStream& s_;
  const int d_;
  const float* q_;
  const int32_t* vis_;
  Scratch& sc_;
  const Rope* rope_;
  RopeBase base_;
  RowState st_;
};

template <int R>
void RunRows(const KvStream& s, const RangeJob& job, int r0, Scratch& sc) {
  RowPass<R> pass(s, job, r0, sc);
  pass.Run(job.begin, job.end);
  pass.Finish(job.out + static_cast<size_t>(r0) * s.head_dim(), job.lse + r0);
}

}  // namespace

void AttendRangeImpl(const RangeJob& job) {
  const KvStream& s = *job.stream;
  Scratch& sc = ThreadScratch(s.head_dim());
  for (int r0 = 0; r0 < job.rows; r0 += kMaxRows) {
    switch (std::min(kMaxRows, job.rows - r0)) {
      case 1: RunRows<1>(s, job, r0, sc); break;
      case 2: RunRows<2>(s, job, r0, sc); break;
      case 3: RunRows<3>(s, job, r0, sc); break;
      case 4: RunRows<4>(s, job, r0, sc); break;
      case 5: RunRows<5>(s, job, r0, sc); break;
      case 6: RunRows<6>(s, job, r0, sc); break;
      case 7: RunRows<7>(s, job, r0, sc); break;
      case 8: RunRows<8>(s, job, r0, sc); break;
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
