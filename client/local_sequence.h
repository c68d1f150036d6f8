// LocalSequence: a sequence's streams held by the client, built with the
// same kernels and config as the server's. It takes what travels on the
// wire — Append chunks (dense rows or raw pages) and raw FetchResponses —
// and dequantizes locally, so a client can fetch raw pages (2-5 bits per
// element on the wire) and expand them itself.
//
// Fetch responses are applied in token order per layer: dense k/v
// ([kv_heads, tokens, head_dim]; for the sink and the fp16 tail, fetched as
// fp16 with apply_rope = false) are appended as rows, raw pages as pages.
// The server cuts raw fetches into messages of whole pages, which need not
// end on a flush block: pages are held back until they do.
#ifndef KVQ_CLIENT_LOCAL_SEQUENCE_H_
#define KVQ_CLIENT_LOCAL_SEQUENCE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/host_tensor.h"
#include "client/sequence_config.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {

// K and V of a layer range and token range: [layers, kv_heads, tokens,
// head_dim] each.
struct FetchedKv {
  int layer_begin = 0;
  int token_begin = 0;
  HostTensor k;
  HostTensor v;
};

// Where the first `num_tokens` tokens of a stream of `config` live: the
// fp16 sink, pages, the fp16 tail (the stream invariant: the tail holds
// fewer than flush_tokens() tokens).
struct TokenPlacement {
  int sink = 0;
  int quantized = 0;
  int tail = 0;
};
TokenPlacement PlaceTokens(const StreamConfig& config, int num_tokens);

class LocalSequence {
 public:
  // Streams for layers [layer_begin, layer_begin + layers) of a sequence of
  // `config` (layers < 0: to the last layer). INVALID_ARGUMENT for a bad
  // config or layer range.
  // Pages come from `pages` (the heap when null), which must outlive the
  // sequence: a RecyclingPageAllocator saves the page faults of fresh
  // memory when sequences are built and dropped in a loop.
  static absl::StatusOr<std::unique_ptr<LocalSequence>> Create(
      const SequenceConfig& config, int layer_begin = 0, int layers = -1,
      const KernelBackend* backend = &CpuBackend(), PageAllocator* pages = nullptr);

  // Appends one Append chunk as the server would: dense rows at the end of
  // each layer it covers, or raw pages (which need KvStream::AcceptsPages()).
  // Unlike the server, not all-or-nothing across streams.
  // INVALID_ARGUMENT for shapes, dtypes, page sizes; OUT_OF_RANGE for layers
  // outside this sequence; FAILED_PRECONDITION from AppendPages.
  absl::Status ApplyChunk(const v1::KvChunk& chunk);
  // Appends one FetchResponse; its token_begin must be where the layer's
  // tokens (including pages held back) end: FAILED_PRECONDITION names the
  // gap otherwise.
  absl::Status ApplyFetched(const v1::FetchResponse& response);

  int layer_begin() const { return layer_begin_; }
  int layers() const { return layers_; }
  int kv_heads() const { return kv_heads_; }
  // Tokens in a layer (model index); -1 outside the range held.
  int layer_tokens(int layer) const;
  // Tokens stored in every layer held.
  int num_tokens() const;
  const KvStream& stream(int layer, int head) const;

  // K and V of tokens [token_begin, token_end) of every layer held
  // (token_end < 0: num_tokens()). OUT_OF_RANGE outside what is stored;
  // FAILED_PRECONDITION while pages that end mid flush block are held back.
  // Streams are dequantized on up to `threads` threads (<= 0: one per
  // hardware thread); the bytes do not depend on the count.
  absl::StatusOr<FetchedKv> Read(int token_begin, int token_end, const ReadOptions& options,
                                 int threads = 0) const;
  // Read into tensors the caller owns (and may reuse): k and v must be
  // [layers(), kv_heads(), token_end - token_begin, head_dim] of
  // options.dtype (INVALID_ARGUMENT naming the tensor otherwise). Saves
  // the zero-fill and page faults of a fresh result.
  absl::Status ReadInto(int token_begin, int token_end, const ReadOptions& options,
                        HostTensor* k, HostTensor* v, int threads = 0) const;

 private:
  LocalSequence() = default;
  absl::Status AppendDense(int layer, int layers, const v1::Tensor& k, const v1::Tensor& v,
                           bool per_layer_shape);
  absl::Status AppendPages(int layer, const v1::QuantizedPages& pages);
  absl::Status CheckLayers(int layer, int layers) const;
  absl::Status HoldPages(int layer, const v1::QuantizedPages& pages);
  absl::Status AppendHeadPages(int layer, int head, const uint8_t* data, int tokens);
  absl::Status CheckReadRange(int token_begin, int token_end) const;

  // Raw pages of one layer received but not yet appended, per head.
  struct HeldPages {
    int tokens = 0;
    std::vector<std::string> heads;
  };

  StreamConfig config_;
  int layer_begin_ = 0;
  int layers_ = 0;
  int kv_heads_ = 0;
  std::vector<std::unique_ptr<KvStream>> streams_;  // [layer][head].
  std::vector<HeldPages> held_;                      // [layer].
};

}  // namespace kvq

#endif  // KVQ_CLIENT_LOCAL_SEQUENCE_H_
