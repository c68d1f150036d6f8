// How a prompt's K/V becomes the chunks of one Append stream.
//
// A prompt is K and V of shape [layers, kv_heads, tokens, head_dim]. The
// plan splits it into rectangles (a range of layers x a range of tokens) of
// at most max_chunk_bytes payload each: whole layers per chunk when a layer
// fits, otherwise one layer per chunk split along tokens. Chunks are
// layer-major, so every layer receives its tokens in order.
//
// A quantized plan quantizes on the client with the kernels and sends, per
// layer: the tokens needed to reach a raw-page boundary (the sink, and any
// alignment after tokens the sequence already holds) as dense rows, then the
// quantized part as raw pages, then the rest (what would sit in the fp16
// tail) as dense rows. Raw pages are only accepted where KvStream::
// AcceptsPages() holds: sink complete, tail empty, quantized part on a page
// boundary; and they hold a multiple of the sequence's block_tokens.
#ifndef KVQ_CLIENT_APPEND_PLAN_H_
#define KVQ_CLIENT_APPEND_PLAN_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/host_tensor.h"
#include "client/sequence_config.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kernels/page_allocator.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {

inline constexpr int64_t kDefaultMaxChunkBytes = int64_t{1} << 20;

// Layers [layer_begin, layer_begin + layers) x tokens [token_begin,
// token_begin + tokens), layer indices relative to the prompt.
struct ChunkRange {
  int layer_begin = 0;
  int layers = 0;
  int token_begin = 0;
  int tokens = 0;
  friend bool operator==(const ChunkRange&, const ChunkRange&) = default;
};

// Splits layers x tokens into chunks. Tokens go in units of `token_unit`
// (the last unit of a layer may be short); one unit of one layer costs
// `unit_bytes`. A chunk holds at most max_bytes, but never less than one
// unit of one layer. Empty when layers or tokens is 0.
std::vector<ChunkRange> PlanChunks(int layers, int tokens, int token_unit, int64_t unit_bytes,
                                   int64_t max_bytes);

// Where the tokens of a quantized append go (token counts, in prompt order).
struct QuantizedSplit {
  int dense_head = 0;  // Sent as dense rows first (sink, boundary alignment).
  int paged = 0;       // Sent as raw pages (a multiple of block_tokens).
  int dense_tail = 0;  // Sent as dense rows last.
  int block_tokens = 1;
  int page_tokens = 1;
  int64_t page_bytes = 0;
};

// `start_tokens` is what the sequence already holds in every layer (0 for a
// fresh one, CreateSequenceResponse.num_tokens after prefix reuse).
// `block_tokens` 0 derives the server's value (the flush block for kivi, a
// page otherwise). Schemes that cannot take pages (fp8_e4m3) send
// everything dense.
absl::StatusOr<QuantizedSplit> SplitForPages(const StreamConfig& config, int start_tokens,
                                             int tokens, int block_tokens = 0);

struct PlannedChunk {
  enum class Kind { kDense, kPages };
  Kind kind = Kind::kDense;
  ChunkRange range;          // Prompt-relative tokens.
  int64_t payload_bytes = 0; // K+V bytes, or page bytes.
};

struct AppendPlan {
  std::vector<PlannedChunk> chunks;
  int64_t total_bytes = 0;
  DType dense_dtype = DType::kFloat16;  // Wire dtype of dense chunks.
  QuantizedSplit split;                 // Quantized plans only.
  bool quantized = false;
};

struct PlanOptions {
  int64_t max_chunk_bytes = kDefaultMaxChunkBytes;
  // First model layer the prompt covers (KvChunk.layer_begin of chunk 0).
  int layer_begin = 0;
  // Threads quantizing a group of layers (0: one per hardware thread).
  int threads = 0;
};

// Dense plan: every token as `wire_dtype` rows.
absl::StatusOr<AppendPlan> PlanDenseAppend(const HostTensor& k, const HostTensor& v,
                                           DType wire_dtype, const PlanOptions& options);

// Quantized plan for a sequence of `config`. Dense rows travel as fp16 for
// kivi schemes without `rotate` (the server keeps them as fp16 before
// quantizing, so nothing changes) and in the input dtype otherwise.
absl::StatusOr<AppendPlan> PlanQuantizedAppend(const HostTensor& k, const HostTensor& v,
                                               const StreamConfig& config, int start_tokens,
                                               int block_tokens, const PlanOptions& options);

// Builds the KvChunk of each planned chunk. Quantizes a layer's pages once
// (local streams with the sequence's config) and keeps them while the
// layer's chunks are built, so chunks must be requested in plan order.
// Layers are quantized a window at a time, enough streams to keep every
// thread busy (one layer's few KV heads would leave threads idle), and the
// pages of a window are reused by the next (fresh memory costs a page
// fault per 4 KiB).
class ChunkBuilder {
 public:
  // k, v, sequence and backend must outlive the builder. `sequence` (needed
  // for quantized plans) supplies nuq codebooks.
  ChunkBuilder(const HostTensor& k, const HostTensor& v, const AppendPlan& plan,
               const PlanOptions& options, const SequenceConfig* sequence = nullptr,
               const KernelBackend* backend = &CpuBackend());

  absl::StatusOr<v1::KvChunk> Build(const PlannedChunk& chunk);

 private:
  absl::Status QuantizeLayers(int layer_begin, int layers);
  // Layers to quantize at once from layer_begin on, at least `layers`.
  int WindowLayers(int layer_begin, int layers) const;
  absl::StatusOr<std::unique_ptr<KvStream>> QuantizeStream(int layer, int head);

  const HostTensor& k_;
  const HostTensor& v_;
  const AppendPlan& plan_;
  PlanOptions options_;
  const SequenceConfig* sequence_;
  const KernelBackend* backend_;
  StreamConfig config_;
  bool config_ready_ = false;
  // Declared before streams_, which return their pages to it.
  RecyclingPageAllocator pages_;
  // Streams of the layers last quantized, [layer - quantized_begin_][head].
  int quantized_begin_ = -1;
  int quantized_layers_ = 0;
  std::vector<std::unique_ptr<KvStream>> streams_;
};

// [layers, kv_heads, tokens, head_dim] slice of a 4-D tensor, in `dtype`.
HostTensor SliceKv(const HostTensor& t, const ChunkRange& range, DType dtype);

}  // namespace kvq

#endif  // KVQ_CLIENT_APPEND_PLAN_H_
