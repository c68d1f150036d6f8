// LlamaModel: the forward pass of a Llama-architecture GGUF model (RMSNorm,
// RoPE, SwiGLU, grouped-query attention; fp32 on the CPU through BLAS) whose
// attention reads and writes an AttentionCache, so the KV cache under test
// is exactly what the model attends over.
//
// Weights are dequantized to fp32 at load: the model's own 4-bit weights are
// the same in every run, so differences between runs come from the cache.
#ifndef KVQ_BENCH_EVAL_LLAMA_MODEL_H_
#define KVQ_BENCH_EVAL_LLAMA_MODEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "bench/eval/attention_cache.h"
#include "bench/eval/gguf_file.h"
#include "kernels/rope.h"

namespace kvq::eval {

struct LlamaConfig {
  int num_layers = 0;
  int hidden = 0;
  int ffn = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab = 0;
  int context_length = 0;
  float rms_eps = 1e-5f;
  // GGUF Llama files rotate adjacent pairs (their converter permutes the Q
  // and K projections for it); theta and rotary dim come from the file.
  RopeConfig rope;

  static absl::StatusOr<LlamaConfig> FromGguf(const GgufFile& file);
  CacheShape cache_shape() const {
    return {num_layers, num_kv_heads, num_q_heads, head_dim, rope};
  }
};

class LlamaModel {
 public:
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const GgufFile& file);

  const LlamaConfig& config() const { return config_; }
  // fp32 weights held in memory.
  size_t weight_bytes() const;
  // Largest temporary buffers a Forward of `tokens` tokens allocates.
  size_t ScratchBytes(int tokens) const;

  // Runs `tokens` (positions cache->num_tokens() onward) through the model,
  // appending their K/V to `cache` layer by layer. `logits` receives
  // [tokens.size()][vocab] (every position) or [1][vocab] (the last) .
  absl::Status Forward(absl::Span<const int32_t> tokens, AttentionCache* cache,
                       bool all_logits, std::vector<float>* logits);

  // Layer `layer`'s attention output projection W_o, [hidden][q_heads *
  // head_dim] row-major: column i weighs attention output channel i (value
  // calibration weighs each value channel's error by these columns).
  const std::vector<float>& output_projection(int layer) const { return layers_[layer].wo; }

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down;
  };
  explicit LlamaModel(const LlamaConfig& config) : config_(config), rope_(config.rope, config.head_dim) {}

  LlamaConfig config_;
  Rope rope_;
  std::vector<float> token_embd_;  // [vocab][hidden]
  std::vector<float> output_norm_;
  std::vector<float> output_;      // [vocab][hidden]; empty when tied to token_embd_.
  std::vector<Layer> layers_;
};

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_LLAMA_MODEL_H_
