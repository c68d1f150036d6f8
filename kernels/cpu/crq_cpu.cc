#include "kernels/cpu/crq_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/simd_crq.h"
#include "kernels/crq_transform.h"
#include "kernels/hd/attention_hd.h"
#include "kernels/hd/crq_hd.h"
#include "kernels/numeric.h"

namespace kvq::cpu {
namespace {

// The levels of a side's two half widths, unused slots zero.
CrqRowLevels RowLevels(int half_bits) {
  const hd::CrqCodebooks& cb = CrqCodebooks();
  CrqRowLevels t = {};
  const int hi = hd::CrqHiBits(half_bits), lo = hd::CrqLoBits(half_bits);
  std::copy_n(hd::CrqLevels(cb, hi), 1 << hi, t.hi);
  std::copy_n(hd::CrqLevels(cb, lo), 1 << lo, t.lo);
  return t;
}

int TaskEnd(const AttentionTask& t) {
  return t.key_end == -1 ? t.stream->num_tokens() : t.key_end;
}

// What one query row needs for every key chunk.
struct Row {
  const AttentionTask* task = nullptr;
  int query = 0;
  int head = 0;
  int visible_end = 0;
  std::vector<float> q;      // Post-RoPE query, softmax scale folded in.
  std::vector<float> qr;     // q' = H (s_k q): scores the coded coordinates.
  std::vector<float> a, b;   // Mean term per RoPE pair, zero-padded to kLanes.
  double fixed = 0.0;        // Mean term of channels that do not rotate.
};

// Pair arrays are zero-padded to whole vectors of 8 floats (head_dim is a
// multiple of 16, so code rows need no padding).
constexpr int kLanes = 8;
int PadToLanes(int n) { return (n + kLanes - 1) / kLanes * kLanes; }

// A chunk of keys [begin, end) for the rows [row0, row0 + rows) of one
// task: whole queries (each its GQA group's rows), which share the keys they
// see, so each code row is unpacked once for all of them.
struct Unit {
  int row0 = 0;
  int rows = 0;
  int begin = 0;
  int end = 0;
  std::vector<float> out;  // [rows][d], original basis, normalized.
  std::vector<float> lse;  // [rows]
};

// Rows per block: a prefill chunk's queries share every decoded tile in
// blocks this large (decode steps have one query: its group).
constexpr int kBlockRows = 48;
// From this many rows a tile's mean term is folded into its keys once
// (CrqTileFoldMean, O(d log d)) rather than scored per row (d / 2 pairs);
// the two cost about the same near 9 rows.
constexpr int kFoldRows = 12;
constexpr int kChunkTokens = 512;

void PrepareRow(const AttentionOptions& options, Row& r) {
  const KvStream& s = *r.task->stream;
  const CrqTransform& T = *s.crq();
  const HeadCalibration& cal = T.calibration();
  const Rope& rope = T.rope();
  const int d = s.head_dim();
  const float scale = SoftmaxScale(options, d);
  const float* src = r.task->q + static_cast<size_t>(r.query) * r.task->q_stride +
                     static_cast<size_t>(r.head) * d;
  r.q.resize(d);
  for (int c = 0; c < d; ++c) r.q[c] = src[c] * scale;
  r.qr.resize(d);
  for (int c = 0; c < d; ++c) r.qr[c] = r.q[c] * cal.key_scale[c];
  T.rotation().Forward(r.qr.data());
  const int pairs = rope.rotary_dim() / 2;
  r.a.assign(PadToLanes(pairs), 0.0f);
  r.b.assign(PadToLanes(pairs), 0.0f);
  std::vector<char> rotates(d, 0);
  for (int j = 0; j < pairs; ++j) {
    const int f = rope.First(j), sc = rope.Second(j);
    rotates[f] = rotates[sc] = 1;
    float a, b;
    hd::CrqMeanPair(r.q[f], r.q[sc], cal.key_mean[f], cal.key_mean[sc], &a, &b);
    r.a[j] = a;
    r.b[j] = b;
  }
  r.fixed = 0.0;
  for (int c = 0; c < d; ++c) {
    if (!rotates[c]) r.fixed += static_cast<double>(r.q[c]) * cal.key_mean[c];
  }
}

// A unit's buffers, reused by the thread that runs it.
struct UnitScratch {
  std::vector<float> q, qr, ma, mb, fixed, scores, mx, sums, x, rows, levels, gain, tile_cs,
      tile_sn, key_cs, key_sn, first_cs, first_sn, turned_a, turned_b, mu, signs_norm, folded,
      unit_gain, no_fixed;
  std::vector<int> first, second;
  std::vector<double> cs, sn, step_c, step_s, sum, sum_coded;
  std::vector<uint8_t> codes;
};

UnitScratch& ThreadUnitScratch() {
  thread_local UnitScratch scratch;
  return scratch;
}

// The rows of one side a unit reads: coded ones from their pages (each page
// passed to the page check before its first read), fp16 ones as stored.
class UnitRows {
 public:
  UnitRows(const KvStream& s, const AttentionOptions& options)
      : s_(s),
        options_(options),
        // Coded rows are one range of positions: past the sink, in the pages.
        coded_begin_(s.sink_tokens()),
        coded_end_(s.page_base() + s.quantized_tokens()) {}

