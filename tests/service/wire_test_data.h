#ifndef KVQ_TESTS_SERVICE_WIRE_TEST_DATA_H_
#define KVQ_TESTS_SERVICE_WIRE_TEST_DATA_H_

// Random request tensors of the service tests that talk to a server.
#include <cstdint>
#include <random>
#include <vector>

#include "kvq/v1/kvq.pb.h"

namespace kvq {

// An fp32 wire tensor of `shape` with N(0, 1) entries from `seed`.
inline v1::Tensor RandomTensor(const std::vector<int64_t>& shape, uint32_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FP32);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(v.data(), v.size() * sizeof(float));
  return t;
}

}  // namespace kvq

#endif  // KVQ_TESTS_SERVICE_WIRE_TEST_DATA_H_
