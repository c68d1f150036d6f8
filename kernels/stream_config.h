// StreamConfig: everything that fixes how one (layer, KV head) stream is stored.
#ifndef KVQ_KERNELS_STREAM_CONFIG_H_
#define KVQ_KERNELS_STREAM_CONFIG_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/quant_spec.h"
#include "kernels/rope.h"

namespace kvq {

struct StreamConfig {
  QuantSpec spec;
  int head_dim = 128;
  int page_tokens = 0;  // 0: PageLayout's default.
  RopeConfig rope;      // Applied by kvq only when spec.pre_rope.
  uint64_t rotation_seed = 0x6b7671u;  // Signs of the `rotate` transform.

  absl::Status Validate() const;
};

// Non-uniform levels (nuq) of one stream: for each channel, 2^bits sorted
// levels in [0, 1] of the group-normalised range (level 0 is the group
// minimum, the last level its maximum). Keys and values have their own.
struct Codebook {
  int bits = 0;
  int head_dim = 0;
  std::vector<float> key_levels;    // [head_dim][1 << bits]
  std::vector<float> value_levels;  // [head_dim][1 << bits]

  int levels() const { return 1 << bits; }
  const float* Levels(bool key, int channel) const {
    return (key ? key_levels : value_levels).data() + channel * levels();
  }
  // Bytes the codebook occupies in the cache (levels stored as fp16).
  size_t StoredBytes() const { return (key_levels.size() + value_levels.size()) * 2; }
  absl::Status Validate(const StreamConfig& config) const;
  // Uniform levels i / (2^bits - 1): equivalent to plain kivi.
  static Codebook Uniform(int bits, int head_dim);
};

}  // namespace kvq

#endif  // KVQ_KERNELS_STREAM_CONFIG_H_