  int coded_begin() const { return coded_begin_; }
  int coded_end() const { return coded_end_; }
  bool Coded(int t) const { return t >= coded_begin_ && t < coded_end_; }

  // Coded row t of `side` decoded to levels times `gain` (its stored gain
  // when `stored_gain`, else 1), which it returns; `row` holds d floats.
  float Decode(Side side, int t, const CrqRowLevels& levels, bool stored_gain, float* row) {
    const PageLayout& L = s_.layout();
    const int v = t - s_.page_base();
    const int page_index = v / L.page_tokens;
    if (options_.page_check != nullptr && page_index != checked_page_) {
      checked_page_ = page_index;
      options_.page_check->Check(s_, page_index);
    }
    const uint8_t* page = s_.page(page_index);
    const SideLayout& S = L.side(side);
    const int r = v % L.page_tokens;
    const float gain = HalfToFloat(*PageLayout::Gain(page, S, r));
    codes_.resize(s_.head_dim());
    CrqDecodeRow(PageLayout::CodeRow(page, S, r), s_.head_dim(), S.half_bits, levels,
                 stored_gain ? gain : 1.0f, codes_.data(), row);
    return gain;
  }

 private:
  const KvStream& s_;
  const AttentionOptions& options_;
  const int coded_begin_, coded_end_;
  int checked_page_ = -1;
  std::vector<uint8_t> codes_;
};

// The block's queries side by side, as the SIMD loops take them.
void GatherRows(const std::vector<Row>& all, const Unit& u, int d, int padded, UnitScratch& sc) {
  const int nr = u.rows;
  sc.q.resize(static_cast<size_t>(nr) * d);
  sc.qr.resize(sc.q.size());
  sc.ma.resize(static_cast<size_t>(nr) * padded);
  sc.mb.resize(sc.ma.size());
  sc.fixed.resize(nr);
  for (int k = 0; k < nr; ++k) {
    const Row& r = all[u.row0 + k];
    std::copy_n(r.q.data(), d, sc.q.data() + static_cast<size_t>(k) * d);
    std::copy_n(r.qr.data(), d, sc.qr.data() + static_cast<size_t>(k) * d);
    std::copy_n(r.a.data(), padded, sc.ma.data() + static_cast<size_t>(k) * padded);
    std::copy_n(r.b.data(), padded, sc.mb.data() + static_cast<size_t>(k) * padded);
    sc.fixed[k] = static_cast<float>(r.fixed);
  }
}

// The RoPE angles of the mean term for a unit's tiles of keys. The angle
// is linear in the position, so each pair turns by a fixed step: the walk
// starts exact at the chunk's first key and steps in double (a few hundred
// steps at most).
//  * per_key (the fold, which turns each key's mean by its own angles):
//    every key's angles, walked key by key, tile-major in cs() / sn().
//  * otherwise: only each tile's first key's angles are walked, a tile at a
//    time; cs() / sn() are the constant offsets of the tile's keys (i steps
//    for key i), and Turn() turns every row's mean-term coefficients by the
//    first key's angles instead, since a cos(x + y) + b sin(x + y) =
//    (a cos x + b sin x) cos y + (b cos x - a sin x) sin y: per tile one
//    turn per row and pair, not one walk step per key and pair.
class TileAngles {
 public:
  TileAngles(const Rope& rope, int begin, bool per_key, UnitScratch& sc)
      : per_key_(per_key), pairs_(rope.rotary_dim() / 2), padded_(PadToLanes(pairs_)), sc_(sc) {
    sc.cs.resize(pairs_);
    sc.sn.resize(pairs_);
    sc.step_c.resize(pairs_);
    sc.step_s.resize(pairs_);
    sc.tile_cs.resize(static_cast<size_t>(padded_) * kCrqTile);
    sc.tile_sn.resize(sc.tile_cs.size());
    // A row per key (zero past the pairs and for keys past the chunk),
    // turned to tile-major once the tile is walked.
    sc.key_cs.assign(static_cast<size_t>(padded_) * kCrqTile, 0.0f);
    sc.key_sn.assign(sc.key_cs.size(), 0.0f);
    std::vector<double> steps(pairs_);
    for (int j = 0; j < pairs_; ++j) {
      steps[j] = rope.Angle(j, 1.0) - rope.Angle(j, 0.0);
      sc.step_c[j] = std::cos(steps[j]);
      sc.step_s[j] = std::sin(steps[j]);
    }
    if (!per_key) {
      // The keys' offsets inside a tile: a tile's walk from angle 0.
      std::fill(sc.cs.begin(), sc.cs.end(), 1.0);
      std::fill(sc.sn.begin(), sc.sn.end(), 0.0);
      WalkKeys(kCrqTile);
      sc.first_cs.assign(padded_, 0.0f);
      sc.first_sn.assign(padded_, 0.0f);
    }
    const int stride = per_key ? 1 : kCrqTile;
    for (int j = 0; j < pairs_; ++j) {
      const double a0 = rope.Angle(j, begin);
      sc.cs[j] = std::cos(a0);
      sc.sn[j] = std::sin(a0);
      if (!per_key) {
        sc.step_c[j] = std::cos(stride * steps[j]);
        sc.step_s[j] = std::sin(stride * steps[j]);
      }
    }
  }

