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

// The tile kernels, one concern a file (included once per target, in this
// order: each uses the ones before it).
#include "kernels/cpu/simd_attention/tile_rows.inc"
#include "kernels/cpu/simd_attention/scratch.inc"
#include "kernels/cpu/simd_attention/rope.inc"
#include "kernels/cpu/simd_attention/key_scores.inc"
#include "kernels/cpu/simd_attention/value_accumulate.inc"
#include "kernels/cpu/simd_attention/softmax.inc"

#if KVQ_X86_AVX2
#include "kernels/cpu/simd_attention/kivi_codes.inc"
#include "kernels/cpu/simd_attention/kivi_outliers.inc"
#include "kernels/cpu/simd_attention/kivi_key_scores.inc"
#include "kernels/cpu/simd_attention/kivi_dequant.inc"
#include "kernels/cpu/simd_attention/kivi_value_accumulate.inc"
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
