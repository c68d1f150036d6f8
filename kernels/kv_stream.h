// KvStream: the quantized K and V of one (layer, KV head) of one sequence.
//
// Token t (its RoPE position too) lives in one of three places:
//   - the sink: t < spec.sink, kept in fp16;
//   - a page: quantized in blocks once the fp16 tail fills;
//   - the tail: the newest tokens (< flush_tokens()) in fp16, the residual.
// Stored values are in the stored basis: rotated when spec.rotate, pre-RoPE
// keys when spec.pre_rope. Read() and attention undo both. crq pages hold
// coded coordinates (kernels/crq_transform.h): the stream maps them to the
// stored basis (pre-RoPE keys, values) where it reads them; its sink and
// tail rows are in the stored basis as they came.
//
// Not thread-safe for writers: callers serialise Append() against everything
// else; concurrent readers are fine.
#ifndef KVQ_KERNELS_KV_STREAM_H_
#define KVQ_KERNELS_KV_STREAM_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "kernels/accounting.h"
#include "kernels/byte_reader.h"
#include "kernels/hadamard.h"
#include "kernels/page_allocator.h"
#include "kernels/page_layout.h"
#include "kernels/rope.h"
#include "kernels/calibration.h"
#include "kernels/stream_config.h"
#include "kernels/tensor.h"

namespace kvq {

class CrqTransform;  // kernels/crq_transform.h
class KernelBackend;

struct ReadOptions {
  DType dtype = DType::kFloat32;
  // Keys of a pre_rope stream come back post-RoPE (as attention sees them)
  // unless this is false.
  bool apply_rope = true;
  // The output is large and not read again soon (a prompt's KV on its way
  // elsewhere): ReadPages writes fp16 rows that need no RoPE or rotation
  // into contiguous outputs with non-temporal stores (LineStreamer). The
  // bytes are the same either way.
  bool streaming_output = false;
};

class KvStream {
 public:
  // `backend` quantizes on Append and dequantizes on Read; `allocator`
  // defaults to the heap. `codebook` is required for nuq and ignored otherwise.
  // `calibration` (this stream's layer and KV head) is required by the
  // calibrated schemes (crq: INVALID_ARGUMENT without one, or when a key
  // scale differs within a RoPE pair) and ignored otherwise; the stream
  // keeps a copy.
  static absl::StatusOr<std::unique_ptr<KvStream>> Create(
      const StreamConfig& config, const KernelBackend* backend,
      PageAllocator* allocator = nullptr, const Codebook* codebook = nullptr,
      const HeadCalibration* calibration = nullptr);
  ~KvStream();
  KvStream(const KvStream&) = delete;
  KvStream& operator=(const KvStream&) = delete;

  // Appends k and v ([n, head_dim] each, fp32/fp16/bf16). All-or-nothing:
  // on any error the stream is unchanged. Errors: INVALID_ARGUMENT (shape,
  // NaN/Inf, beyond the fp16 range), RESOURCE_EXHAUSTED (allocator).
  absl::Status Append(ConstTensorView k, ConstTensorView v);

  // The checks Append() makes before touching anything, so a caller that
  // appends to several streams can validate all of them first.
  absl::Status ValidateAppend(ConstTensorView k, ConstTensorView v) const;
  // Append() without its checks, for a caller that has just run
  // ValidateAppend() on the same views (a Sequence validates every stream of
  // an append before touching any; checking twice cost a pass over the data).
  absl::Status AppendValidated(ConstTensorView k, ConstTensorView v);
  // Pages Append() of `n` more tokens would allocate.
  int PagesNeeded(int n) const;

  // Writes tokens [begin, end) of K and V into k_out / v_out ([end-begin,
  // head_dim] of options.dtype; either may be null). OUT_OF_RANGE if the
  // range is not inside [0, num_tokens()].
  absl::Status Read(int begin, int end, const ReadOptions& options, TensorView k_out,
                    TensorView v_out) const;

  // Bytes this stream references (shared pages count in every stream that
  // shares them; the allocator knows the physical total).
  ByteBreakdown AllocatedBytes() const;

