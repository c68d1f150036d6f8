// Random HostTensors for the tests that send K/V or queries through the
// client.
#ifndef KVQ_TESTS_CLIENT_RANDOM_HOST_TENSOR_H_
#define KVQ_TESTS_CLIENT_RANDOM_HOST_TENSOR_H_

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "client/host_tensor.h"

namespace kvq {

// N(0, 1) entries of `shape`, deterministic in `seed`, stored as `dtype`.
inline HostTensor RandomHostTensor(std::vector<int64_t> shape, uint32_t seed,
                                   DType dtype = DType::kFloat32) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return *HostTensor::FromFloats(v, std::move(shape), dtype);
}

}  // namespace kvq

#endif  // KVQ_TESTS_CLIENT_RANDOM_HOST_TENSOR_H_