  // Walks on to the next tile, of m keys.
  void Next(int m) {
    if (per_key_) {
      WalkKeys(m);
      return;
    }
    UnitScratch& sc = sc_;
    CrqRopeWalk(sc.cs.data(), sc.sn.data(), sc.step_c.data(), sc.step_s.data(), pairs_,
                sc.first_cs.data(), sc.first_sn.data());
  }

  // The angles CrqTileScores / CrqTileFoldMean take (pairs x kCrqTile).
  const float* cs() const { return sc_.tile_cs.data(); }
  const float* sn() const { return sc_.tile_sn.data(); }

  // Not per_key: the rows' coefficients (nr x padded) turned to this tile.
  void Turn(const float* a, const float* b, int nr, float* ta, float* tb) const {
    CrqTurnPairs(a, b, nr, padded_, sc_.first_cs.data(), sc_.first_sn.data(), ta, tb);
  }

  // Key i's angle of pair j in this tile (for the fp16 keys).
  float KeyCos(int j, int i) const {
    const size_t at = static_cast<size_t>(j) * kCrqTile + i;
    if (per_key_) return sc_.tile_cs[at];
    return sc_.first_cs[j] * sc_.tile_cs[at] - sc_.first_sn[j] * sc_.tile_sn[at];
  }
  float KeySin(int j, int i) const {
    const size_t at = static_cast<size_t>(j) * kCrqTile + i;
    if (per_key_) return sc_.tile_sn[at];
    return sc_.first_sn[j] * sc_.tile_cs[at] + sc_.first_cs[j] * sc_.tile_sn[at];
  }

