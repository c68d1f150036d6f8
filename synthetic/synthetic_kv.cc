#include "synthetic/synthetic_kv.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"

namespace kvq {
namespace {

// Purposes of the derived random streams (part of the seed derivation, so
// adding a draw to one stream never shifts another).
enum Purpose : uint64_t {
  kModelParams = 1,
  kTokenDraws = 2,
  kOutlierTokens = 3,
  kQueryDraws = 4,
};

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t DeriveSeed(uint64_t seed, uint64_t layer, uint64_t head, Purpose purpose) {
  uint64_t h = SplitMix64(seed);
  h = SplitMix64(h ^ layer);
  h = SplitMix64(h ^ (head + 0x100000000ull));
  return SplitMix64(h ^ (static_cast<uint64_t>(purpose) << 48));
}

// std::mt19937_64 with distributions written out, so the numbers do not
// depend on the standard library's distribution algorithms.
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  // Uniform in [0, 1), 53 bits.
  double Uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  // Uniform in (-1, 1).
  double Symmetric() {
    double u;
    do u = 2.0 * Uniform() - 1.0;
    while (u == -1.0);
    return u;
  }
  int UniformInt(int n) { return std::min(n - 1, static_cast<int>(Uniform() * n)); }

  // Standard normal (Box-Muller; the second value is kept for the next call).
  double Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1;
    do u1 = Uniform();
    while (u1 <= 0.0);
    const double u2 = Uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * M_PI * u2);
  }

  // Student-t with `dof` degrees of freedom (Bailey's polar method).
  double StudentT(double dof) {
    double u, v, w;
    do {
      u = Symmetric();
      v = Symmetric();
      w = u * u + v * v;
    } while (w >= 1.0 || w == 0.0);
    return u * std::sqrt(dof * (std::pow(w, -2.0 / dof) - 1.0) / w);
  }

 private:
  std::mt19937_64 engine_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

double Dot(const float* a, const float* b, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

absl::Status Bad(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("synthetic KV config: ", field, " ", why));
}

int OutlierChannelCount(const SyntheticKvConfig& c) {
  return c.model.outlier_channels >= 0 ? c.model.outlier_channels : std::max(1, c.head_dim / 32);
}

}  // namespace

