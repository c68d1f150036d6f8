// SyntheticKv: a seeded generator of the K, V and decode queries of one
// (layer, KV head), built so that every kvq storage option has the feature
// it targets in real models to work on.
//
// The model (every constant lives in SyntheticKvModel; docs/KERNELS.md has
// the same list with the reasoning). d = head_dim, T = tokens, S = sink
// tokens, P = T - 1 (the decode query's position), R(t) = RoPE at position
// t, N = a standard Gaussian draw, t_nu = a Student-t draw.
//
//   Ordinary keys, pre-RoPE:  k[t][c] = key_bias[c] + key_scale[c] * N
//     key_bias[c] ~ N(0, key_bias_std^2), key_scale[c] = exp(key_scale_log_std * N).
//     Per-channel bias and scale: a per-token group of 32 channels spans
//     them all, a per-channel group does not (per-channel keys win; ktok).
//   Outlier channels (pre_rope, per-channel keys): d / 32 channels (4 of
//     128), the same for every token, with key_bias = +-bias. Channel i is
//     the first channel of the RoPE pair whose angular frequency is nearest
//     outlier_channel_specs[i].frequency. The first is a "massive" channel
//     (bias 20 in a slow pair: RoPE barely moves it within a group, so only
//     per-token groups suffer); the others (bias 8, 0.06-0.25 rad/token)
//     swing between -bias and +bias within a 32-token group once RoPE is
//     applied, so a per-channel group of POST-RoPE keys spans the swing and
//     a group of PRE-RoPE keys only the noise (pre_rope).
//   Outlier tokens (outliers): each token t >= S is one with probability
//     outlier_token_rate (the same tokens in every head and layer); its key
//     noise is outlier_token_scale times larger (outside the sink pairs), so
//     the per-channel group holding it spans a much wider range.
//   Values (outliers, rotate):
//     v[t][c] = value_bias[c] + value_scale[c] * t_nu(value_dof) / sqrt(dof / (dof - 2)),
//     heavy-tailed with unit variance; rare extremes set the per-token
//     group range (outliers stores them exactly, rotate spreads them).
//   Attention sink (sink): the d / 16 lowest-frequency RoPE pairs ("sink
//     pairs", d / 8 channels, no key bias; they barely rotate) carry a fixed
//     unit direction u; sink token s < S has key key_bias + sink_key_norm *
//     sqrt(d) * sink_key_decay^s * u + 0.25 * key_scale * N (a strong first
//     token, weaker followers: their different strengths make the first
//     group's per-channel range coarse for all of them) and value
//     sink_value_scale * w_s + 0.25 * value_scale * t_nu, with w_s a fixed
//     N(0, 1) vector per sink token: small and unlike the other values, as
//     real sinks are (attention parked on them is almost a no-op).
//   Post-RoPE keys: R(t) applied to the pre-RoPE key of token t.
//
//   Decode queries (post-RoPE, position P, group_size heads) sum:
//     - a positional part: pre-RoPE weight positional_logit * sqrt(d) / bias
//       on each outlier channel, rotated by R(P), adding positional_logit *
//       cos(angle of P - t) nats per channel to token t's logit: attention
//       reads exactly the channels RoPE swings (recency/periodic pattern);
//     - a retrieval part per head: pointing at retrieval_targets random
//       tokens' centred post-RoPE keys, adding retrieval_logit nats to their
//       logits (queries follow the key distribution);
//     - noise query_noise * N per channel;
//     - a sink part: beta times the unit post-RoPE sink direction, beta
//       found by bisection so that the S sink tokens hold exactly sink_share
//       of that head's fp32 attention.
//   So attention is neither uniform nor one-hot (kvq-bench prints the sink
//   share, the effective number of tokens 1 / sum(p^2) and the top weight).
//
// Seeds: model_seed fixes the "model" (channel biases and scales, outlier
// channels, sink direction and values) per (layer, KV head); sample_seed
// fixes the "text" (token draws, outlier tokens, retrieval targets, query
// noise). nuq calibration data uses the same model_seed and another
// sample_seed: the same model reading different text. Numbers come from
// std::mt19937_64 streams derived (SplitMix64) from the seed, the layer, the
// head and the purpose, with distributions written out (Box-Muller on
// 53-bit uniforms, Bailey's polar Student-t), so the output is identical
// across runs and standard libraries (up to libm's last-bit rounding).
#ifndef KVQ_SYNTHETIC_SYNTHETIC_KV_H_
#define KVQ_SYNTHETIC_SYNTHETIC_KV_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/rope.h"
#include "kernels/tensor.h"