  // A new stream holding the first `tokens` tokens of this one, sharing its
  // full pages copy-on-write (a full page is never written again; a partly
  // filled page, the sink and the tail are copied). `tokens` must be
  // num_tokens(), at most the sink, or end on a flush boundary
  // (sink + k * flush_tokens(), inside the quantized part): anywhere else the
  // fork would have to re-quantize. FAILED_PRECONDITION names the nearest
  // valid lengths; RESOURCE_EXHAUSTED from the allocator.
  absl::StatusOr<std::unique_ptr<KvStream>> Fork(int tokens) const;

  // What an append may change: taken before it, it undoes the append
  // (device errors after the pages were written, or a multi-item call
  // whose later item failed).
  struct AppendCheckpoint {
    size_t pages = 0;
    int num_tokens = 0;
    int quantized_tokens = 0;
    float fp8_scale[2] = {0.0f, 0.0f};
    std::vector<uint16_t> tail;  // K then V tail rows, when the append flushes them.
  };
  // What Undo needs to take back the next append of n tokens even after
  // it succeeded (the flushed tail is kept whatever the backend).
  AppendCheckpoint UndoPoint(int n) const { return Checkpoint(n, /*keep_tail=*/true); }
  // Takes back everything appended since `before` (from UndoPoint on this
  // stream, with nothing forked or read as pages in between): frees the
  // pages added and restores the counts and the tail.
  void Undo(const AppendCheckpoint& before) { Rollback(before); }

  // --- Raw pages: the wire form for clients that quantize or dequantize
  // with these kernels themselves. ---
  // Pages that `tokens` quantized tokens occupy from a page boundary.
  int PagesFor(int tokens) const {
    return (tokens + layout_.page_tokens - 1) / layout_.page_tokens;
  }
  // Whether AppendPages() may run now: the sink is complete, the fp16 tail
  // is empty and the quantized part ends on a page boundary.
  bool AcceptsPages() const;
  // Appends `tokens` tokens given as PagesFor(tokens) pages of this stream's
  // layout, laid end to end. tokens must be a multiple of flush_tokens().
  // Every page is validated first (fp16 scales finite and >= 0, zero points
  // and fp16/bf16 codes finite, outlier indices inside their block):
  // INVALID_ARGUMENT names the page, row and field. FAILED_PRECONDITION when
  // !AcceptsPages() or for fp8_e4m3 (its scale belongs to the stream).
  // All-or-nothing, like Append().
  absl::Status AppendPages(const uint8_t* data, int tokens);
  // The same pages read from `data`, which may be cut anywhere (a received
  // message's slices): INVALID_ARGUMENT when it holds fewer than
  // PagesFor(tokens) pages.
  absl::Status AppendPages(ByteReader data, int tokens);
  // Copies the pages holding quantized tokens [begin, end) — positions
  // relative to page_base(), begin on a page boundary — to `out`
  // (PagesFor(end - begin) * page_bytes bytes).
  absl::Status CopyPages(int begin, int end, uint8_t* out) const;
  // The same bytes appended to `out`: a message field built this way is
  // written once, where resizing it first would zero it first.
  absl::Status AppendPagesTo(int begin, int end, std::string* out) const;
  // The same pages for a reader that sends them without copying:
  // visit(page, full) once per page, in order. Where the allocator's pages
  // are not host-accessible each page is first copied into a host buffer
  // that the next page reuses, and visited with full = false: the reader
  // copies it, as it would a partial page. A full page is never
  // written again (appends write rows past quantized_tokens(), and Fork
  // copies a partial page instead of sharing it), so a reader that holds a
  // reference to it (allocator()->Retain) may read it after leaving the
  // stream and its lock: FetchDequant's raw messages do. A partial page
  // (full = false, at most the last) may still gain rows: copy it.
  absl::Status VisitPages(int begin, int end,
                          absl::FunctionRef<void(const uint8_t* page, bool full)> visit) const;
  // Reads tokens [begin, end) out of raw pages without storing them: `data`
  // holds `tokens` tokens from stream position `first` (on a page boundary),
  // as CopyPages writes them. The result is what Read() would return had
  // AppendPages(data, tokens) run with the quantized part ending at `first`
  // (positions, hence RoPE, count from `first`). The sides read (k_out or
  // v_out may be null) of the pages the range touches are validated as
  // AppendPages validates them (INVALID_ARGUMENT names the page, row and
  // field); OUT_OF_RANGE outside [first, first + tokens);
  // FAILED_PRECONDITION for fp8_e4m3. `data` must hold PagesFor(tokens)
  // pages.
  absl::Status ReadPages(const uint8_t* data, int tokens, int first, int begin, int end,
                         const ReadOptions& options, TensorView k_out, TensorView v_out) const;

