#include "kernels/cpu/crq_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/crq_transform.h"
#include "kernels/hd/crq_hd.h"
#include "kernels/numeric.h"

namespace kvq::cpu {
namespace {

// Codes per coordinate of one packed row (both halves unpacked).
void UnpackRow(const uint8_t* row, int d, int half_bits, uint8_t* codes) {
  const int h = d / 2;
  const int hi = hd::CrqHiBits(half_bits);
  UnpackCodes(row, h, hi, codes);
  UnpackCodes(row + h * hi / 8, h, hd::CrqLoBits(half_bits), codes + h);
}

// Per coordinate, the 16 slots of a look-up table: levels (or a query's
// products with them) of that coordinate's width, unused slots zero.
constexpr int kSlots = 16;
void FillLevels(int d, int half_bits, const float* weight, float* table) {
  const hd::CrqCodebooks& cb = CrqCodebooks();
  for (int c = 0; c < d; ++c) {
    const int bits = hd::CrqBitsAt(half_bits, d, c);
    const float* levels = hd::CrqLevels(cb, bits);
    float* t = table + static_cast<size_t>(c) * kSlots;
    for (int i = 0; i < kSlots; ++i) {
      t[i] = i < (1 << bits) ? (weight ? weight[c] * levels[i] : levels[i]) : 0.0f;
    }
  }
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
  std::vector<float> table;  // [d][kSlots]: q'_c * level (q' = H (s_k q)).
  std::vector<double> a, b;  // Mean term per RoPE pair.
  double fixed = 0.0;        // Mean term of channels that do not rotate.
};

struct Unit {
  int row = 0;
  int begin = 0;
  int end = 0;
  std::vector<float> out;  // Original basis, normalized.
  float lse = 0.0f;
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
  std::vector<float> qr(d);
  for (int c = 0; c < d; ++c) qr[c] = r.q[c] * cal.key_scale[c];
  T.rotation().Forward(qr.data());
  r.table.resize(static_cast<size_t>(d) * kSlots);
  FillLevels(d, s.layout().key.half_bits, qr.data(), r.table.data());
  const int pairs = rope.rotary_dim() / 2;
  r.a.resize(pairs);
  r.b.resize(pairs);
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

void RunUnit(const AttentionOptions& options, const Row& r, Unit& u) {
  const KvStream& s = *r.task->stream;
  const CrqTransform& T = *s.crq();
  const HeadCalibration& cal = T.calibration();
  const Rope& rope = T.rope();
  const PageLayout& L = s.layout();
  const int d = s.head_dim();
  const int pt = L.page_tokens;
  const int n = u.end - u.begin;
  u.out.assign(d, 0.0f);
  if (n <= 0) {
    u.lse = -std::numeric_limits<float>::infinity();
    return;
  }
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
  std::vector<float> scores(n), x(d);
  std::vector<uint8_t> codes(d);
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) {
    const int t = u.begin + i;
    float score;
    if (coded(t)) {
      int row;
      const uint8_t* page = page_of(t, &row);
      UnpackRow(PageLayout::CodeRow(page, L.key, row), d, L.key.half_bits, codes.data());
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot += r.table[static_cast<size_t>(c) * kSlots + codes[c]];
      double mean = r.fixed;
      for (int j = 0; j < pairs; ++j) mean += r.a[j] * cs[j] + r.b[j] * sn[j];
      score = static_cast<float>(mean) + HalfToFloat(*PageLayout::Gain(page, L.key, row)) * dot;
    } else {
      s.ReadStoredRow(Side::kKey, t, x.data());
      rope.Apply(x.data(), t);
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot += r.q[c] * x[c];
      score = dot;
    }
    for (int j = 0; j < pairs; ++j) {
      const double c0 = cs[j];
      cs[j] = c0 * step_c[j] - sn[j] * step_s[j];
      sn[j] = c0 * step_s[j] + sn[j] * step_c[j];
    }
    scores[i] = score;
    mx = std::max(mx, score);
  }
  std::vector<float> acc(d, 0.0f), acc_coded(d, 0.0f), levels(static_cast<size_t>(d) * kSlots);
  FillLevels(d, L.value.half_bits, nullptr, levels.data());
  double sum = 0.0, sum_coded = 0.0;
  for (int i = 0; i < n; ++i) {
    const int t = u.begin + i;
    const float p = std::exp(scores[i] - mx);
    sum += p;
    if (coded(t)) {
      int row;
      const uint8_t* page = page_of(t, &row);
      UnpackRow(PageLayout::CodeRow(page, L.value, row), d, L.value.half_bits, codes.data());
      const float w = p * HalfToFloat(*PageLayout::Gain(page, L.value, row));
      for (int c = 0; c < d; ++c) acc_coded[c] += w * levels[static_cast<size_t>(c) * kSlots + codes[c]];
      sum_coded += p;
    } else {
      s.ReadStoredRow(Side::kValue, t, x.data());
      for (int c = 0; c < d; ++c) acc[c] += p * x[c];
    }
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int c = 0; c < d; ++c) acc_coded[c] *= inv;
  T.rotation().Inverse(acc_coded.data());
  const float coded_share = static_cast<float>(sum_coded / sum);
  for (int c = 0; c < d; ++c) {
    u.out[c] = acc[c] * inv + cal.value_mean[c] * coded_share + cal.value_scale[c] * acc_coded[c];
  }
  u.lse = mx + static_cast<float>(std::log(sum));
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
  std::vector<float> levels(static_cast<size_t>(d) * kSlots);
  FillLevels(d, S.half_bits, nullptr, levels.data());
  std::vector<uint8_t> codes(d);
  for (int r = 0; r < n; ++r) {
    UnpackRow(PageLayout::CodeRow(page, S, row0 + r), d, S.half_bits, codes.data());
    const float gain = HalfToFloat(*PageLayout::Gain(page, S, row0 + r));
    float* o = out + static_cast<size_t>(r) * d;
    for (int c = 0; c < d; ++c) o[c] = gain * levels[static_cast<size_t>(c) * kSlots + codes[c]];
  }
}

void AttendCrq(absl::Span<const AttentionTask> tasks, const AttentionOptions& options) {
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
  std::vector<Unit> units;
  std::vector<int> first_unit(rows.size() + 1);
  for (size_t i = 0; i < rows.size(); ++i) {
    first_unit[i] = static_cast<int>(units.size());
    const int begin = rows[i].task->key_begin;
    const int end = std::max(begin, rows[i].visible_end);
    for (int b = begin; b < end || b == begin; b += kChunkTokens) {
      Unit& u = units.emplace_back();
      u.row = static_cast<int>(i);
      u.begin = b;
      u.end = std::min(end, b + kChunkTokens);
      if (end == begin) break;
    }
  }
  first_unit[rows.size()] = static_cast<int>(units.size());
  const int nrows = static_cast<int>(rows.size());
  const int nunits = static_cast<int>(units.size());
#pragma omp parallel for schedule(dynamic, 1) if (nrows > 1)
  for (int i = 0; i < nrows; ++i) PrepareRow(options, rows[i]);
#pragma omp parallel for schedule(dynamic, 1) if (nunits > 1)
  for (int i = 0; i < nunits; ++i) RunUnit(options, rows[units[i].row], units[i]);
  for (int i = 0; i < nrows; ++i) {
    const Row& r = rows[i];
    const AttentionTask& t = *r.task;
    const int d = t.stream->head_dim();
    std::vector<float> merged = units[first_unit[i]].out;
    float lse = units[first_unit[i]].lse;
    for (int k = first_unit[i] + 1; k < first_unit[i + 1]; ++k) {
      MergeAttention(merged.data(), lse, units[k].out.data(), units[k].lse, d, merged.data(), &lse);
    }
    // Scores carried the softmax scale already; lse is of the scaled scores.
    float* out = t.out + static_cast<size_t>(r.query) * t.out_stride + static_cast<size_t>(r.head) * d;
    std::copy(merged.begin(), merged.end(), out);
    t.lse[static_cast<size_t>(r.query) * t.lse_stride + r.head] = lse;
  }
}

}  // namespace kvq::cpu