namespace kvq {

// Fixed seeds of the benchmark data set and of the nuq calibration set.
inline constexpr uint64_t kSyntheticModelSeed = 0x6b76712d6d6f646cull;        // "kvq-modl"
inline constexpr uint64_t kSyntheticSampleSeed = 0x6b76712d74657374ull;       // "kvq-test"
inline constexpr uint64_t kSyntheticCalibrationSeed = 0x6b76712d63616c69ull;  // "kvq-cali"

// Constants of the model above; the defaults are the benchmark's data set.
struct SyntheticKvModel {
  // Ordinary keys: key_bias[c] ~ N(0, 0.5^2), key_scale[c] = exp(0.5 N).
  double key_bias_std = 0.5;
  double key_scale_log_std = 0.5;
  // Outlier channels: -1 means head_dim / 32 (at least 1).
  int outlier_channels = -1;
  // Outlier channel i takes entry i (cycled): the target angular frequency
  // (rad/token) of its RoPE pair and its |bias|. The first is a "massive"
  // channel in a slow pair (RoPE barely moves it within a group); the others
  // swing within a group.
  struct OutlierChannel {
    double frequency;
    double bias;
  };
  std::vector<OutlierChannel> outlier_channel_specs = {
      {0.003, 20.0}, {0.25, 8.0}, {0.12, 8.0}, {0.06, 8.0}};
  // Outlier tokens: 0.5% of the tokens, key noise 4x larger.
  double outlier_token_rate = 0.005;
  double outlier_token_scale = 4.0;
  // Values: value_bias[c] ~ N(0, 0.5^2), value_scale[c] = exp(0.3 N),
  // Student-t noise with 3 degrees of freedom (> 2), unit variance.
  double value_bias_std = 0.5;
  double value_scale_log_std = 0.3;
  double value_dof = 3.0;
  // Attention sink: 4 tokens; token 0's sink component has norm
  // 3 sqrt(head_dim), token s's 0.8^s times that; sink values 0.2 * N;
  // the sink tokens hold 30% of every query head's attention.
  int sink_tokens = 4;
  double sink_key_norm = 3.0;
  double sink_key_decay = 0.8;
  double sink_value_scale = 0.2;
  double sink_share = 0.3;
  // Queries: 1 nat per outlier channel of positional pattern, 4 retrieval
  // targets per head at +2 nats, noise 0.25 per channel.
  double positional_logit = 1.0;
  int retrieval_targets = 4;
  double retrieval_logit = 2.0;
  double query_noise = 0.25;
};

struct SyntheticKvConfig {
  int head_dim = 128;
  int tokens = 2048;
  int group_size = 4;  // Query heads per KV head.
  RopeConfig rope;     // The model's RoPE (post-RoPE keys and queries use it).
  int layer = 0;
  int kv_head = 0;
  uint64_t model_seed = kSyntheticModelSeed;
  uint64_t sample_seed = kSyntheticSampleSeed;
  SyntheticKvModel model;

  // INVALID_ARGUMENT naming the field: head_dim (even, 16..256), tokens
  // (> sink_tokens + retrieval_targets), group_size (1..64), rope, model
  // constants out of range.
  absl::Status Validate() const;
};

// One (layer, KV head): every matrix is row-major [rows, head_dim] fp32.
struct SyntheticKv {
  int head_dim = 0;
  int tokens = 0;
  int group_size = 0;
  int query_position = 0;              // tokens - 1.
  std::vector<float> keys_pre_rope;    // [tokens, head_dim]
  std::vector<float> keys;             // [tokens, head_dim], post-RoPE.
  std::vector<float> values;           // [tokens, head_dim]
  std::vector<float> queries;          // [group_size, head_dim], post-RoPE, at query_position.
  std::vector<int> outlier_channels;   // Sorted.
  std::vector<int> outlier_tokens;     // Sorted.
  std::vector<int> retrieval_targets;  // [group_size][retrieval_targets].

  ConstTensorView KeysPreRope() const { return Floats(keys_pre_rope.data(), tokens, head_dim); }
  ConstTensorView Keys() const { return Floats(keys.data(), tokens, head_dim); }
  ConstTensorView Values() const { return Floats(values.data(), tokens, head_dim); }
};

// Generates one (layer, KV head). Deterministic in the config.
absl::StatusOr<SyntheticKv> GenerateSyntheticKv(const SyntheticKvConfig& config);

}  // namespace kvq

#endif  // KVQ_SYNTHETIC_SYNTHETIC_KV_H_
