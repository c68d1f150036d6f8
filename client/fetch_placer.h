// Fetch responses placed into [layers, kv_heads, tokens, head_dim] tensors
// as they arrive: dense rows copied (FetchPlacer), raw pages dequantized
// here without being stored (RawPagePlacer). Each checks that a message
// continues its layer's range, so a stream that skips, repeats or reorders
// messages fails with DATA_LOSS instead of leaving stale rows behind.
#ifndef KVQ_CLIENT_FETCH_PLACER_H_
#define KVQ_CLIENT_FETCH_PLACER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "client/host_tensor.h"
#include "client/kvq_client.h"
#include "client/local_sequence.h"
#include "kernels/kv_stream.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {

// Dense messages of the fetch `options` into k and v: `tokens` tokens per
// layer (< 0: the rest of k's token axis) from options.token_begin, which
// lands at token index `out_offset` of k and v.
class FetchPlacer {
 public:
  FetchPlacer(const FetchOptions& options, HostTensor* k, HostTensor* v, int out_offset = 0,
              int tokens = -1);

  absl::Status Place(const v1::FetchResponse& m);
  // After a retried stream restarts.
  void Reset();
  absl::Status CheckComplete() const;
  int64_t bytes() const { return bytes_; }

 private:
  const FetchOptions& options_;
  HostTensor* k_;
  HostTensor* v_;
  const int64_t layers_, heads_, out_tokens_, d_, out_offset_, tokens_;
  const size_t elem_;
  std::vector<int64_t> filled_;  // Tokens so far, per layer.
  int64_t bytes_ = 0;
};

// Raw-page messages of a fetch of tokens [pages_begin, end) (pages_begin on
// a page boundary) of `local`'s layers, dequantized straight into k and v:
// tokens [begin, end) land at token index (t - out_begin). `local`'s
// streams (empty) supply the layout, RoPE, rotation and codebooks. Pages
// are validated as KvStream::AppendPages validates them. A message's K and V
// of each head are dequantized on up to `threads` threads (<= 0: one per
// hardware thread); the bytes do not depend on the count.
class RawPagePlacer {
 public:
  RawPagePlacer(const LocalSequence& local, const ReadOptions& read, int pages_begin, int begin,
                int end, int out_begin, HostTensor* k, HostTensor* v, int threads = 0);

  absl::Status Place(const v1::FetchResponse& m);
  void Reset();
  absl::Status CheckComplete() const;
  int64_t bytes() const { return bytes_; }

 private:
  const LocalSequence& local_;
  const ReadOptions read_;
  const int pages_begin_, begin_, end_, out_begin_;
  HostTensor* k_;
  HostTensor* v_;
  const int threads_;
  std::vector<int> next_;  // Per layer: the token the next message starts at.
  int64_t bytes_ = 0;
};

}  // namespace kvq

#endif  // KVQ_CLIENT_FETCH_PLACER_H_