absl::Status SyntheticKvConfig::Validate() const {
  if (head_dim < 16 || head_dim > 256 || head_dim % 2 != 0) {
    return Bad("head_dim", absl::StrCat("must be even in [16, 256], got ", head_dim));
  }
  if (absl::Status s = rope.Validate(head_dim); !s.ok()) return s;
  const SyntheticKvModel& m = model;
  if (m.sink_tokens < 0) return Bad("model.sink_tokens", "must be >= 0");
  if (m.retrieval_targets < 0) return Bad("model.retrieval_targets", "must be >= 0");
  if (tokens <= m.sink_tokens + m.retrieval_targets) {
    return Bad("tokens", absl::StrCat("must exceed sink_tokens + retrieval_targets = ",
                                      m.sink_tokens + m.retrieval_targets, ", got ", tokens));
  }
  if (group_size < 1 || group_size > 64) {
    return Bad("group_size", absl::StrCat("must be in [1, 64], got ", group_size));
  }
  const int rot = rope.rotary_dim == 0 ? head_dim : rope.rotary_dim;
  if (OutlierChannelCount(*this) > rot / 2) {
    return Bad("model.outlier_channels", absl::StrCat("must be <= rotary pairs ", rot / 2, ", got ",
                                                      OutlierChannelCount(*this)));
  }
  if (OutlierChannelCount(*this) > 0 && m.outlier_channel_specs.empty()) {
    return Bad("model.outlier_channel_specs", "must not be empty");
  }
  for (const SyntheticKvModel::OutlierChannel& o : m.outlier_channel_specs) {
    if (!(o.frequency > 0.0) || !(o.bias > 0.0) || !std::isfinite(o.bias)) {
      return Bad("model.outlier_channel_specs", "frequency and bias must be > 0");
    }
  }
  if (!(m.value_dof > 2.0)) return Bad("model.value_dof", "must be > 2 (finite variance)");
  if (!(m.outlier_token_rate >= 0.0 && m.outlier_token_rate <= 1.0)) {
    return Bad("model.outlier_token_rate", "must be in [0, 1]");
  }
  if (!(m.sink_share >= 0.0 && m.sink_share < 1.0)) {
    return Bad("model.sink_share", "must be in [0, 1)");
  }
  if (!(m.sink_key_norm > 0.0)) return Bad("model.sink_key_norm", "must be > 0");
  if (!(m.sink_key_decay > 0.0 && m.sink_key_decay <= 1.0)) {
    return Bad("model.sink_key_decay", "must be in (0, 1]");
  }
  for (double x : {m.key_bias_std, m.key_scale_log_std, m.outlier_token_scale, m.value_bias_std,
                   m.value_scale_log_std, m.sink_value_scale, m.positional_logit, m.retrieval_logit,
                   m.query_noise}) {
    if (!(x >= 0.0) || !std::isfinite(x)) {
      return Bad("model", "constants must be finite and >= 0");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SyntheticKv> GenerateSyntheticKv(const SyntheticKvConfig& config) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  const SyntheticKvModel& m = config.model;
  const int d = config.head_dim;
  const int T = config.tokens;
  const int S = m.sink_tokens;
  const double sqrt_d = std::sqrt(static_cast<double>(d));
  const Rope rope(config.rope, d);

  SyntheticKv out;
  out.head_dim = d;
  out.tokens = T;
  out.group_size = config.group_size;
  out.query_position = T - 1;

  // --- The model: fixed per (model_seed, layer, KV head). ---
  Rng model_rng(DeriveSeed(config.model_seed, config.layer, config.kv_head, kModelParams));
  std::vector<float> key_bias(d), key_scale(d), value_bias(d), value_scale(d);
  std::vector<float> sink_dir(d);
  for (int c = 0; c < d; ++c) {
    key_bias[c] = static_cast<float>(m.key_bias_std * model_rng.Normal());
    key_scale[c] = static_cast<float>(std::exp(m.key_scale_log_std * model_rng.Normal()));
    value_bias[c] = static_cast<float>(m.value_bias_std * model_rng.Normal());
    value_scale[c] = static_cast<float>(std::exp(m.value_scale_log_std * model_rng.Normal()));
    sink_dir[c] = static_cast<float>(model_rng.Normal());
  }
  // Sink values: one fixed random vector per sink token (the model's first
  // tokens are always the same), without the value bias.
  std::vector<float> sink_value(static_cast<size_t>(S) * d);
  for (float& x : sink_value) x = static_cast<float>(m.sink_value_scale * model_rng.Normal());

  // Outlier channels: the first channel of the pair nearest each target
  // frequency (pairs are not reused).
  std::set<int> used_pairs;
  const int pairs = rope.rotary_dim() / 2;
  for (int i = 0; i < OutlierChannelCount(config); ++i) {
    const SyntheticKvModel::OutlierChannel& spec =
        m.outlier_channel_specs[i % m.outlier_channel_specs.size()];
    const double target = spec.frequency;
    int best = -1;
    double best_gap = 0.0;
    for (int p = 0; p < pairs; ++p) {
      if (used_pairs.count(p)) continue;
      const double gap = std::fabs(std::log(rope.Angle(p, 1.0)) - std::log(target));
      if (best < 0 || gap < best_gap) {
        best = p;
        best_gap = gap;
      }
    }
    used_pairs.insert(best);
    const int channel = rope.First(best);
    const double sign = model_rng.Uniform() < 0.5 ? -1.0 : 1.0;
    key_bias[channel] = static_cast<float>(sign * spec.bias);
    out.outlier_channels.push_back(channel);
  }
  std::sort(out.outlier_channels.begin(), out.outlier_channels.end());

  // Sink pairs: the lowest-frequency pairs not taken by outlier channels
  // (they barely rotate, so the sink direction survives RoPE). Ordinary keys
  // have no bias there.
  std::vector<float> sink_mask(d, 0.0f);
  const int sink_pairs = std::max(1, pairs / 8);
  for (int p = pairs - 1, taken = 0; p >= 0 && taken < sink_pairs; --p) {
    if (used_pairs.count(p)) continue;
    for (int c : {rope.First(p), rope.Second(p)}) {
      sink_mask[c] = 1.0f;
      key_bias[c] = 0.0f;
    }
    ++taken;
  }
  for (int c = 0; c < d; ++c) sink_dir[c] *= sink_mask[c];
  const double sink_dir_norm = std::sqrt(Dot(sink_dir.data(), sink_dir.data(), d));
  for (float& x : sink_dir) x = static_cast<float>(x / sink_dir_norm);

  // --- The text: tokens. Outlier tokens depend on sample_seed only. ---
  Rng outlier_rng(DeriveSeed(config.sample_seed, 0, 0, kOutlierTokens));
  std::vector<uint8_t> is_outlier(T, 0);
  for (int t = 0; t < T; ++t) {
    const bool hit = outlier_rng.Uniform() < m.outlier_token_rate;
    if (hit && t >= S) {
      is_outlier[t] = 1;
      out.outlier_tokens.push_back(t);
    }
  }

  Rng token_rng(DeriveSeed(config.sample_seed, config.layer, config.kv_head, kTokenDraws));
  const size_t n = static_cast<size_t>(T) * d;
  out.keys_pre_rope.resize(n);
  out.keys.resize(n);
  out.values.resize(n);
  const double t_norm = 1.0 / std::sqrt(m.value_dof / (m.value_dof - 2.0));
  const double sink_key = m.sink_key_norm * sqrt_d;
  for (int t = 0; t < T; ++t) {
    float* k = &out.keys_pre_rope[static_cast<size_t>(t) * d];
    float* v = &out.values[static_cast<size_t>(t) * d];
    const double strength = t < S ? sink_key * std::pow(m.sink_key_decay, t) : 0.0;
    for (int c = 0; c < d; ++c) {
      const double z = token_rng.Normal();
      double x;
      if (t < S) {
        x = key_bias[c] + strength * sink_dir[c] + 0.25 * key_scale[c] * z;
      } else if (is_outlier[t] && sink_mask[c] == 0.0f) {
        x = key_bias[c] + m.outlier_token_scale * key_scale[c] * z;
      } else {
        x = key_bias[c] + key_scale[c] * z;
      }
      k[c] = static_cast<float>(x);
    }
    for (int c = 0; c < d; ++c) {
      const double tv = token_rng.StudentT(m.value_dof) * t_norm;
      const double x = t < S
                           ? sink_value[static_cast<size_t>(t) * d + c] + 0.25 * value_scale[c] * tv
                           : value_bias[c] + value_scale[c] * tv;
      v[c] = static_cast<float>(x);
    }
    float* kp = &out.keys[static_cast<size_t>(t) * d];
    std::copy(k, k + d, kp);
    rope.Apply(kp, t);
  }

  // --- Decode queries, post-RoPE at position P. ---
  const int P = out.query_position;
  std::vector<float> common(d, 0.0f);
  // Positional part: q_pre . k_pre = positional_logit * sqrt(d) per channel.
  for (int o : out.outlier_channels) {
    common[o] = static_cast<float>(m.positional_logit * sqrt_d / key_bias[o]);
  }
  rope.Apply(common.data(), P);
  // Sink direction: the post-RoPE sink keys' extra component, summed.
  std::vector<float> sink_post(d, 0.0f);
  if (S > 0) {
    std::vector<float> rotated(d);
    for (int s = 0; s < S; ++s) {
      rotated = sink_dir;
      rope.Apply(rotated.data(), s);
      const double w = std::pow(m.sink_key_decay, s);
      for (int c = 0; c < d; ++c) sink_post[c] += static_cast<float>(w * rotated[c]);
    }
    const double norm = std::sqrt(Dot(sink_post.data(), sink_post.data(), d));
    for (float& x : sink_post) x = static_cast<float>(x / norm);
  }

  Rng query_rng(DeriveSeed(config.sample_seed, config.layer, config.kv_head, kQueryDraws));
  out.queries.assign(static_cast<size_t>(config.group_size) * d, 0.0f);
  std::vector<float> centred(d), rotated_bias(d), dir(d);
  std::vector<double> rest_logit(T), sink_logit(T);
  for (int h = 0; h < config.group_size; ++h) {
    float* q = &out.queries[static_cast<size_t>(h) * d];
    std::copy(common.begin(), common.end(), q);
    // Retrieval part: point at a few tokens' centred post-RoPE keys.
    std::set<int> targets;
    while (static_cast<int>(targets.size()) < m.retrieval_targets) {
      targets.insert(S + query_rng.UniformInt(T - S));
    }
    if (!targets.empty()) {
      std::fill(dir.begin(), dir.end(), 0.0f);
      std::vector<std::vector<float>> centred_keys;
      for (int t : targets) {
        rotated_bias = key_bias;
        rope.Apply(rotated_bias.data(), t);
        for (int c = 0; c < d; ++c) {
          centred[c] = out.keys[static_cast<size_t>(t) * d + c] - rotated_bias[c];
          dir[c] += centred[c];
        }
        centred_keys.push_back(centred);
        out.retrieval_targets.push_back(t);
      }
      const double norm = std::sqrt(Dot(dir.data(), dir.data(), d));
      double gain = 0.0;
      for (const auto& ck : centred_keys) gain += Dot(dir.data(), ck.data(), d) / norm;
      gain /= static_cast<double>(centred_keys.size()) * sqrt_d;  // Nats per unit weight.
      const double gamma = gain > 0.0 ? m.retrieval_logit / gain : 0.0;
      for (int c = 0; c < d; ++c) q[c] += static_cast<float>(gamma * dir[c] / norm);
    }
    for (int c = 0; c < d; ++c) q[c] += static_cast<float>(m.query_noise * query_rng.Normal());

    // Sink part: beta * sink_post with beta >= 0 chosen (bisection) so the
    // sink tokens hold sink_share of this head's attention.
    if (S == 0 || m.sink_share <= 0.0) continue;
    for (int t = 0; t < T; ++t) {
      const float* k = &out.keys[static_cast<size_t>(t) * d];
      rest_logit[t] = Dot(q, k, d) / sqrt_d;
      sink_logit[t] = Dot(sink_post.data(), k, d) / sqrt_d;
    }
    auto share = [&](double beta) {
      double mx = -INFINITY;
      for (int t = 0; t < T; ++t) mx = std::max(mx, rest_logit[t] + beta * sink_logit[t]);
      double all = 0.0, sink = 0.0;
      for (int t = 0; t < T; ++t) {
        const double w = std::exp(rest_logit[t] + beta * sink_logit[t] - mx);
        all += w;
        if (t < S) sink += w;
      }
      return sink / all;
    };
    double lo = 0.0, hi = 1.0;
    if (share(lo) < m.sink_share) {
      while (share(hi) < m.sink_share && hi < 1e6) hi *= 2.0;
      for (int it = 0; it < 40; ++it) {
        const double mid = 0.5 * (lo + hi);
        (share(mid) < m.sink_share ? lo : hi) = mid;
      }
      for (int c = 0; c < d; ++c) q[c] += static_cast<float>(hi * sink_post[c]);
    }
  }
  return out;
}

}  // namespace kvq
