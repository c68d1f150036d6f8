// AttentionCache: where the evaluated model's attention keeps K/V and
// computes attention. Two implementations run the same kvq kernels:
// KvqAttentionCache (in-process KvStreams, one per layer and KV head) and
// RemoteAttentionCache (a sequence on a running kvq-server, through
// AppendAttend), so a quality figure is a property of the stored scheme, not
// of how it is reached.
#ifndef KVQ_BENCH_EVAL_ATTENTION_CACHE_H_
#define KVQ_BENCH_EVAL_ATTENTION_CACHE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/accounting.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kernels/quant_spec.h"
#include "kernels/rope.h"
#include "kernels/stream_config.h"

namespace kvq::eval {

struct CacheShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  RopeConfig rope;
};

class AttentionCache {
 public:
  virtual ~AttentionCache() = default;

  // True when keys are stored before RoPE (kvq rotates them inside
  // attention); otherwise the model rotates keys before AppendAttend.
  virtual bool KeysBeforeRope() const = 0;

  // Appends `n` tokens to `layer` (k, v: [n][kv_heads * head_dim], positions
  // continuing the layer's stored tokens) and writes the causal attention of
  // the n post-RoPE queries q [n][q_heads * head_dim] over everything the
  // layer holds to out [n][q_heads * head_dim].
  virtual absl::Status AppendAttend(int layer, int n, const float* k, const float* v,
                                    const float* q, float* out) = 0;

  // Tokens stored in the last layer.
  virtual int num_tokens() const = 0;

  // A cache holding the same tokens that later appends do not share.
  virtual absl::StatusOr<std::unique_ptr<AttentionCache>> Fork() const = 0;

  // Bytes the stored K/V occupy, split by component.
  virtual absl::StatusOr<ByteBreakdown> Bytes() const = 0;
};

// Stream config for one (layer, head) of `shape` under `spec`.
StreamConfig MakeStreamConfig(const CacheShape& shape, const QuantSpec& spec);

// The layers [first, last] that hold the scheme under test; the others keep
// an fp16 cache. Per-layer sensitivity probes use it (docs/QUALITY.md).
struct LayerRange {
  int first = 0;
  int last = -1;  // -1: the last layer.

  bool Contains(int layer) const { return layer >= first && (last < 0 || layer <= last); }
};

// A kvq-eval scheme name: a QuantSpec string, optionally followed by
// "@A-B" (or "@A") to quantize only layers A..B of the `num_layers`.
struct EvalScheme {
  QuantSpec spec;
  LayerRange layers;
};
absl::StatusOr<EvalScheme> ParseEvalScheme(absl::string_view name, int num_layers);

// In-process kvq streams. `codebooks` (nuq schemes): one per layer and KV
// head, index layer * num_kv_heads + head. `calibration` (crq schemes, of
// `shape`) must outlive the cache. Layers outside `layers` store
// fp16 (keys rotated by RoPE before they are stored when the scheme takes
// them before RoPE, so the model sees one convention for every layer).
class KvqAttentionCache : public AttentionCache {
 public:
  static absl::StatusOr<std::unique_ptr<KvqAttentionCache>> Create(
      const CacheShape& shape, const QuantSpec& spec, const std::vector<Codebook>* codebooks,
      const KernelBackend* backend, LayerRange layers = {},
      const ModelCalibration* calibration = nullptr);

  bool KeysBeforeRope() const override { return spec_.pre_rope; }
  absl::Status AppendAttend(int layer, int n, const float* k, const float* v, const float* q,
                            float* out) override;
  int num_tokens() const override;
  absl::StatusOr<std::unique_ptr<AttentionCache>> Fork() const override;
  absl::StatusOr<ByteBreakdown> Bytes() const override;

  // The append half of AppendAttend: stores `n` tokens of `layer` without
  // attending (DecodeFaithfulCache appends one token at a time through it
  // and reads back what each step's attention would see).
  absl::Status Append(int layer, int n, const float* k, const float* v);
  const KvStream& kv_stream(int layer, int head) const {
    return *streams_[layer * shape_.num_kv_heads + head];
  }

 private:
  KvqAttentionCache(const CacheShape& shape, const QuantSpec& spec, const KernelBackend* backend,
                    LayerRange layers)
      : shape_(shape), spec_(spec), backend_(backend), layers_(layers) {}
  KvStream& stream(int layer, int head) { return *streams_[layer * shape_.num_kv_heads + head]; }

  CacheShape shape_;
  QuantSpec spec_;
  const KernelBackend* backend_;
  LayerRange layers_;
  std::unique_ptr<Rope> rope_;      // Rotates pre-RoPE keys of the fp16 layers.
  std::vector<float> rotated_;      // Scratch: those keys after RoPE.
  std::vector<std::unique_ptr<KvStream>> streams_;  // [layer][kv_head]
  std::vector<int32_t> positions_;                  // Scratch: query positions.
  std::vector<float> lse_;                          // Scratch: discarded LSE.
};

// Plain fp32 attention over every appended row (no kvq): the exact
// reference the fp16 scheme is checked against, and the recorder of K/V
// rows that codebook calibration learns from.
class ExactAttentionCache : public AttentionCache {
 public:
  explicit ExactAttentionCache(const CacheShape& shape, bool keys_before_rope = false);

  bool KeysBeforeRope() const override { return keys_before_rope_; }
  absl::Status AppendAttend(int layer, int n, const float* k, const float* v, const float* q,
                            float* out) override;
  int num_tokens() const override;
  absl::StatusOr<std::unique_ptr<AttentionCache>> Fork() const override;
  absl::StatusOr<ByteBreakdown> Bytes() const override;

  // Rows appended to `layer`: [tokens][kv_heads * head_dim] (pre-RoPE keys
  // when keys_before_rope).
  const std::vector<float>& keys(int layer) const { return raw_k_[layer]; }
  const std::vector<float>& values(int layer) const { return v_[layer]; }

 private:
  CacheShape shape_;
  bool keys_before_rope_;
  std::unique_ptr<Rope> rope_;
  std::vector<std::vector<float>> k_, v_;  // Keys post-RoPE for attention.
  std::vector<std::vector<float>> raw_k_;  // What was appended.
};

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_ATTENTION_CACHE_H_
