// KernelBackend: the one interface every compute backend implements.
//
// "ref" is the scalar reference (obviously right, slow); "cpu" is the SIMD,
// multi-threaded path; "cuda" lives in kernels/cuda. All pass the same typed
// tests in tests/unit against the reference.
#ifndef KVQ_KERNELS_BACKEND_H_
#define KVQ_KERNELS_BACKEND_H_

#include <cmath>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kv_stream.h"

namespace kvq {

// Attention of some queries over a token range of one stream (one KV head).
//
// Queries are what the model's attention sees (post-RoPE, unrotated); for
// query i and head g of the GQA group, q + i*q_stride + g*head_dim. Outputs
// use the same addressing with out_stride; lse + i*lse_stride + g receives
// the natural log of sum(exp(scale * q.k)) over the visible keys (-inf when
// none is visible, with a zero output), so partial results merge exactly.
//
// Error contract (every backend; tests/unit/attention_contract_test.cc):
// measured against fp64 attention over the *original* K/V (keys post-RoPE),
// a backend's error on a stream's pages may exceed the "ref" backend's
// error on the same pages by at most 10%: a kernel may add rounding of its
// own (int8 queries, fp16 tensor-core operands, float sums, float RoPE
// angles) on top of the scheme's quantization error, but no more than a
// tenth of it. The measure is the worst (query, head) of a call: output
// error relative to the row's largest |out| (floored at the values' RMS),
// and |lse| error. Where the scheme's own error is at float rounding
// (fp16/bf16 passthrough), the allowance is an absolute floor of 1e-5,
// a few times fp32 summation over the keys (about 2 ulp-scale of fp32).
struct AttentionTask {
  const KvStream* stream = nullptr;
  int key_begin = 0;
  int key_end = -1;  // -1: stream->num_tokens().
  int num_queries = 1;
  const float* q = nullptr;
  int q_stride = 0;
  // Causal mask: query i sees keys with position <= q_positions[i].
  // nullptr: every key in the range is visible.
  const int32_t* q_positions = nullptr;
  float* out = nullptr;
  int out_stride = 0;
  float* lse = nullptr;
  int lse_stride = 0;
};

// A check of pages before their bytes enter attention: the service's page
// checksums. A backend that calls it (KernelBackend::ChecksPages) does so
// from whichever of its threads reads the page, right before reading it,
// so the hash and the attention share one trip of the page through the
// cache and the hashing is spread over the backend's threads.
class PageCheck {
 public:
  virtual ~PageCheck() = default;
  // Page `page` of `stream` is about to be read. Thread-safe; may be called
  // more than once for a page. A mismatch is recorded by the PageCheck, not
  // returned: the backend goes on and its caller, who asks the PageCheck
  // afterwards, discards the results.
  virtual void Check(const KvStream& stream, int page) const = 0;
};

struct AttentionOptions {
  int group_size = 1;           // Query heads per KV head (GQA).
  float softmax_scale = 0.0f;   // 0: 1 / sqrt(head_dim).
  // Called for every page read when the backend ChecksPages(); else unused.
  const PageCheck* page_check = nullptr;
};

class KernelBackend {
 public:
  virtual ~KernelBackend() = default;
  virtual absl::string_view name() const = 0;

  // Quantizes `n` float rows (stored basis) into rows [row0, row0 + n) of a
  // page. For block-quantized sides n and row0 are multiples of the block.
  virtual void QuantizeRows(const KvStream& stream, Side side, const float* rows,
                            int n, uint8_t* page, int row0) const = 0;

  // QuantizeRows from fp16 rows (bit patterns), writing the bytes QuantizeRows
  // writes for their float values, without a float copy of the input.
  // Returns false, writing nothing, where the backend has no such path for
  // this stream and side: the caller converts to floats.
  virtual bool QuantizeRowsHalf(const KvStream& stream, Side side, const uint16_t* rows, int n,
                                uint8_t* page, int row0) const {
    (void)stream, (void)side, (void)rows, (void)n, (void)page, (void)row0;
    return false;
  }