  // Row t of one side in the stored basis (rotated, pre-RoPE), as floats.
  // Slow (one row at a time): for references and tests.
  void ReadStoredRow(Side side, int t, float* out) const;

  // --- Accessors for kernels. ---
  const StreamConfig& config() const { return config_; }
  const QuantSpec& spec() const { return config_.spec; }
  const PageLayout& layout() const { return layout_; }
  int head_dim() const { return config_.head_dim; }
  int num_tokens() const { return num_tokens_; }
  int sink_tokens() const { return std::min(num_tokens_, config_.spec.sink); }
  int quantized_tokens() const { return quantized_tokens_; }
  int tail_tokens() const { return num_tokens_ - sink_tokens() - quantized_tokens_; }
  // First token index held in pages (== spec.sink).
  int page_base() const { return config_.spec.sink; }
  int num_pages() const { return static_cast<int>(pages_.size()); }
  const uint8_t* page(int i) const { return pages_[i]; }
  // Where the pages come from (and references to them are taken).
  PageAllocator* allocator() const { return allocator_; }
  const KernelBackend* backend() const { return backend_; }
  // fp16 rows of the sink (t < sink_tokens()) and of the tail (i < tail_tokens()).
  const uint16_t* sink_row(Side side, int t) const;
  const uint16_t* tail_row(Side side, int i) const;
  // fp8 per-head scale (0 until the first append fixes it).
  float fp8_scale(Side side) const { return header()->fp8_scale[static_cast<int>(side)]; }
  // nuq: the 2^bits fp16 levels of `channel` (nullptr without nuq).
  const uint16_t* levels(Side side, int channel) const;
  const Rope* rope() const { return rope_ ? &*rope_ : nullptr; }
  const HadamardRotation* rotation() const { return rotation_ ? &*rotation_ : nullptr; }
  // crq: the calibration and rotation of the coded coordinates (nullptr
  // for the other schemes).
  const CrqTransform* crq() const { return crq_.get(); }

