#include "bench/eval/calibration_stats.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/status_macros.h"

namespace kvq::eval {
namespace {

// Raises zero (or negative, from rounding) moments to a small fraction of
// their mean, so a dead channel gets a finite scale instead of 0 or inf.
std::vector<double> Floored(std::vector<double> x) {
  double mean = 0.0;
  for (double v : x) mean += std::max(v, 0.0);
  mean /= std::max<size_t>(1, x.size());
  const double floor = mean > 0.0 ? 1e-6 * mean : 1e-30;
  for (double& v : x) v = std::max(v, floor);
  return x;
}

// Scales s[c] = (num[c] / den[c])^(1/4) over the groups of channels that
// must share one scale (`group_of[c]`), normalized to geometric mean 1.
std::vector<float> QuarticRootScales(const std::vector<double>& num,
                                     const std::vector<double>& den,
                                     const std::vector<int>& group_of) {
  const size_t d = num.size();
  const int groups = *std::max_element(group_of.begin(), group_of.end()) + 1;
  std::vector<double> gn(groups, 0.0), gd(groups, 0.0);
  for (size_t c = 0; c < d; ++c) {
    gn[group_of[c]] += num[c];
    gd[group_of[c]] += den[c];
  }
  std::vector<double> log_s(d);
  double mean_log = 0.0;
  for (size_t c = 0; c < d; ++c) {
    log_s[c] = 0.25 * (std::log(gn[group_of[c]]) - std::log(gd[group_of[c]]));
    mean_log += log_s[c];
  }
  mean_log /= static_cast<double>(d);
  std::vector<float> s(d);
  for (size_t c = 0; c < d; ++c) s[c] = static_cast<float>(std::exp(log_s[c] - mean_log));
  return s;
}

// An fp16 cache that takes keys before RoPE and records the moments of
// what passes through it.
class StatsCache : public AttentionCache {
 public:
  StatsCache(std::unique_ptr<AttentionCache> inner, CalibrationStats* stats)
      : inner_(std::move(inner)), stats_(stats) {}
  bool KeysBeforeRope() const override { return true; }
  absl::Status AppendAttend(int layer, int n, const float* k, const float* v, const float* q,
                            float* out) override {
    stats_->Add(layer, n, k, v, q);
    return inner_->AppendAttend(layer, n, k, v, q, out);
  }
  int num_tokens() const override { return inner_->num_tokens(); }
  // Calibration runs one straight prefill and never forks.
  absl::StatusOr<std::unique_ptr<AttentionCache>> Fork() const override {
    return absl::FailedPreconditionError("StatsCache: calibration does not fork");
  }
  absl::StatusOr<ByteBreakdown> Bytes() const override { return inner_->Bytes(); }

