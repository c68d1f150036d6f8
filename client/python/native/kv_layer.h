// KvLayer: one layer of one sequence, as the Python module exposes it —
// num_kv_heads KvStreams of one StreamConfig, appended and read together.
//
// Its raw pages are the bytes a kvq server stores for that layer, in the
// server's raw-pages order (kvq.v1.QuantizedPages: [kv_head][page]), so a
// client can quantize a prompt here and send the pages instead of fp16.
#ifndef KVQ_CLIENT_PYTHON_NATIVE_KV_LAYER_H_
#define KVQ_CLIENT_PYTHON_NATIVE_KV_LAYER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/accounting.h"
#include "kernels/backend.h"
#include "kernels/calibration.h"
#include "kernels/kv_stream.h"
#include "kernels/stream_config.h"
#include "kernels/tensor.h"

namespace kvq {

// K or V of every head of a layer: head h's rows start at data + h *
// head_stride elements, row r of a head at + r * row_stride elements; each
// row is head_dim contiguous elements.
struct HeadsView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int heads = 0;
  int tokens = 0;
  int head_dim = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;

  ConstTensorView Head(int h) const;
};

// The writable form, for reads.
struct MutableHeadsView {
  float* data = nullptr;
  int heads = 0;
  int tokens = 0;
  int head_dim = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;

  TensorView Head(int h) const;
};

class KvLayer {
 public:
  // `codebooks` (nuq only): one per kv head, empty otherwise.
  // `calibration` (calibrated schemes, crq): the model's calibration, of
  // which this layer takes layer `calibration_layer`'s heads; the stream
  // refuses a crq scheme without one, as KvStream::Create does.
  // INVALID_ARGUMENT when its KV heads or head_dim are not the layer's, or
  // calibration_layer is not one of its layers.
  static absl::StatusOr<std::unique_ptr<KvLayer>> Create(
      const StreamConfig& config, int num_kv_heads, const KernelBackend* backend,
      const std::vector<Codebook>& codebooks, const ModelCalibration* calibration = nullptr,
      int calibration_layer = 0);

  int num_kv_heads() const { return static_cast<int>(streams_.size()); }
  int head_dim() const { return config_.head_dim; }
  int num_tokens() const { return streams_[0]->num_tokens(); }
  const StreamConfig& config() const { return config_; }
  const KvStream& stream(int head) const { return *streams_[head]; }

  // Appends k and v ([heads, tokens, head_dim] each) to every head. Every
  // head's input is checked before any is touched.
  absl::Status Append(const HeadsView& k, const HeadsView& v);

  // Dequantized float32 K and V of tokens [begin, end) (post-RoPE keys).
  absl::Status Read(int begin, int end, const MutableHeadsView& k, const MutableHeadsView& v) const;

  // Fused attention. q is [num_q_heads, q_len, head_dim] float32 at `q`
  // (row r of head h at q + (h * q_len + r) * head_dim), out the same, lse
  // [num_q_heads, q_len]. positions: q_len causal positions, or empty for
  // every stored token visible.
  absl::Status Attend(const float* q, int num_q_heads, int q_len,
                      const std::vector<int32_t>& positions, float scale, float* out,
                      float* lse) const;

  // Raw pages of quantized tokens [begin, end) (positions counted from the
  // first quantized token, begin on a page boundary) of every head, head
  // after head.
  absl::StatusOr<std::string> Pages(int begin, int end) const;
  // Appends `tokens` tokens given as raw pages of every head, head after
  // head (`size` bytes: exactly num_kv_heads * PagesFor(tokens) pages).
  // All-or-nothing across heads.
  absl::Status AppendPages(const uint8_t* data, size_t size, int tokens);

  // Allocated bytes of every head, by component.
  ByteBreakdown Bytes() const;

 private:
  KvLayer(const StreamConfig& config, const KernelBackend* backend,
          std::vector<std::unique_ptr<KvStream>> streams)
      : config_(config), backend_(backend), streams_(std::move(streams)) {}

  StreamConfig config_;
  const KernelBackend* backend_;
  std::vector<std::unique_ptr<KvStream>> streams_;
};

}  // namespace kvq

#endif  // KVQ_CLIENT_PYTHON_NATIVE_KV_LAYER_H_
