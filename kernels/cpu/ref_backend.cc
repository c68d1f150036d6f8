// The scalar reference backend: every kernel written the obvious way, with
// fp64 accumulation in attention. It is the truth the other backends are
// tested against, not a fast path.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/outliers.h"
#include "kernels/cpu/ref_kernels.h"
#include "kernels/cpu/quant_math.h"
#include "kernels/cpu/range_fit.h"
#include "kernels/crq_transform.h"
#include "kernels/group_params.h"
#include "kernels/lloyd_max.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

// The nuq codebook of every channel of one side as floats, levels[c][code];
// empty for uniform codes.
std::vector<std::vector<float>> ChannelLevels(const KvStream& s, Side side) {
  std::vector<std::vector<float>> levels;
  if (!s.spec().nuq) return levels;
  const int n = 1 << s.spec().bits;
  for (int c = 0; c < s.layout().head_dim; ++c) {
    const uint16_t* h = s.levels(side, c);
    std::vector<float>& l = levels.emplace_back(n);
    for (int i = 0; i < n; ++i) l[i] = HalfToFloat(h[i]);
  }
  return levels;
}

void QuantizeAffineRef(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                       int row0) {
  const PageLayout& L = s.layout();
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  const int bits = S.bits;
  const bool nuq = s.spec().nuq;
  const std::vector<std::vector<float>> levels = ChannelLevels(s, side);
  auto code_of = [&](float x, const GroupParams& p, int c) {
    return nuq ? NearestLevel(x, p, levels[c].data(), 1 << bits) : UniformCode(x, p, bits);
  };

  std::vector<uint8_t> is_outlier(static_cast<size_t>(n) * d, 0);
  const int g = L.block_tokens;
  if (L.outliers_per_block > 0) {
    for (int b = 0; b < n / g; ++b) {
      const float* block = rows + static_cast<size_t>(b) * g * d;
      std::vector<int> idx = SelectOutliers(block, g, d, S, L.outliers_per_block);
      uint16_t* table = L.Outliers(page, S, (row0 / g) + b);
      for (int e = 0; e < L.outliers_per_block; ++e) {
        is_outlier[static_cast<size_t>(b) * g * d + idx[e]] = 1;
        table[e] = static_cast<uint16_t>(idx[e]);
        table[L.outliers_per_block + e] = FloatToHalf(block[idx[e]]);
      }
    }
  }

  std::vector<uint8_t> codes(static_cast<size_t>(n) * d);
  // A group's range: min/max of its non-outlier elements, or with `fit` (on
  // keys) the least-squares range of them (in element order, as the SIMD
  // path).
  std::vector<float> members;
  auto group_range = [&](auto&& elements) {
    float mn = std::numeric_limits<float>::infinity();
    float mx = -mn;
    members.clear();
    elements([&](size_t i) {
      if (is_outlier[i]) return;
      mn = std::min(mn, rows[i]);
      mx = std::max(mx, rows[i]);
      members.push_back(rows[i]);
    });
    if (mn > mx) mn = mx = 0.0f;  // Every element was an outlier.
    if (FitsRanges(s.spec(), side) && !members.empty()) {
      const FittedRange r =
          FitUniformRange(members.data(), static_cast<int>(members.size()), bits, mn, mx);
      return std::make_pair(r.lo, r.hi);
    }
    return std::make_pair(mn, mx);
  };

  // Parameters are set per entry range: a block of channel groups, or token
  // rows one at a time (fp16 parameters) or a block at a time (p8, whose
  // header spans the block). Each group's range first, then the parameters,
  // then the codes from what a reader will decode.
  const bool channels = S.axis == ParamAxis::kChannelGroups;
  const int np = L.ParamsPerEntry(S);
  const int step = (channels || S.param_bits == 8) ? g : 1;  // Rows per range.
  const int gc = channels ? 1 : S.group_channels;
  std::vector<float> lo, hi, scale, zero;
  for (int r0 = 0; r0 < n; r0 += step) {
    const int entries = channels ? 1 : step;
    lo.assign(static_cast<size_t>(entries) * np, 0.0f);
    hi.assign(lo.size(), 0.0f);
    scale.assign(lo.size(), 0.0f);
    zero.assign(lo.size(), 0.0f);
    // Element i of row r (relative to r0) lies in group k of the range.
    auto group_of = [&](int r, int c) {
      return channels ? c : r * np + c / gc;
    };
    for (int k = 0; k < entries * np; ++k) {
      auto [mn, mx] = group_range([&](auto&& f) {
        if (channels) {
          for (int t = 0; t < g; ++t) f(static_cast<size_t>(r0 + t) * d + k);
        } else {
          const int r = r0 + k / np;
          const int j = k % np;
          for (int c = j * gc; c < (j + 1) * gc; ++c) f(static_cast<size_t>(r) * d + c);
        }
      });
      lo[k] = mn;
      hi[k] = mx;
    }
    StoreGroupParams(L, S, page, channels ? (row0 + r0) / g : row0 + r0, entries, lo.data(),
                     hi.data(), nuq, scale.data(), zero.data());
    for (int r = 0; r < step; ++r) {
      for (int c = 0; c < d; ++c) {
        const size_t i = static_cast<size_t>(r0 + r) * d + c;
        const int k = group_of(r, c);
        codes[i] = code_of(rows[i], GroupParams{scale[k], zero[k]}, c);
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    PackCodes(&codes[static_cast<size_t>(r) * d], d, bits,
              PageLayout::CodeRow(page, S, row0 + r));
  }
}

void DequantizeAffineRef(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                         float* out) {
  const PageLayout& L = s.layout();
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  const int bits = S.bits;
  const bool nuq = s.spec().nuq;
  const std::vector<std::vector<float>> levels = ChannelLevels(s, side);
  const int g = L.block_tokens;
  const bool channels = S.axis == ParamAxis::kChannelGroups;
  const int np = L.ParamsPerEntry(S);
  std::vector<uint8_t> codes(d);
  std::vector<float> params(2 * np);  // scale[np] then zero[np] of the row's entry.
  for (int r = 0; r < n; ++r) {
    const int row = row0 + r;
    UnpackCodes(PageLayout::CodeRow(page, S, row), d, bits, codes.data());
    LoadGroupParams(L, S, page, channels ? row / g : row, 1, params.data());
    for (int c = 0; c < d; ++c) {
      const int k = channels ? c : c / S.group_channels;
      const GroupParams p{params[k], params[np + k]};
      const float level = nuq ? levels[c][codes[c]] : static_cast<float>(codes[c]);
      out[static_cast<size_t>(r) * d + c] = p.zero + p.scale * level;
    }
  }
  if (L.outliers_per_block > 0) {
    for (int b = row0 / g; b <= (row0 + n - 1) / g; ++b) {
      const uint16_t* table = L.Outliers(page, S, b);
      for (int e = 0; e < L.outliers_per_block; ++e) {
        const int row = b * g + table[e] / d;
        if (row < row0 || row >= row0 + n) continue;
        out[static_cast<size_t>(row - row0) * d + table[e] % d] =
            HalfToFloat(table[L.outliers_per_block + e]);
      }
    }
  }
}

// crq: each row's coordinates coded to the nearest Lloyd-Max level of
// their width after dividing by sigma = ||y|| / sqrt(d), with the
// least-squares gain; sums in fp64 and an explicit nearest-level search.
void QuantizeCrqRef(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                    int row0) {
  const SideLayout& S = s.layout().side(side);
  const int d = s.head_dim();
  const int h = d / 2;
  const int bits[2] = {(S.half_bits + 1) / 2, S.half_bits / 2};
  std::vector<uint8_t> codes(d);
  for (int r = 0; r < n; ++r) {
    const float* y = rows + static_cast<size_t>(r) * d;
    double sq = 0.0;
    for (int c = 0; c < d; ++c) sq += static_cast<double>(y[c]) * y[c];
    const double sigma = std::sqrt(sq / d);
    double yc = 0.0, cc = 0.0;
    for (int c = 0; c < d; ++c) {
      const std::vector<float>& levels = LloydMax(bits[c < h ? 0 : 1]).levels;
      const double x = sigma > 0.0 ? y[c] / sigma : 0.0;
      int best = 0;
      for (int i = 1; i < static_cast<int>(levels.size()); ++i) {
        if (std::fabs(x - levels[i]) < std::fabs(x - levels[best])) best = i;
      }
      codes[c] = static_cast<uint8_t>(best);
      yc += static_cast<double>(y[c]) * levels[best];
      cc += static_cast<double>(levels[best]) * levels[best];
    }
    uint8_t* row = PageLayout::CodeRow(page, S, row0 + r);
    PackCodes(codes.data(), h, bits[0], row);
    PackCodes(codes.data() + h, h, bits[1], row + h * bits[0] / 8);
    *PageLayout::Gain(page, S, row0 + r) =
        FloatToHalf(sq > 0.0 ? static_cast<float>(yc / cc) : 0.0f);
  }
}

void DequantizeCrqRef(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                      float* out) {
  const SideLayout& S = s.layout().side(side);
  const int d = s.head_dim();
  const int h = d / 2;
  const int bits[2] = {(S.half_bits + 1) / 2, S.half_bits / 2};
  std::vector<uint8_t> codes(d);
  for (int r = 0; r < n; ++r) {
    const uint8_t* row = PageLayout::CodeRow(page, S, row0 + r);
    UnpackCodes(row, h, bits[0], codes.data());
    UnpackCodes(row + h * bits[0] / 8, h, bits[1], codes.data() + h);
    const float gain = HalfToFloat(*PageLayout::Gain(page, S, row0 + r));
    for (int c = 0; c < d; ++c) {
      out[static_cast<size_t>(r) * d + c] = gain * LloydMax(bits[c < h ? 0 : 1]).levels[codes[c]];
    }
  }
}

// The three steps of one head's softmax (AttendEachHeadRef).
template <typename Score, typename Add, typename Finish>
struct HeadSteps {
  Score score;
  Add add;
  Finish finish;
};
template <typename Score, typename Add, typename Finish>
HeadSteps(Score, Add, Finish) -> HeadSteps<Score, Add, Finish>;

// The scaffolding both reference attentions share, in fp64: for each query
// row i and group member g, `head(q)` prepares the query (a copy it may
// transform in place) and returns the HeadSteps of its softmax:
// `score(t)`, the unscaled q . k of key t, and `finish(out, sum)`, which
// writes the head's output once the weights p_t = exp(s_t - max) of keys
// [begin, visible_end) went through `add(t, p)`. A head that sees no key
// gets zeros and lse = -inf.
template <typename Head>
void AttendEachHeadRef(const AttentionTask& task, const AttentionOptions& options, Head head) {
  const KvStream& s = *task.stream;
  const int d = s.head_dim();
  const int begin = task.key_begin;
  const int end = task.key_end == -1 ? s.num_tokens() : task.key_end;
  const double scale = SoftmaxScale(options, d);
  std::vector<float> q(d);
  std::vector<double> scores;
  for (int i = 0; i < task.num_queries; ++i) {
    const int visible_end = task.q_positions ? std::min(end, task.q_positions[i] + 1) : end;
    for (int g = 0; g < options.group_size; ++g) {
      const float* qsrc = task.q + static_cast<size_t>(i) * task.q_stride + g * d;
      std::copy(qsrc, qsrc + d, q.begin());
      auto [score, add, finish] = head(q.data());
      float* out = task.out + static_cast<size_t>(i) * task.out_stride + g * d;
      float* lse = task.lse + static_cast<size_t>(i) * task.lse_stride + g;
      scores.clear();
      double max_score = -std::numeric_limits<double>::infinity();
      for (int t = begin; t < visible_end; ++t) {
        scores.push_back(score(t) * scale);
        max_score = std::max(max_score, scores.back());
      }
      if (scores.empty()) {
        std::fill(out, out + d, 0.0f);
        *lse = -std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0.0;
      for (int t = begin; t < visible_end; ++t) {
        const double p = std::exp(scores[t - begin] - max_score);
        sum += p;
        add(t, p);
      }
      finish(out, sum);
      *lse = static_cast<float>(max_score + std::log(sum));
    }
  }
}

// crq attention in the coded space, fp64 (docs/KERNELS.md, "crq"): per
// query q' = H (s_k q) once; a coded key's score is q . R_t mu_k +
// q' . y_t, its value is accumulated as p_t y_t and mapped back once
// (s_v H^T (sum) + mu_v sum p). Sink and tail rows take the fp16 path.
void AttendCrqRef(const AttentionTask& task, const AttentionOptions& options) {
  const KvStream& s = *task.stream;
  const CrqTransform& T = *s.crq();
  const HeadCalibration& cal = T.calibration();
  const Rope& rope = T.rope();
  const int d = s.head_dim();
  const int pt = s.layout().page_tokens;
  const int pairs = rope.rotary_dim() / 2;
  std::vector<float> qr(d), row(d);
  std::vector<double> a(pairs), b(pairs), acc(d), acc_coded(d);
  std::vector<char> rotates(d, 0);
  for (int j = 0; j < pairs; ++j) rotates[rope.First(j)] = rotates[rope.Second(j)] = 1;
  auto coded = [&](int t) {
    return t >= s.sink_tokens() && t - s.page_base() < s.quantized_tokens();
  };
  // The coded row of token t: g * level[code], in the coded coordinates.
  auto coded_row = [&](Side side, int t, float* out) {
    const int u = t - s.page_base();
    DequantizeCrqRef(s, side, s.page(u / pt), u % pt, 1, out);
  };
  double sum_coded = 0.0;
  AttendEachHeadRef(task, options, [&](const float* q) {
    for (int c = 0; c < d; ++c) qr[c] = q[c] * cal.key_scale[c];
    T.rotation().Forward(qr.data());
    double fixed = 0.0;  // Channels that do not rotate.
    for (int c = 0; c < d; ++c) {
      if (!rotates[c]) fixed += static_cast<double>(q[c]) * cal.key_mean[c];
    }
    for (int j = 0; j < pairs; ++j) {
      const int f = rope.First(j), sc = rope.Second(j);
      a[j] = static_cast<double>(q[f]) * cal.key_mean[f] + static_cast<double>(q[sc]) * cal.key_mean[sc];
      b[j] = static_cast<double>(q[sc]) * cal.key_mean[f] - static_cast<double>(q[f]) * cal.key_mean[sc];
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    std::fill(acc_coded.begin(), acc_coded.end(), 0.0);
    sum_coded = 0.0;
    return HeadSteps{
        [&, q, fixed](int t) {
          double dot = 0.0;
          if (coded(t)) {
            coded_row(Side::kKey, t, row.data());
            dot = fixed;
            for (int j = 0; j < pairs; ++j) {
              const double angle = rope.Angle(j, t);
              dot += a[j] * std::cos(angle) + b[j] * std::sin(angle);
            }
            for (int c = 0; c < d; ++c) dot += static_cast<double>(qr[c]) * row[c];
          } else {
            s.ReadStoredRow(Side::kKey, t, row.data());
            rope.Apply(row.data(), t);
            for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * row[c];
          }
          return dot;
        },
        [&](int t, double p) {
          if (coded(t)) {
            sum_coded += p;
            coded_row(Side::kValue, t, row.data());
            for (int c = 0; c < d; ++c) acc_coded[c] += p * row[c];
          } else {
            s.ReadStoredRow(Side::kValue, t, row.data());
            for (int c = 0; c < d; ++c) acc[c] += p * row[c];
          }
        },
        [&](float* out, double sum) {
          for (int c = 0; c < d; ++c) row[c] = static_cast<float>(acc_coded[c] / sum);
          T.rotation().Inverse(row.data());
          for (int c = 0; c < d; ++c) {
            out[c] = static_cast<float>(acc[c] / sum + cal.value_mean[c] * (sum_coded / sum) +
                                        static_cast<double>(cal.value_scale[c]) * row[c]);
          }
        }};
  });
}

}  // namespace

void QuantizeRowsRef(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                     int row0) {
  const SideLayout& S = s.layout().side(side);
  const int d = s.head_dim();
  switch (S.format) {
    case CodeFormat::kFp16:
    case CodeFormat::kBf16:
      for (int r = 0; r < n; ++r) {
        FloatToRow(rows + static_cast<size_t>(r) * d, d,
                   S.format == CodeFormat::kFp16 ? DType::kFloat16 : DType::kBFloat16,
                   PageLayout::CodeRow(page, S, row0 + r));
      }
      return;
    case CodeFormat::kFp8E4m3: {
      const float inv = 1.0f / s.fp8_scale(side);
      for (int r = 0; r < n; ++r) {
        uint8_t* code = PageLayout::CodeRow(page, S, row0 + r);
        for (int c = 0; c < d; ++c) code[c] = FloatToFp8E4m3(rows[static_cast<size_t>(r) * d + c] * inv);
      }
      return;
    }
    case CodeFormat::kInt8:
    case CodeFormat::kPacked:
      QuantizeAffineRef(s, side, rows, n, page, row0);
      return;
    case CodeFormat::kCrq:
      QuantizeCrqRef(s, side, rows, n, page, row0);
      return;
  }
}

void DequantizeRowsRef(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                       float* out) {
  const SideLayout& S = s.layout().side(side);
  const int d = s.head_dim();
  switch (S.format) {
    case CodeFormat::kFp16:
    case CodeFormat::kBf16:
      for (int r = 0; r < n; ++r) {
        RowToFloat(PageLayout::CodeRow(page, S, row0 + r),
                   S.format == CodeFormat::kFp16 ? DType::kFloat16 : DType::kBFloat16, d,
                   out + static_cast<size_t>(r) * d);
      }
      return;
    case CodeFormat::kFp8E4m3: {
      const float scale = s.fp8_scale(side);
      for (int r = 0; r < n; ++r) {
        const uint8_t* code = PageLayout::CodeRow(page, S, row0 + r);
        for (int c = 0; c < d; ++c) out[static_cast<size_t>(r) * d + c] = Fp8E4m3ToFloat(code[c]) * scale;
      }
      return;
    }
    case CodeFormat::kInt8:
    case CodeFormat::kPacked:
      DequantizeAffineRef(s, side, page, row0, n, out);
      return;
    case CodeFormat::kCrq:
      DequantizeCrqRef(s, side, page, row0, n, out);
      return;
  }
}

void AttendRef(const AttentionTask& task, const AttentionOptions& options) {
  if (task.stream->crq() != nullptr) {
    AttendCrqRef(task, options);
    return;
  }
  const KvStream& s = *task.stream;
  const int d = s.head_dim();
  std::vector<float> k(d), v(d);
  std::vector<double> acc(d);
  AttendEachHeadRef(task, options, [&](float* q) {
    if (s.rotation()) s.rotation()->Forward(q);
    std::fill(acc.begin(), acc.end(), 0.0);
    return HeadSteps{
        [&, q](int t) {
          s.ReadStoredRow(Side::kKey, t, k.data());
          if (s.rope()) s.rope()->Apply(k.data(), t);
          double dot = 0.0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
          return dot;
        },
        [&](int t, double p) {
          s.ReadStoredRow(Side::kValue, t, v.data());
          for (int c = 0; c < d; ++c) acc[c] += p * v[c];
        },
        [&](float* out, double sum) {
          for (int c = 0; c < d; ++c) out[c] = static_cast<float>(acc[c] / sum);
          if (s.rotation()) s.rotation()->Inverse(out);
        }};
  });
}

namespace {

class RefBackendImpl final : public KernelBackend {
 public:
  absl::string_view name() const override { return "ref"; }

  void QuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                    int row0) const override {
    QuantizeRowsRef(s, side, rows, n, page, row0);
  }

  void DequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                      float* out) const override {
    DequantizeRowsRef(s, side, page, row0, n, out);
  }

  absl::Status Attend(absl::Span<const AttentionTask> tasks,
                      const AttentionOptions& options) const override {
    if (absl::Status st = ValidateAttention(tasks, options); !st.ok()) return st;
    for (const AttentionTask& task : tasks) AttendRef(task, options);
    return CheckAttentionResults(tasks, options);
  }
};

}  // namespace

const KernelBackend& RefBackend() {
  static const RefBackendImpl* backend = new RefBackendImpl();
  return *backend;
}

}  // namespace kvq
