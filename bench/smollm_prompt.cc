#include "bench/smollm_prompt.h"

#include "kernels/tensor.h"

namespace kvq {
namespace smollm {

uint64_t Noise::Next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float Noise::Normal() {
  const uint64_t r = Next();
  float sum = 0.0f;
  for (int i = 0; i < 4; ++i) sum += static_cast<float>((r >> (16 * i)) & 0xffff) / 65535.0f;
  return (sum - 2.0f) * 1.7320508f;
}

HostTensor MakeKv(int layers, int tokens, uint64_t seed, bool keys) {
  HostTensor t = HostTensor::Zeros(DType::kFloat16, {layers, kKvHeads, tokens, kHeadDim});
  Noise noise(seed);
  float row[kHeadDim];
  const int64_t rows = static_cast<int64_t>(layers) * kKvHeads * tokens;
  for (int64_t r = 0; r < rows; ++r) {
    for (int c = 0; c < kHeadDim; ++c) {
      row[c] = keys ? noise.Normal() + (c % 16 == 3 ? 4.0f : 0.0f) : 0.5f * noise.Normal();
    }
    FloatToRow(row, kHeadDim, DType::kFloat16, t.mutable_bytes() + r * kHeadDim * 2);
  }
  return t;
}

HostTensor RandomTensor(std::vector<int64_t> shape, uint64_t seed, float scale) {
  HostTensor t = HostTensor::Zeros(DType::kFloat16, shape);
  Noise noise(seed);
  std::vector<float> x(static_cast<size_t>(t.num_elements()));
  for (float& e : x) e = scale * noise.Normal();
  FloatToRow(x.data(), static_cast<int>(x.size()), DType::kFloat16, t.mutable_bytes());
  return t;
}

ModelLayout Layout() {
  ModelLayout l;
  l.num_layers = kLayers;
  l.num_kv_heads = kKvHeads;
  l.num_q_heads = kQHeads;
  l.head_dim = kHeadDim;
  l.rope.theta = kRopeTheta;
  return l;
}

}  // namespace smollm
}  // namespace kvq
