// RemoteAttentionCache: the evaluated model's KV cache as one sequence on a
// running kvq-server; each layer of each forward step is one AppendAttend
// (append this step's K/V, attend causally over everything stored), the way
// a decode worker would drive kvq.
#ifndef KVQ_BENCH_EVAL_REMOTE_CACHE_H_
#define KVQ_BENCH_EVAL_REMOTE_CACHE_H_

#include <memory>
#include <string>
#include <vector>

#include "bench/eval/attention_cache.h"
#include "client/kvq_client.h"

namespace kvq::eval {

class RemoteAttentionCache : public AttentionCache {
 public:
  // Creates a sequence of `shape` in `scheme` (codebooks: nuq schemes, one
  // per layer and KV head; calibration: crq schemes, the name of one the
  // server has loaded). The client must outlive the cache.
  static absl::StatusOr<std::unique_ptr<RemoteAttentionCache>> Create(
      KvqClient* client, const CacheShape& shape, const QuantSpec& spec,
      const std::vector<Codebook>* codebooks, const std::string& calibration = "");
  ~RemoteAttentionCache() override;  // Releases the sequence.

  bool KeysBeforeRope() const override { return spec_.pre_rope; }
  absl::Status AppendAttend(int layer, int n, const float* k, const float* v, const float* q,
                            float* out) override;
  int num_tokens() const override { return tokens_.back(); }
  absl::StatusOr<std::unique_ptr<AttentionCache>> Fork() const override;
  absl::StatusOr<ByteBreakdown> Bytes() const override;

 private:
  RemoteAttentionCache(KvqClient* client, const CacheShape& shape, const QuantSpec& spec,
                       std::string id)
      : client_(client), shape_(shape), spec_(spec), id_(std::move(id)),
        tokens_(shape.num_layers, 0) {}

  KvqClient* client_;
  CacheShape shape_;
  QuantSpec spec_;
  std::string id_;
  std::vector<int> tokens_;  // Per layer.
};

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_REMOTE_CACHE_H_
