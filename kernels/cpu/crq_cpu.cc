#include "kernels/cpu/crq_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/simd_crq.h"
#include "kernels/crq_transform.h"
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
// query (its GQA group: they share the keys they see), so each code row is
// unpacked once for all of them.
struct Unit {
  int row0 = 0;
  int rows = 0;
  int begin = 0;
  int end = 0;
  std::vector<float> out;  // [rows][d], original basis, normalized.
  std::vector<float> lse;  // [rows]
};

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

void RunUnit(const AttentionOptions& options, const std::vector<Row>& all, Unit& u) {
  const Row& first = all[u.row0];
  const KvStream& s = *first.task->stream;
  const CrqTransform& T = *s.crq();
  const HeadCalibration& cal = T.calibration();
  const Rope& rope = T.rope();
  const PageLayout& L = s.layout();
  const int d = s.head_dim();
  const int pt = L.page_tokens;
  const int n = u.end - u.begin;
  const int nr = u.rows;
  u.out.assign(static_cast<size_t>(nr) * d, 0.0f);
  u.lse.assign(nr, -std::numeric_limits<float>::infinity());
  if (n <= 0) return;
  const int pairs = rope.rotary_dim() / 2;
  // RoPE of the mean term walks position by position: the angle is linear
  // in the position, so each pair turns by a fixed step (exact at the
  // chunk's start, a few hundred steps at most in double).
  std::vector<double> cs(pairs), sn(pairs), step_c(pairs), step_s(pairs);
  for (int j = 0; j < pairs; ++j) {
    const double a0 = rope.Angle(j, u.begin);
    cs[j] = std::cos(a0);
    sn[j] = std::sin(a0);
    const double st = rope.Angle(j, 1.0) - rope.Angle(j, 0.0);
    step_c[j] = std::cos(st);
    step_s[j] = std::sin(st);
  }
  auto coded = [&](int t) { return t >= s.sink_tokens() && t - s.page_base() < s.quantized_tokens(); };
  int checked_page = -1;
  auto page_of = [&](int t, int* row) {
    const int v = t - s.page_base();
    *row = v % pt;
    if (options.page_check != nullptr && v / pt != checked_page) {
      checked_page = v / pt;
      options.page_check->Check(s, checked_page);
    }
    return s.page(v / pt);
  };
  // The group's queries side by side, as the SIMD loops take them.
  const int padded = PadToLanes(pairs);
  std::vector<float> q(static_cast<size_t>(nr) * d), qr(q.size());
  std::vector<float> ma(static_cast<size_t>(nr) * padded), mb(ma.size());
  // Per row of the group: the fixed mean term, the dots and mean terms of
  // one key, one value's softmax weight.
  std::vector<float> per_row(static_cast<size_t>(nr) * 4);
  float* const fixed = per_row.data();
  float* const dots = fixed + nr;
  float* const means = dots + nr;
  float* const weight = means + nr;
  for (int k = 0; k < nr; ++k) {
    const Row& r = all[u.row0 + k];
    std::copy_n(r.q.data(), d, q.data() + static_cast<size_t>(k) * d);
    std::copy_n(r.qr.data(), d, qr.data() + static_cast<size_t>(k) * d);
    std::copy_n(r.a.data(), padded, ma.data() + static_cast<size_t>(k) * padded);
    std::copy_n(r.b.data(), padded, mb.data() + static_cast<size_t>(k) * padded);
    fixed[k] = static_cast<float>(r.fixed);
  }
  std::vector<float> scores(static_cast<size_t>(nr) * n), x(d);
  std::vector<uint8_t> codes(d);
  std::vector<float> mx(nr, -std::numeric_limits<float>::infinity());
  // This token's cos / sin per pair in float, zero-padded for CrqMeanDots.
  std::vector<float> csf(padded, 0.0f), snf(padded, 0.0f);
  // A key row decoded to levels once (gain 1: the gain scales the dots),
  // scored by every row of the group.
  const CrqRowLevels key_levels = RowLevels(L.key.half_bits);
  std::vector<float> decoded(d);
  for (int i = 0; i < n; ++i) {
    const int t = u.begin + i;
    CrqRopeWalk(cs.data(), sn.data(), step_c.data(), step_s.data(), pairs, csf.data(), snf.data());
    if (coded(t)) {
      int row;
      const uint8_t* page = page_of(t, &row);
      const float gain = HalfToFloat(*PageLayout::Gain(page, L.key, row));
      CrqDecodeRow(PageLayout::CodeRow(page, L.key, row), d, L.key.half_bits, key_levels, 1.0f,
                   codes.data(), decoded.data());
      CrqDots(decoded.data(), qr.data(), d, nr, d, dots);
      CrqMeanDots(ma.data(), mb.data(), padded, nr, csf.data(), snf.data(), padded, means);
      for (int k = 0; k < nr; ++k) {
        scores[static_cast<size_t>(k) * n + i] = (fixed[k] + means[k]) + gain * dots[k];
      }
    } else {
      // Rope::Apply at t, with the walked angles instead of sin / cos calls.
      s.ReadStoredRow(Side::kKey, t, x.data());
      for (int j = 0; j < pairs; ++j) {
        float& x0 = x[rope.First(j)];
        float& x1 = x[rope.Second(j)];
        const float r0 = x0 * csf[j] - x1 * snf[j];
        const float r1 = x0 * snf[j] + x1 * csf[j];
        x0 = r0;
        x1 = r1;
      }
      CrqDots(x.data(), q.data(), d, nr, d, dots);
      for (int k = 0; k < nr; ++k) scores[static_cast<size_t>(k) * n + i] = dots[k];
    }
    for (int k = 0; k < nr; ++k) {
      if (t < all[u.row0 + k].visible_end) mx[k] = std::max(mx[k], scores[static_cast<size_t>(k) * n + i]);
    }
  }
  // Sums of fp16 rows in the original basis, then of coded rows in the
  // rotated one.
  std::vector<float> sums(2 * static_cast<size_t>(nr) * d, 0.0f);
  float* const acc = sums.data();
  float* const acc_coded = acc + static_cast<size_t>(nr) * d;
  // Scores become softmax weights in place, zero past a row's visible end.
  for (int k = 0; k < nr; ++k) {
    float* w = scores.data() + static_cast<size_t>(k) * n;
    const int visible = std::clamp(all[u.row0 + k].visible_end - u.begin, 0, n);
    CrqExpShifted(w, visible, mx[k]);
    std::fill(w + visible, w + n, 0.0f);
  }
  const CrqRowLevels value_levels = RowLevels(L.value.half_bits);
  std::vector<double> sum(nr, 0.0), sum_coded(nr, 0.0);
  for (int i = 0; i < n; ++i) {
    const int t = u.begin + i;
    const bool from_pages = coded(t);
    if (from_pages) {
      int row;
      const uint8_t* page = page_of(t, &row);
      const float gain = HalfToFloat(*PageLayout::Gain(page, L.value, row));
      CrqDecodeRow(PageLayout::CodeRow(page, L.value, row), d, L.value.half_bits, value_levels,
                   gain, codes.data(), decoded.data());
    } else {
      s.ReadStoredRow(Side::kValue, t, x.data());
    }
    for (int k = 0; k < nr; ++k) {
      const float p = scores[static_cast<size_t>(k) * n + i];
      weight[k] = p;
      sum[k] += p;
      if (from_pages) sum_coded[k] += p;
    }
    // Coded rows accumulate in the rotated basis, mapped back once below.
    if (from_pages) {
      CrqAxpys(weight, nr, decoded.data(), d, acc_coded, d);
    } else {
      CrqAxpys(weight, nr, x.data(), d, acc, d);
    }
  }
  for (int k = 0; k < nr; ++k) {
    if (sum[k] == 0.0) continue;  // No key of the chunk is visible to this row.
    const float inv = static_cast<float>(1.0 / sum[k]);
    float* ac = acc_coded + static_cast<size_t>(k) * d;
    for (int c = 0; c < d; ++c) ac[c] *= inv;
    T.rotation().Inverse(ac);
    const float coded_share = static_cast<float>(sum_coded[k] / sum[k]);
    const float* ao = acc + static_cast<size_t>(k) * d;
    float* o = u.out.data() + static_cast<size_t>(k) * d;
    for (int c = 0; c < d; ++c) {
      o[c] = ao[c] * inv + cal.value_mean[c] * coded_share + cal.value_scale[c] * ac[c];
    }
    u.lse[k] = mx[k] + static_cast<float>(std::log(sum[k]));
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
  // Units: per query (its group's rows), chunks of the keys its rows see.
  std::vector<Unit> units;
  std::vector<int> first_unit;  // Per query, its units in order.
  std::vector<int> unit_query;
  const int group = options.group_size;
  for (int q0 = 0; q0 < static_cast<int>(rows.size()); q0 += group) {
    first_unit.push_back(static_cast<int>(units.size()));
    const int begin = rows[q0].task->key_begin;
    int end = begin;
    for (int k = 0; k < group; ++k) end = std::max(end, rows[q0 + k].visible_end);
    for (int b = begin; b == begin || b < end; b += kChunkTokens) {
      Unit& u = units.emplace_back();
      u.row0 = q0;
      u.rows = group;
      u.begin = b;
      u.end = std::min(end, b + kChunkTokens);
    }
  }
  first_unit.push_back(static_cast<int>(units.size()));
  const int nrows = static_cast<int>(rows.size());
  const int nunits = static_cast<int>(units.size());
#pragma omp parallel for schedule(dynamic, 1) if (parallel && nrows > 1)
  for (int i = 0; i < nrows; ++i) PrepareRow(options, rows[i]);
#pragma omp parallel for schedule(dynamic, 1) if (parallel && nunits > 1)
  for (int i = 0; i < nunits; ++i) RunUnit(options, rows, units[i]);
  for (size_t qi = 0; qi + 1 < first_unit.size(); ++qi) {
    for (int k = 0; k < group; ++k) {
      const Row& r = rows[qi * group + k];
      const AttentionTask& t = *r.task;
      const int d = t.stream->head_dim();
      float* out = t.out + static_cast<size_t>(r.query) * t.out_stride + static_cast<size_t>(r.head) * d;
      float* lse = t.lse + static_cast<size_t>(r.query) * t.lse_stride + r.head;
      const Unit& u0 = units[first_unit[qi]];
      std::copy_n(u0.out.data() + static_cast<size_t>(k) * d, d, out);
      *lse = u0.lse[k];
      for (int m = first_unit[qi] + 1; m < first_unit[qi + 1]; ++m) {
        MergeAttention(out, *lse, units[m].out.data() + static_cast<size_t>(k) * d, units[m].lse[k],
                       d, out, lse);
      }
    }
  }
}

}  // namespace kvq::cpu
