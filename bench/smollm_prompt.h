// The prompt `kvq-bench rpc` and `kvq-bench convert` move: the SmolLM2-135M
// KV layout (30 layers, 3 KV / 9 query heads, head_dim 64) and seeded fp16
// K / V for it.
#ifndef KVQ_BENCH_SMOLLM_PROMPT_H_
#define KVQ_BENCH_SMOLLM_PROMPT_H_

#include <cstdint>
#include <vector>

#include "client/host_tensor.h"
#include "client/sequence_config.h"

namespace kvq {
namespace smollm {

constexpr int kLayers = 30;
constexpr int kKvHeads = 3;
constexpr int kQHeads = 9;
constexpr int kHeadDim = 64;
constexpr float kRopeTheta = 100000.0f;

// Deterministic, fast noise (splitmix64); Normal() sums four uniforms
// (Irwin-Hall, rescaled to unit variance): plenty for timing data.
class Noise {
 public:
  explicit Noise(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  float Normal();

 private:
  uint64_t state_;
};

// fp16 [layers, kv_heads, tokens, head_dim]. Keys carry the large fixed
// channels real caches have (one in 16); values are narrower.
HostTensor MakeKv(int layers, int tokens, uint64_t seed, bool keys);
// fp16 of `shape`, normal with standard deviation `scale`.
HostTensor RandomTensor(std::vector<int64_t> shape, uint64_t seed, float scale);
ModelLayout Layout();

}  // namespace smollm
}  // namespace kvq

#endif  // KVQ_BENCH_SMOLLM_PROMPT_H_