 private:
  // The angles of m keys from the walk's state, a step each, into cs() /
  // sn() (keys past m zero).
  void WalkKeys(int m) {
    UnitScratch& sc = sc_;
    for (int i = 0; i < kCrqTile; ++i) {
      float* key_cs = sc.key_cs.data() + static_cast<size_t>(i) * padded_;
      float* key_sn = sc.key_sn.data() + static_cast<size_t>(i) * padded_;
      if (i < m) {
        CrqRopeWalk(sc.cs.data(), sc.sn.data(), sc.step_c.data(), sc.step_s.data(), pairs_,
                    key_cs, key_sn);
      } else {
        std::fill_n(key_cs, pairs_, 0.0f);
        std::fill_n(key_sn, pairs_, 0.0f);
      }
    }
    CrqTransposeTile(sc.key_cs.data(), padded_, padded_, sc.tile_cs.data());
    CrqTransposeTile(sc.key_sn.data(), padded_, padded_, sc.tile_sn.data());
  }

  const bool per_key_;
  const int pairs_;
  const int padded_;
  UnitScratch& sc_;
};

// Scores of every (row, key) of the unit into sc.scores ([row][ns], ns the
// keys padded to whole tiles), a tile of keys at a time: coded keys decoded
// to levels (gain 1: the gain scales the dots) and stored coordinate-major,
// the mean term at their RoPE angles (TileAngles); fp16 keys (sink, tail)
// turned by RoPE and dotted with the post-RoPE queries.
void ScoreKeys(const Unit& u, const KvStream& s, UnitRows& rows, int ns, UnitScratch& sc) {
  const Rope& rope = s.crq()->rope();
  const int d = s.head_dim();
  const int n = u.end - u.begin;
  const int nr = u.rows;
  const int pairs = rope.rotary_dim() / 2;
  const int padded = PadToLanes(pairs);
  sc.scores.resize(static_cast<size_t>(nr) * ns);
  sc.x.resize(d);
  sc.rows.resize(static_cast<size_t>(kCrqTile) * d);
  sc.levels.resize(sc.rows.size());
  sc.gain.resize(kCrqTile);
  std::vector<float> dots(nr);
  const CrqRowLevels levels = RowLevels(s.layout().key.half_bits);
  const bool fold = nr >= kFoldRows;
  TileAngles angles(rope, u.begin, /*per_key=*/fold, sc);
  if (!fold) {
    sc.turned_a.resize(static_cast<size_t>(nr) * padded);
    sc.turned_b.resize(sc.turned_a.size());
  } else {
    const HeadCalibration& cal = s.crq()->calibration();
    const std::vector<float>& signs = s.crq()->rotation().signs();
    const float norm = hd::HadamardNorm(d);  // HadamardRotation's.
    sc.mu.resize(d);
    sc.signs_norm.resize(d);
    for (int c = 0; c < d; ++c) {
      sc.mu[c] = cal.key_mean[c] / cal.key_scale[c];
      sc.signs_norm[c] = signs[c] * norm;
    }
    sc.first.resize(pairs);
    sc.second.resize(pairs);
    for (int j = 0; j < pairs; ++j) {
      sc.first[j] = rope.First(j);
      sc.second[j] = rope.Second(j);
    }
    sc.folded.resize(static_cast<size_t>(kCrqTile) * d);
    sc.unit_gain.assign(kCrqTile, 1.0f);
    sc.no_fixed.assign(nr, 0.0f);
  }
  for (int i0 = 0; i0 < n; i0 += kCrqTile) {
    const int m = std::min(kCrqTile, n - i0);
    bool any_coded = false;
    angles.Next(m);
    for (int i = 0; i < kCrqTile; ++i) {
      const int t = u.begin + i0 + i;
      float* row = sc.rows.data() + static_cast<size_t>(i) * d;
      if (i < m && rows.Coded(t)) {
        sc.gain[i] = rows.Decode(Side::kKey, t, levels, /*stored_gain=*/false, row);
        any_coded = true;
      } else {
        sc.gain[i] = 0.0f;
        std::fill_n(row, d, 0.0f);
      }
    }
    if (any_coded) CrqTransposeTile(sc.rows.data(), d, d, sc.levels.data());
    float* const scores = sc.scores.data() + i0;
    if (any_coded && fold) {
      CrqTileFoldMean(sc.levels.data(), sc.gain.data(), angles.cs(), angles.sn(),
                      sc.first.data(), sc.second.data(), pairs, sc.mu.data(),
                      sc.signs_norm.data(), d, sc.folded.data());
      CrqTileScores(sc.folded.data(), sc.unit_gain.data(), nullptr, nullptr, 0, d, sc.qr.data(), d,
                    nullptr, nullptr, 0, sc.no_fixed.data(), nr, scores, ns);
    } else if (any_coded) {
      angles.Turn(sc.ma.data(), sc.mb.data(), nr, sc.turned_a.data(), sc.turned_b.data());
      CrqTileScores(sc.levels.data(), sc.gain.data(), angles.cs(), angles.sn(), pairs, d,
                    sc.qr.data(), d, sc.turned_a.data(), sc.turned_b.data(), padded,
                    sc.fixed.data(), nr, scores, ns);
    }
    for (int i = 0; i < m; ++i) {
      const int t = u.begin + i0 + i;
      if (rows.Coded(t)) continue;
      // Rope::Apply at t, with the walked angles instead of sin / cos calls.
      s.ReadStoredRow(Side::kKey, t, sc.x.data());
      for (int j = 0; j < pairs; ++j) {
        float& x0 = sc.x[rope.First(j)];
        float& x1 = sc.x[rope.Second(j)];
        const float c = angles.KeyCos(j, i);
        const float sn = angles.KeySin(j, i);
        const float r0 = x0 * c - x1 * sn;
        const float r1 = x0 * sn + x1 * c;
        x0 = r0;
        x1 = r1;
      }
      CrqDots(sc.x.data(), sc.q.data(), d, nr, d, dots.data());
      for (int k = 0; k < nr; ++k) scores[static_cast<size_t>(k) * ns + i] = dots[k];
    }
  }
}

// Scores become softmax weights in place, zero past a row's visible end,
// with their maximum (sc.mx) and their sums over all keys and over coded
// ones (sc.sum, sc.sum_coded).
void Softmax(const std::vector<Row>& all, const Unit& u, const UnitRows& rows, int ns,
             UnitScratch& sc) {
  const int n = u.end - u.begin;
  const int nr = u.rows;
  const int coded_lo = std::clamp(rows.coded_begin() - u.begin, 0, n);
  const int coded_hi = std::clamp(rows.coded_end() - u.begin, coded_lo, n);
  sc.mx.resize(nr);
  sc.sum.assign(nr, 0.0);
  sc.sum_coded.assign(nr, 0.0);
  for (int k = 0; k < nr; ++k) {
    float* w = sc.scores.data() + static_cast<size_t>(k) * ns;
    const int visible = std::clamp(all[u.row0 + k].visible_end - u.begin, 0, n);
    sc.mx[k] = CrqMax(w, visible);
    CrqExpShifted(w, visible, sc.mx[k]);
    std::fill(w + visible, w + ns, 0.0f);
    sc.sum[k] = CrqSum(w, visible);
    const int hi = std::min(coded_hi, visible);
    if (hi > coded_lo) sc.sum_coded[k] = CrqSum(w + coded_lo, hi - coded_lo);
  }
}

// The weighted sums of the values into sc.sums: fp16 rows in the original
// basis ([0, nr * d)), coded rows in the rotated one ([nr * d, 2 nr * d)),
// a tile of rows at a time.
void AccumulateValues(const Unit& u, const KvStream& s, UnitRows& rows, int ns,
                      UnitScratch& sc) {
  const int d = s.head_dim();
  const int n = u.end - u.begin;
  const int nr = u.rows;
  sc.sums.assign(2 * static_cast<size_t>(nr) * d, 0.0f);
  float* const acc = sc.sums.data();
  float* const acc_coded = acc + static_cast<size_t>(nr) * d;
  std::vector<float> weight(nr);
  const CrqRowLevels levels = RowLevels(s.layout().value.half_bits);
  for (int i0 = 0; i0 < n; i0 += kCrqTile) {
    const int m = std::min(kCrqTile, n - i0);
    const int t0 = u.begin + i0;
    int coded = 0;
    for (int i = 0; i < m; ++i) {
      float* row = sc.rows.data() + static_cast<size_t>(i) * d;
      if (rows.Coded(t0 + i)) {
        rows.Decode(Side::kValue, t0 + i, levels, /*stored_gain=*/true, row);
        ++coded;
      } else {
        s.ReadStoredRow(Side::kValue, t0 + i, row);
      }
    }
    const float* w = sc.scores.data() + i0;
    if (coded == 0 || coded == m) {
      CrqTileAxpys(w, ns, nr, sc.rows.data(), m, d, coded ? acc_coded : acc, d);
      continue;
    }
    // A tile on the edge of the coded range: row by row.
    for (int i = 0; i < m; ++i) {
      for (int k = 0; k < nr; ++k) weight[k] = w[static_cast<size_t>(k) * ns + i];
      CrqAxpys(weight.data(), nr, sc.rows.data() + static_cast<size_t>(i) * d, d,
               rows.Coded(t0 + i) ? acc_coded : acc, d);
    }
  }
}

void RunUnit(const AttentionOptions& options, const std::vector<Row>& all, Unit& u) {
  const KvStream& s = *all[u.row0].task->stream;
  const CrqTransform& T = *s.crq();
  const HeadCalibration& cal = T.calibration();
  const int d = s.head_dim();
  const int n = u.end - u.begin;
  const int nr = u.rows;
  u.out.assign(static_cast<size_t>(nr) * d, 0.0f);
  u.lse.assign(nr, -std::numeric_limits<float>::infinity());
  if (n <= 0) return;
  UnitScratch& sc = ThreadUnitScratch();
  UnitRows rows(s, options);
  const int ns = PadToLanes(n);
  GatherRows(all, u, d, PadToLanes(T.rope().rotary_dim() / 2), sc);
  ScoreKeys(u, s, rows, ns, sc);
  Softmax(all, u, rows, ns, sc);
  AccumulateValues(u, s, rows, ns, sc);
  // The coded sum mapped back to the original basis, centered and scaled.
  const float* acc = sc.sums.data();
  float* acc_coded = sc.sums.data() + static_cast<size_t>(nr) * d;
  for (int k = 0; k < nr; ++k) {
    if (sc.sum[k] == 0.0) continue;  // No key of the chunk is visible to this row.
    const float inv = static_cast<float>(1.0 / sc.sum[k]);
    float* ac = acc_coded + static_cast<size_t>(k) * d;
    for (int c = 0; c < d; ++c) ac[c] *= inv;
    T.rotation().Inverse(ac);
    const float coded_share = static_cast<float>(sc.sum_coded[k] / sc.sum[k]);
    const float* ao = acc + static_cast<size_t>(k) * d;
    float* o = u.out.data() + static_cast<size_t>(k) * d;
    for (int c = 0; c < d; ++c) {
      o[c] = ao[c] * inv + cal.value_mean[c] * coded_share + cal.value_scale[c] * ac[c];
    }
    u.lse[k] = sc.mx[k] + static_cast<float>(std::log(sc.sum[k]));
  }
}

}  // namespace

void QuantizeCrqRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                     int row0) {
  const SideLayout& S = s.layout().side(side);
  const int d = s.head_dim();
  const hd::CrqCodebooks& cb = CrqCodebooks();
  std::vector<uint8_t> codes(d);
  for (int r = 0; r < n; ++r) {
    hd::CrqStoreRow(rows + static_cast<size_t>(r) * d, d, S.half_bits, cb, codes.data(),
                    PageLayout::CodeRow(page, S, row0 + r),
                    reinterpret_cast<uint8_t*>(PageLayout::Gain(page, S, row0 + r)));
  }
}

void DequantizeCrqRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                       float* out) {
  const SideLayout& S = s.layout().side(side);
  const int d = s.head_dim();
  const CrqRowLevels levels = RowLevels(S.half_bits);
  std::vector<uint8_t> codes(d);
  for (int r = 0; r < n; ++r) {
    const float gain = HalfToFloat(*PageLayout::Gain(page, S, row0 + r));
    CrqDecodeRow(PageLayout::CodeRow(page, S, row0 + r), d, S.half_bits, levels, gain,
                 codes.data(), out + static_cast<size_t>(r) * d);
  }
}

void AttendCrq(absl::Span<const AttentionTask> tasks, const AttentionOptions& options,
               bool parallel) {
  std::vector<Row> rows;
  for (const AttentionTask& t : tasks) {
    const int end = TaskEnd(t);
    for (int i = 0; i < t.num_queries; ++i) {
      for (int g = 0; g < options.group_size; ++g) {
        Row& r = rows.emplace_back();
        r.task = &t;
        r.query = i;
        r.head = g;
        r.visible_end = t.q_positions ? std::min(end, t.q_positions[i] + 1) : end;
      }
    }
  }
  // Blocks: runs of whole queries of one task (rows are task by task,
  // query by query); units: a block's chunks of the keys its rows see.
  std::vector<Unit> units;
  std::vector<int> first_unit;  // Per block, its units in order.
  std::vector<int> block_row0;  // Per block, its first row.
  const int group = options.group_size;
  const int block_queries = std::max(1, kBlockRows / group);
  for (int q0 = 0; q0 < static_cast<int>(rows.size());) {
    const AttentionTask* task = rows[q0].task;
    int q1 = q0;
    for (int i = 0; i < block_queries && q1 < static_cast<int>(rows.size()) &&
                    rows[q1].task == task;
         ++i) {
      q1 += group;
    }
    first_unit.push_back(static_cast<int>(units.size()));
    block_row0.push_back(q0);
    const int begin = task->key_begin;
    int end = begin;
    for (int k = q0; k < q1; ++k) end = std::max(end, rows[k].visible_end);
    for (int b = begin; b == begin || b < end; b += kChunkTokens) {
      Unit& u = units.emplace_back();
      u.row0 = q0;
      u.rows = q1 - q0;
      u.begin = b;
      u.end = std::min(end, b + kChunkTokens);
    }
    q0 = q1;
  }
  first_unit.push_back(static_cast<int>(units.size()));
  const int nrows = static_cast<int>(rows.size());
  const int nunits = static_cast<int>(units.size());
#pragma omp parallel for schedule(dynamic, 1) if (parallel && nrows > 1)
  for (int i = 0; i < nrows; ++i) PrepareRow(options, rows[i]);
#pragma omp parallel for schedule(dynamic, 1) if (parallel && nunits > 1)
  for (int i = 0; i < nunits; ++i) RunUnit(options, rows, units[i]);
  for (size_t bi = 0; bi + 1 < first_unit.size(); ++bi) {
    const Unit& u0 = units[first_unit[bi]];
    for (int k = 0; k < u0.rows; ++k) {
      const Row& r = rows[block_row0[bi] + k];
      const AttentionTask& t = *r.task;
      const int d = t.stream->head_dim();
      float* out = t.out + static_cast<size_t>(r.query) * t.out_stride + static_cast<size_t>(r.head) * d;
      float* lse = t.lse + static_cast<size_t>(r.query) * t.lse_stride + r.head;
      std::copy_n(u0.out.data() + static_cast<size_t>(k) * d, d, out);
      *lse = u0.lse[k];
      for (int m = first_unit[bi] + 1; m < first_unit[bi + 1]; ++m) {
        MergeAttention(out, *lse, units[m].out.data() + static_cast<size_t>(k) * d, units[m].lse[k],
                       d, out, lse);
      }
    }
  }
}

}  // namespace kvq::cpu
