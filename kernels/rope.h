// Rotary position embedding, in both pairings real models use.
//
// A pre-RoPE cache stores keys before rotation and applies RoPE itself, so it
// must be told the client's convention: which channels form a pair, how many
// channels rotate, the base and the context-extension scaling.
#ifndef KVQ_KERNELS_ROPE_H_
#define KVQ_KERNELS_ROPE_H_

#include <vector>

#include "absl/status/status.h"

namespace kvq {

struct RopeConfig {
  enum class Pairing {
    kHalfSplit,  // (i, i + rot/2): Hugging Face Llama code, vLLM ("NeoX").
    kAdjacent,   // (2i, 2i + 1): GGML normal mode, Llama-family GGUF files.
  };
  enum class Scaling {
    kNone,
    kLinear,  // Position divided by `factor` (position interpolation).
    kNtk,     // Base multiplied by factor^(rot / (rot - 2)) ("NTK-aware").
  };
  float theta = 10000.0f;
  int rotary_dim = 0;  // Channels that rotate (even); 0 means all of head_dim.
  Pairing pairing = Pairing::kHalfSplit;
  Scaling scaling = Scaling::kNone;
  float factor = 1.0f;

  absl::Status Validate(int head_dim) const;
  friend bool operator==(const RopeConfig&, const RopeConfig&) = default;
};

// Precomputed inverse frequencies for one head_dim.
class Rope {
 public:
  Rope(const RopeConfig& config, int head_dim);

  int rotary_dim() const { return rotary_dim_; }
  int head_dim() const { return head_dim_; }
  const RopeConfig& config() const { return config_; }
  // Angle of pair i at `position` (scaling applied).
  double Angle(int pair, double position) const;
  // Channel indices of pair i.
  int First(int pair) const;
  int Second(int pair) const;

  // Rotates x[head_dim] in place by `position` (sign -1 undoes it), float math
  // with angles computed in double: the reference used by every backend.
  void Apply(float* x, double position, int sign = 1) const;

 private:
  RopeConfig config_;
  int head_dim_;
  int rotary_dim_;
  std::vector<double> inv_freq_;  // rotary_dim / 2 entries.
};

}  // namespace kvq

#endif  // KVQ_KERNELS_ROPE_H_
