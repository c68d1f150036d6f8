// DecodeFaithfulCache: attention that sees, for every query, the cache state
// token-by-token decoding would give it, while the model runs whole chunks.
//
// During decoding, the query at position p attends after token p has been
// appended: keys the stream has quantized by then (its pages) are read
// quantized, the others (the sink and the fp16 tail, the residual window)
// in fp16. A chunked prefill instead appends a whole chunk before its
// queries attend, so most of the residual window is quantized before anyone
// reads it in fp16. This cache appends each token of a chunk to real
// KvStreams one at a time, records after each append how many tokens the
// stream holds quantized and what the token reads back as while it is still
// in fp16, and reads each token's quantized form once it is flushed. The
// query at p then attends over the key/value rows masked per (query, key)
// pair: quantized where the stream had quantized key j when p was appended,
// fp16 otherwise. Because every layer's K/V of token p come from hidden
// states that saw exactly that mask, one pass over the window reproduces the
// teacher-forced token-by-token decode (up to float summation order;
// tests/eval/decode_cache_test.cc checks it against a literal decode).
#ifndef KVQ_BENCH_EVAL_DECODE_CACHE_H_
#define KVQ_BENCH_EVAL_DECODE_CACHE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/eval/attention_cache.h"

namespace kvq::eval {

class DecodeFaithfulCache : public AttentionCache {
 public:
  // Same arguments as KvqAttentionCache::Create.
  static absl::StatusOr<std::unique_ptr<DecodeFaithfulCache>> Create(
      const CacheShape& shape, const QuantSpec& spec, const std::vector<Codebook>* codebooks,
      const KernelBackend* backend, LayerRange layers = {},
      const ModelCalibration* calibration = nullptr);

  bool KeysBeforeRope() const override { return streams_->KeysBeforeRope(); }
  absl::Status AppendAttend(int layer, int n, const float* k, const float* v, const float* q,
                            float* out) override;
  int num_tokens() const override { return streams_->num_tokens(); }
  // Scoring runs one pass over a window and never forks.
  absl::StatusOr<std::unique_ptr<AttentionCache>> Fork() const override;
  absl::StatusOr<ByteBreakdown> Bytes() const override { return streams_->Bytes(); }

 private:
  // What one (layer, KV head) reads back, post-RoPE and un-rotated, as
  // attention sees it: [tokens][head_dim] each.
  struct Views {
    std::vector<float> k_fp16, v_fp16;    // While the token is in the sink or tail.
    std::vector<float> k_quant, v_quant;  // Once it is quantized (rows of
                                          // tokens never quantized stay 0).
  };
  DecodeFaithfulCache(const CacheShape& shape, std::unique_ptr<KvqAttentionCache> streams)
      : shape_(shape),
        streams_(std::move(streams)),
        views_(static_cast<size_t>(shape.num_layers) * shape.num_kv_heads),
        quantized_at_(shape.num_layers) {}
  Views& views(int layer, int head) { return views_[layer * shape_.num_kv_heads + head]; }
  // Appends tokens one at a time and fills the views of `layer`.
  absl::Status AppendOneByOne(int layer, int n, const float* k, const float* v);
  // Whether key j is quantized when the query at position p attends.
  bool Quantized(int layer, int p, int j) const {
    const int base = streams_->kv_stream(layer, 0).page_base();
    return j >= base && j < base + quantized_at_[layer][p];
  }

  CacheShape shape_;
  std::unique_ptr<KvqAttentionCache> streams_;
  std::vector<Views> views_;                   // [layer][kv_head]
  std::vector<std::vector<int>> quantized_at_;  // [layer][p]: quantized tokens once p is in.
};

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_DECODE_CACHE_H_