  // Dequantizes page rows [row0, row0 + n) to floats (stored basis, outliers
  // applied, no RoPE, no inverse rotation).
  virtual void DequantizeRows(const KvStream& stream, Side side, const uint8_t* page,
                              int row0, int n, float* out) const = 0;
  // DequantizeRows straight to fp16 rows (row r at out + r * stride), the
  // bits FloatToRow gives for DequantizeRows' floats, in one pass. Returns
  // false, writing nothing, where the backend has no such path for this
  // stream and side (the same answer for every page and row range of that
  // side): the caller converts the floats.
  virtual bool DequantizeRowsHalf(const KvStream& stream, Side side, const uint8_t* page,
                                  int row0, int n, uint16_t* out, size_t stride) const {
    (void)stream, (void)side, (void)page, (void)row0, (void)n, (void)out, (void)stride;
    return false;
  }

  // Waits for the quantize and dequantize work this backend queued (a
  // device backend only enqueues it) and returns the first error since the
  // last call. KvStream calls it before an Append, AppendPages, Read or
  // Fork returns, so a device error fails that call (an append is then
  // undone: nothing of it stays stored) instead of surfacing later. Host
  // backends finish their work in the call: OK.
  virtual absl::Status Synchronize() const { return absl::OkStatus(); }
  // Whether QuantizeRows / DequantizeRows may return before their work is
  // done, so that Synchronize() may report an error. An append keeps what
  // it needs to undo itself (the fp16 tail it flushes) only then.
  virtual bool enqueues() const { return false; }

  // Runs every task; tasks may share streams. INVALID_ARGUMENT on a malformed
  // task (names the task index and field).
  virtual absl::Status Attend(absl::Span<const AttentionTask> tasks,
                              const AttentionOptions& options) const = 0;

  // Whether Attend calls options.page_check for every page it reads. A
  // caller with a backend that does not checks the pages itself first.
  virtual bool ChecksPages() const { return false; }

  // Whether Attend would run these (valid) tasks on threads besides the
  // caller's. A server runs such calls on one thread of its own, so that one
  // worker team serves them all (service/kernel_thread.h).
  virtual bool AttendUsesThreads(absl::Span<const AttentionTask> tasks,
                                 const AttentionOptions& options) const {
    (void)tasks, (void)options;
    return false;
  }
};

const KernelBackend& RefBackend();
const KernelBackend& CpuBackend();
// "ref", "cpu" or "cuda_host" ("cuda" when built with it).
absl::StatusOr<const KernelBackend*> BackendByName(absl::string_view name);
// The names BackendByName knows in this build, ", "-separated.
absl::string_view CompiledBackendNames();

// Checks tasks against their streams: shared by every backend.
absl::Status ValidateAttention(absl::Span<const AttentionTask> tasks,
                               const AttentionOptions& options);
// OUT_OF_RANGE naming the first row of `tasks` whose result is not finite:
// an output element NaN or infinite, or a log-sum-exp that is not finite
// although the row sees keys (a row that sees none has -inf and zeros).
// Float attention overflows when |q . k| * softmax_scale passes float's
// range (finite queries or stored keys near it; bf16 pages hold values up
// to 3.4e38) or a sum of weighted values does; every backend then fails
// the call rather than return NaN, or zeros for scores that all overflowed
// to -inf.
absl::Status CheckAttentionResults(absl::Span<const AttentionTask> tasks,
                                   const AttentionOptions& options);
inline float SoftmaxScale(const AttentionOptions& o, int head_dim) {
  return o.softmax_scale > 0.0f ? o.softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

// Merges two partial attentions of the same queries over disjoint key sets:
// o = (e^(la-l) oa + e^(lb-l) ob), l = log(e^la + e^lb). Any of them may be
// -inf (empty).
void MergeAttention(const float* out_a, float lse_a, const float* out_b, float lse_b,
                    int head_dim, float* out, float* lse);

}  // namespace kvq

#endif  // KVQ_KERNELS_BACKEND_H_
