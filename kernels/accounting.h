// Exact byte accounting: what a stream costs, split by what the bytes hold.
//
// AnalyticBytes() predicts the allocation from the scheme alone; KvStream::
// AllocatedBytes() sums what was really allocated. Tests hold them equal and
// the benchmark reports bits/element from the allocation.
#ifndef KVQ_KERNELS_ACCOUNTING_H_
#define KVQ_KERNELS_ACCOUNTING_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "kernels/page_layout.h"
#include "kernels/stream_config.h"

namespace kvq {

struct ByteBreakdown {
  size_t codes = 0;     // Quantized (or fp16/bf16) code rows in use.
  size_t scales = 0;    // Scales and zero points (and fp8 per-head scales).
  size_t outliers = 0;  // Sparse outlier tables (index + fp16 value).
  size_t residual = 0;  // The fp16 window buffer (allocated capacity).
  size_t sink = 0;      // fp16 sink tokens (allocated capacity).
  size_t codebook = 0;  // nuq levels.
  size_t padding = 0;   // Alignment and unused rows of allocated pages.

  size_t total() const {
    return codes + scales + outliers + residual + sink + codebook + padding;
  }
  // Bits per stored K or V element for `tokens` tokens of `head_dim`.
  double BitsPerElement(int tokens, int head_dim) const {
    return tokens == 0 ? 0.0 : 8.0 * total() / (2.0 * tokens * head_dim);
  }
  ByteBreakdown& operator+=(const ByteBreakdown& o);
  friend bool operator==(const ByteBreakdown&, const ByteBreakdown&) = default;
};

// Bytes of a stream's header (the fp8 per-head scales), inside its aux block.
inline constexpr size_t kStreamHeaderBytes = 8;

// The one non-page allocation of a stream (header, nuq levels, fp16 sink
// and tail rows), 0 when the scheme needs none of them.
size_t AuxBytes(const StreamConfig& config);

// Breakdown of a stream with `quantized` tokens in `pages` pages.
ByteBreakdown StreamBytes(const StreamConfig& config, const PageLayout& layout, int quantized,
                          int pages, size_t aux_bytes);

// Bytes one stream of `config` allocates after `tokens` appended tokens.
absl::StatusOr<ByteBreakdown> AnalyticBytes(const StreamConfig& config, int tokens);

// The headline figure ignoring fixed costs: code bits plus per-element
// scale/zero and outlier bits (e.g. 3.0 for kivi2:g32).
double NominalBitsPerElement(const StreamConfig& config);

}  // namespace kvq

#endif  // KVQ_KERNELS_ACCOUNTING_H_
