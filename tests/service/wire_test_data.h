#ifndef KVQ_TESTS_SERVICE_WIRE_TEST_DATA_H_
#define KVQ_TESTS_SERVICE_WIRE_TEST_DATA_H_

// Requests and random request tensors of the service tests that talk to a
// server.
#include <cstdint>
#include <random>
#include <string>
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

// CreateSequence of `id`: `layers` x `kv_heads` streams of `head_dim`,
// `q_heads` query heads, stored as `scheme`.
inline v1::CreateSequenceRequest MakeCreateSequenceRequest(const std::string& id, int layers,
                                                           int kv_heads, int q_heads,
                                                           int head_dim,
                                                           const std::string& scheme) {
  v1::CreateSequenceRequest req;
  req.set_sequence_id(id);
  v1::ModelLayout* l = req.mutable_layout();
  l->set_num_layers(layers);
  l->set_num_kv_heads(kv_heads);
  l->set_num_q_heads(q_heads);
  l->set_head_dim(head_dim);
  req.set_scheme(scheme);
  return req;
}

// An Append of `id` whose k and v are RandomTensor(`shape`) from `seed` and
// `seed + 1`.
inline v1::AppendRequest RandomAppendRequest(const std::string& id,
                                             const std::vector<int64_t>& shape, uint32_t seed) {
  v1::AppendRequest append;
  append.mutable_sequence()->set_sequence_id(id);
  *append.mutable_chunk()->mutable_k() = RandomTensor(shape, seed);
  *append.mutable_chunk()->mutable_v() = RandomTensor(shape, seed + 1);
  return append;
}

}  // namespace kvq

#endif  // KVQ_TESTS_SERVICE_WIRE_TEST_DATA_H_