 private:
  std::unique_ptr<AttentionCache> inner_;
  CalibrationStats* stats_;
};

}  // namespace

std::vector<float> KeyScales(absl::Span<const double> key_var, absl::Span<const double> query_sq,
                             const RopeConfig& rope, int head_dim) {
  const Rope r(rope, head_dim);
  std::vector<int> group_of(head_dim, -1);
  int groups = 0;
  for (int p = 0; p < r.rotary_dim() / 2; ++p, ++groups) {
    group_of[r.First(p)] = groups;
    group_of[r.Second(p)] = groups;
  }
  for (int c = 0; c < head_dim; ++c) {
    if (group_of[c] < 0) group_of[c] = groups++;
  }
  return QuarticRootScales(Floored({key_var.begin(), key_var.end()}),
                           Floored({query_sq.begin(), query_sq.end()}), group_of);
}

std::vector<float> ValueScales(absl::Span<const double> value_var,
                               absl::Span<const double> out_sq) {
  std::vector<int> group_of(value_var.size());
  for (size_t c = 0; c < group_of.size(); ++c) group_of[c] = static_cast<int>(c);
  return QuarticRootScales(Floored({value_var.begin(), value_var.end()}),
                           Floored({out_sq.begin(), out_sq.end()}), group_of);
}

CalibrationStats::CalibrationStats(const CacheShape& shape)
    : shape_(shape),
      sums_(static_cast<size_t>(shape.num_layers) * shape.num_kv_heads),
      tokens_(shape.num_layers, 0) {
  for (Sums& s : sums_) {
    for (std::vector<double>* v : {&s.k, &s.k2, &s.v, &s.v2, &s.q2}) v->assign(shape.head_dim, 0.0);
  }
}

void CalibrationStats::Add(int layer, int n, const float* k, const float* v, const float* q) {
  const int d = shape_.head_dim;
  const int kv_heads = shape_.num_kv_heads;
  const int group = shape_.num_q_heads / kv_heads;
  for (int i = 0; i < n; ++i) {
    for (int h = 0; h < kv_heads; ++h) {
      Sums& s = sums_[static_cast<size_t>(layer) * kv_heads + h];
      const float* ki = k + (static_cast<size_t>(i) * kv_heads + h) * d;
      const float* vi = v + (static_cast<size_t>(i) * kv_heads + h) * d;
      for (int c = 0; c < d; ++c) {
        s.k[c] += ki[c];
        s.k2[c] += static_cast<double>(ki[c]) * ki[c];
        s.v[c] += vi[c];
        s.v2[c] += static_cast<double>(vi[c]) * vi[c];
      }
      for (int g = 0; g < group; ++g) {
        const float* qi = q + (static_cast<size_t>(i) * shape_.num_q_heads + h * group + g) * d;
        for (int c = 0; c < d; ++c) s.q2[c] += static_cast<double>(qi[c]) * qi[c];
      }
    }
  }
  tokens_[layer] += n;
}

absl::StatusOr<ModelCalibration> CalibrationStats::Finish(
    const std::string& name, const std::vector<std::vector<double>>& out_sq) const {
  const int d = shape_.head_dim;
  const int kv_heads = shape_.num_kv_heads;
  const int group = shape_.num_q_heads / kv_heads;
  ModelCalibration cal;
  cal.name = name;
  cal.num_layers = shape_.num_layers;
  cal.num_kv_heads = kv_heads;
  cal.head_dim = d;
  for (int l = 0; l < shape_.num_layers; ++l) {
    if (tokens_[l] == 0) {
      return absl::FailedPreconditionError(absl::StrCat("calibration: layer ", l, " saw no tokens"));
    }
    const double n = static_cast<double>(tokens_[l]);
    for (int h = 0; h < kv_heads; ++h) {
      const Sums& s = sums_[static_cast<size_t>(l) * kv_heads + h];
      HeadCalibration head;
      std::vector<double> key_var(d), value_var(d), query_sq(d), w_sq(d, 0.0);
      for (int c = 0; c < d; ++c) {
        const double mk = s.k[c] / n, mv = s.v[c] / n;
        head.key_mean.push_back(static_cast<float>(mk));
        head.value_mean.push_back(static_cast<float>(mv));
        key_var[c] = s.k2[c] / n - mk * mk;
        value_var[c] = s.v2[c] / n - mv * mv;
        query_sq[c] = s.q2[c] / (n * group);
        for (int g = 0; g < group; ++g) w_sq[c] += out_sq[l][(h * group + g) * d + c];
      }
      head.key_scale = KeyScales(key_var, query_sq, shape_.rope, d);
      head.value_scale = ValueScales(value_var, w_sq);
      cal.heads.push_back(std::move(head));
    }
  }
  KVQ_RETURN_IF_ERROR(cal.Validate());
  return cal;
}

absl::StatusOr<ModelCalibration> ComputeCalibration(LlamaModel& model,
                                                    absl::Span<const int32_t> tokens, int chunk,
                                                    const std::string& name) {
  const CacheShape shape = model.config().cache_shape();
  // A pre_rope scheme quantizing no layer (the first layer past the last):
  // every stream stores fp16, and the cache takes keys before RoPE.
  KVQ_ASSIGN_OR_RETURN(QuantSpec pre_rope, QuantSpec::Parse("kivi4:pre_rope"));
  KVQ_ASSIGN_OR_RETURN(auto fp16, KvqAttentionCache::Create(shape, pre_rope, nullptr, &CpuBackend(),
                                                            LayerRange{shape.num_layers, -1}));
  CalibrationStats stats(shape);
  StatsCache cache(std::move(fp16), &stats);
  std::vector<float> logits;
  for (size_t pos = 0; pos < tokens.size(); pos += chunk) {
    const size_t len = std::min<size_t>(chunk, tokens.size() - pos);
    KVQ_RETURN_IF_ERROR(model.Forward(tokens.subspan(pos, len), &cache, false, &logits));
  }
  // W_o is [hidden][q_heads * head_dim]: column i carries input channel i.
  const int hidden = model.config().hidden;
  std::vector<std::vector<double>> out_sq(shape.num_layers);
  for (int l = 0; l < shape.num_layers; ++l) {
    const std::vector<float>& wo = model.output_projection(l);
    out_sq[l].assign(hidden, 0.0);
    for (int o = 0; o < hidden; ++o) {
      const float* row = wo.data() + static_cast<size_t>(o) * hidden;
      for (int i = 0; i < hidden; ++i) out_sq[l][i] += static_cast<double>(row[i]) * row[i];
    }
  }
  return stats.Finish(name, out_sq);
}

std::string ModelFingerprint(const std::string& model_file, const LlamaConfig& c) {
  return absl::StrCat(model_file, " layers=", c.num_layers, " kv_heads=", c.num_kv_heads,
                      " q_heads=", c.num_q_heads, " head_dim=", c.head_dim, " rope=",
                      c.rope.pairing == RopeConfig::Pairing::kAdjacent ? "adjacent" : "half_split",
                      "/", c.rope.rotary_dim, "/", c.rope.theta);
}

}  // namespace kvq::eval
