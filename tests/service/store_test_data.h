#ifndef KVQ_TESTS_SERVICE_STORE_TEST_DATA_H_
#define KVQ_TESTS_SERVICE_STORE_TEST_DATA_H_

// The store, model shape and random K/V of the store's tests.
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "service/sequence.h"
#include "service/sequence_store.h"

namespace kvq {

// A model of `layers` x `kv_heads` x `head_dim`, with twice as many query
// heads as K/V heads (grouped-query attention).
inline ModelShape GqaShape(int layers, int kv_heads, int head_dim) {
  ModelShape m;
  m.num_layers = layers;
  m.num_kv_heads = kv_heads;
  m.num_q_heads = 2 * kv_heads;
  m.head_dim = head_dim;
  return m;
}

// Dense K/V for all layers: [layers, heads, tokens, dim] fp32.
struct Kv {
  int layers = 0;
  std::vector<float> k, v;
  // The first `tokens` tokens of every layer, as an append takes them.
  DenseKv view(int tokens) const {
    return DenseKv{0, layers, tokens, DType::kFloat32, reinterpret_cast<const uint8_t*>(k.data()),
                   reinterpret_cast<const uint8_t*>(v.data())};
  }
};

// K/V of `tokens` tokens drawn from N(0, 1) with `seed`.
inline Kv RandomKv(int layers, int heads, int dim, int tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n;
  Kv kv;
  kv.layers = layers;
  kv.k.resize(static_cast<size_t>(layers) * heads * tokens * dim);
  kv.v.resize(kv.k.size());
  for (float& x : kv.k) x = n(rng);
  for (float& x : kv.v) x = n(rng);
  return kv;
}

// A store of `capacity_bytes` in 64 KiB slabs on the CPU kernels; small
// slabs, so that a test's few sequences spread over several.
inline std::unique_ptr<SequenceStore> NewTestStore(size_t capacity_bytes,
                                                   bool evict_when_full = false) {
  StoreOptions o;
  o.pool.capacity_bytes = capacity_bytes;
  o.pool.slab_bytes = 64 << 10;
  o.evict_when_full = evict_when_full;
  absl::StatusOr<std::unique_ptr<SequenceStore>> s = SequenceStore::Create(o, &CpuBackend());
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

}  // namespace kvq

#endif  // KVQ_TESTS_SERVICE_STORE_TEST_DATA_H_