 private:
  KvStream(const StreamConfig& config, const PageLayout& layout,
           const KernelBackend* backend, PageAllocator* allocator);
  // The checks of one input tensor; `values` false skips the element
  // check (NaN, Inf, range), leaving the shape's.
  absl::Status ValidateInput(ConstTensorView t, const char* name, int rows,
                             bool values = true) const;
  // Whether Append() of k, v may check each block's values as it
  // quantizes it (AppendBlocksChecked): whole blocks of contiguous fp16
  // rows onto an empty tail with the sink complete, as a client quantizing
  // a prompt appends them.
  bool TakesBlocksChecked(ConstTensorView k, ConstTensorView v) const;
  // Append() of such input with each block checked right before it is
  // quantized, so the input comes from memory once (the check then leaves
  // the block in L1 for the quantizer) instead of once for a check of the
  // whole input and again for the quantizer. False, with the stream and
  // the allocator as they were, when a block fails the check or a page
  // cannot be allocated.
  bool AppendBlocksChecked(ConstTensorView k, ConstTensorView v);
  // Whether quantizing whole blocks into a page writes every byte of the
  // rows it covers and of their parameters, with nothing else in the page:
  // no alignment padding, no outlier tables, fp16 parameters (a p8 block
  // header has padding of its own). Such pages need no zeroing once full.
  bool BlocksWriteWholePages() const;
  // OUT_OF_RANGE unless [begin, end) starts on a page boundary inside the
  // quantized tokens (CopyPages' range).
  absl::Status CheckPageRange(int begin, int end) const;
  // The largest magnitude an input value may have in this stream's scheme.
  float InputLimit() const;
  // The largest magnitude bits (cpu::MaxAbsBits16/32) a finite input of
  // `dtype` may have: InputLimit() in `dtype`'s bits.
  uint32_t MaxInputBits(DType dtype) const;
  // `count` pages from the allocator appended to `out` (zeroed when `zero`),
  // all or none: on failure `out` is as it was and nothing stays allocated.
  absl::Status AllocatePages(int count, bool zero, std::vector<uint8_t*>* out);
  // Tokens of the next `n` that land in pages (the rest go to sink or tail).
  int NewQuantizedTokens(int n) const;
  // Quantizes the full tail into pages (whose memory is already allocated).
  void FlushTail();
  // Quantizes n contiguous fp16 rows of K and of V (n a multiple of the
  // block; the pages already allocated) at the end of the quantized part.
  void QuantizeBlocks(const void* k_rows, const void* v_rows, int n);
  // crq: n float rows of one side (original basis, modified in place) at
  // the end of the quantized part, starting `done` rows past it.
  void QuantizeCrqRows(Side side, float* rows, int n, int done);
  // Zeroes every byte of a fresh page except code rows [0, rows) of both
  // sides (which the caller writes). Pages without parameter sections only.
  absl::Status ZeroAroundRows(uint8_t* page, int rows) const;
  uint16_t* fp16_row(Side side, int slot);
  absl::Status CheckReadOutputs(int n, const ReadOptions& options, const TensorView& k_out,
                                const TensorView& v_out) const;
  // Whether a side's stored rows are what a read returns (no RoPE to apply,
  // no rotation to undo).
  bool StoredAsRead(Side side, const ReadOptions& options) const;
  // RoPE at positions t.., the inverse rotation, then the conversion to
  // options.dtype, of `count` float rows into out rows from out_row on.
  void FinishRows(Side side, float* rows, int count, int t, const ReadOptions& options,
                  const TensorView& out, int out_row) const;
  // Rows [row, row + count) of a page (tokens t..) into out rows from
  // out_row on; scratch holds page_tokens rows of floats. `stored`: the
  // page is one of this stream's (from the allocator), else host memory
  // (ReadPages' input).
  absl::Status ReadPageRows(Side side, const uint8_t* page, bool stored, int row, int count,
                            int t, const ReadOptions& options, const TensorView& out,
                            int out_row, float* scratch) const;
  // keep_tail: copy the tail rows a flush overwrites even where the
  // append cannot fail after allocating (host backend and memory).
  AppendCheckpoint Checkpoint(int n, bool keep_tail = false) const;
  // Undoes an append back to `before`: frees the pages it added.
  void Rollback(const AppendCheckpoint& before);
  // AppendValidated() without the backend's Synchronize() and the undo.
  absl::Status AppendUnsynced(ConstTensorView k, ConstTensorView v);
  // Waits for the backend; on its error undoes the append back to `before`.
  absl::Status FinishAppend(const AppendCheckpoint& before, absl::Status status);
  // ReadPages' rows [begin, end) of one side with options.streaming_output:
  // false, writing nothing, where that side's rows do not stream (they need
  // floats, or the output is not contiguous fp16).
  bool StreamPageRows(Side side, const uint8_t* data, int first, int begin, int end,
                      const ReadOptions& options, const TensorView& out) const;

  StreamConfig config_;
  PageLayout layout_;
  const KernelBackend* backend_;
  PageAllocator* allocator_;
  std::optional<Rope> rope_;
  std::optional<HadamardRotation> rotation_;
  std::shared_ptr<const CrqTransform> crq_;  // Shared with forks.

  std::vector<uint8_t*> pages_;
  // One allocation for everything that is not a page, so the allocator sees
  // every byte: [Header][codebook fp16 levels, K then V][fp16 rows: K slots
  // then V slots, slot = sink capacity + tail capacity].
  struct Header {
    float fp8_scale[2];
  };
  static_assert(sizeof(Header) == kStreamHeaderBytes);
  Header* header() const { return reinterpret_cast<Header*>(aux_); }
  uint8_t* aux_ = nullptr;
  size_t aux_bytes_ = 0;
  size_t levels_offset_ = 0;
  size_t rows_offset_ = 0;
  int tail_capacity_ = 0;
  int num_tokens_ = 0;
  int quantized_tokens_ = 0;
};

}  // namespace kvq

#endif  // KVQ_KERNELS_KV_STREAM_H_
