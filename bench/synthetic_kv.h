// SyntheticKv: a seeded generator of the K, V and decode queries of one
// (layer, KV head), built so that every kvq storage option has the feature
// it targets in real models to work on.
//
// The model (all constants live in SyntheticKvModel; docs/KERNELS.md has the
// same list with the reasoning). d = head_dim, T = tokens, S = sink tokens,
// P = T - 1 (the position of the decode query), R(t) = RoPE at position t,
// N(.) Gaussian draws, t_nu(.) Student-t draws.
//
//   Keys, pre-RoPE, ordinary token t:
//     k[t][c] = key_bias[c] + key_scale[c] * N(0, 1)
//     key_bias[c] ~ N(0, key_bias_std^2), key_scale[c] = exp(N(0, key_scale_log_std^2))
//   Outlier channels (pre_rope, per-channel keys): d / 32 channels (4 of 128)
//     get key_bias = +-outlier_channel_bias, the same channels for every
//     token. Each is the first channel of the RoPE pair whose angular
//     frequency is nearest one of outlier_channel_frequencies, so RoPE swings
//     it (and its partner) between -bias and +bias within a few dozen tokens:
//     a per-channel group of post-RoPE keys spans the whole swing, a group of
//     pre-RoPE keys only the noise. A per-token group that holds one of these
//     channels spans the bias too, which is why per-channel keys win.
//   Outlier tokens (outliers): a fraction outlier_token_rate of the tokens
//     (the same tokens in every head and layer, as real outlier tokens are)
//     have keys k = key_bias + outlier_token_scale * key_scale * N(0, 1).
//   Values (outliers, rotate): v[t][c] = value_bias[c] + value_scale[c] *
//     t_nu(value_dof) / sqrt(dof / (dof - 2)) (unit variance, heavy tails).
//   Attention sink (sink): tokens t < S have keys key_bias + sink_key_norm *
//     sqrt(d) * u + 0.25 * key_scale * N(0, 1) (u a fixed unit direction per
//     head) and values value_bias + sink_value_scale * w (w ~ N(0, 1) per
//     channel, fixed per head) + 0.25 * value_scale * t_nu.
//   Post-RoPE keys: R(t) applied to the pre-RoPE key of token t.
//
//   Decode queries (post-RoPE, position P, group_size heads), the sum of
//     - a positional part: pre-RoPE weight on each outlier channel giving
//       +-positional_logit nats (times cos of the relative angle) against the
//       channel's bias, rotated by R(P): attention has a recency/periodic
//       pattern and reads exactly the channels that RoPE swings;
//     - a sink part along the post-RoPE sink direction, sized so that the S
//       sink tokens would hold sink_share of the attention against a flat
//       background of T - S tokens (the real share also depends on the
//       spread of the other logits);
//     - a retrieval part (per head): retrieval_targets random tokens whose
//       centred post-RoPE keys the query points at, adding about
//       retrieval_logit nats to their logits (queries follow the keys);
//     - noise N(0, query_noise^2) per channel.
//   So attention is neither uniform nor one-hot.
//
// Seeds: model_seed fixes the "model" (channel biases and scales, outlier
// channels, sink directions) per (layer, KV head); sample_seed fixes the
// "text" (token draws, outlier tokens, retrieval targets, query noise).
// Calibration data for nuq codebooks uses the same model_seed and another
// sample_seed: the same model reading different text. Random numbers come
// from std::mt19937_64 with a portable Gaussian (Box-Muller on 53-bit
// uniforms), so output is identical across runs and standard libraries
// (up to libm's last-bit rounding of log/sin/cos).
#ifndef KVQ_BENCH_SYNTHETIC_KV_H_
#define KVQ_BENCH_SYNTHETIC_KV_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/rope.h"
#include "kernels/tensor.h"

namespace kvq {

// Fixed seeds of the benchmark data set and of the nuq calibration set.
inline constexpr uint64_t kSyntheticModelSeed = 0x6b76712d6d6f646cull;   // "kvq-modl"
inline constexpr uint64_t kSyntheticSampleSeed = 0x6b76712d74657374ull;  // "kvq-test"
inline constexpr uint64_t kSyntheticCalibrationSeed = 0x6b76712d63616c69ull;  // "kvq-cali"

// Constants of the model above; the defaults are the benchmark's data set.
struct SyntheticKvModel {
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
  double outlier_token_rate = 0.005;
  double outlier_token_scale = 4.0;
  double value_bias_std = 0.5;
  double value_scale_log_std = 0.3;
  double value_dof = 3.0;  // Student-t degrees of freedom (> 2).
  int sink_tokens = 4;
  double sink_key_norm = 3.0;         // Times sqrt(head_dim), sink token 0.
  double sink_key_decay = 0.8;        // Sink token s has strength decay^s.
  double sink_pair_key_scale = 1.0;   // Ordinary keys' scale on the sink pairs.
  double sink_value_scale = 0.2;
  double sink_share = 0.3;
  double positional_logit = 0.75;  // Nats per outlier channel.
  int retrieval_targets = 4;
  double retrieval_logit = 2.0;  // Nats.
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
  int query_position = 0;            // tokens - 1.
  std::vector<float> keys_pre_rope;  // [tokens, head_dim]
  std::vector<float> keys;           // [tokens, head_dim], post-RoPE.
  std::vector<float> values;         // [tokens, head_dim]
  std::vector<float> queries;        // [group_size, head_dim], post-RoPE, at query_position.
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

#endif  // KVQ_BENCH_SYNTHETIC_KV_H_
