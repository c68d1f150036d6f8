// Sequence: the KV cache of one request, one KvStream per (layer, KV head).
#ifndef KVQ_SERVICE_SEQUENCE_H_
#define KVQ_SERVICE_SEQUENCE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/byte_reader.h"
#include "kernels/calibration_file.h"
#include "kernels/kv_stream.h"

namespace kvq {

// The attention shape of a model (the proto's ModelLayout).
struct ModelShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  RopeConfig rope;

  int group_size() const { return num_q_heads / num_kv_heads; }
  // INVALID_ARGUMENT naming the field and its bound.
  absl::Status Validate() const;
  friend bool operator==(const ModelShape&, const ModelShape&) = default;
};

// K/V of some tokens of a contiguous range of layers, as dense tensors
// [layers, kv_heads, tokens, head_dim] (rows of one (layer, head) are
// contiguous).
struct DenseKv {
  int layer_begin = 0;
  int layers = 0;
  int tokens = 0;
  DType dtype = DType::kFloat32;
  const uint8_t* k = nullptr;
  const uint8_t* v = nullptr;
};

// Raw pages of a contiguous range of layers ([layer][kv_head][page]), read
// from `data` (which may be cut anywhere: a received message's slices).
struct RawPagesKv {
  int layer_begin = 0;
  int layers = 0;
  int tokens = 0;
  ByteReader data;
};

// The owner of a Sequence's open transaction (BeginTransaction). Move-only:
// exactly one holder may end the transaction; an empty token owns nothing.
class TransactionToken {
 public:
  TransactionToken() = default;
  TransactionToken(TransactionToken&& o) noexcept : id_(std::exchange(o.id_, 0)) {}
  TransactionToken& operator=(TransactionToken&& o) noexcept {
    id_ = std::exchange(o.id_, 0);
    return *this;
  }
  TransactionToken(const TransactionToken&) = delete;
  TransactionToken& operator=(const TransactionToken&) = delete;
  bool held() const { return id_ != 0; }

 private:
  friend class Sequence;
  explicit TransactionToken(uint64_t id) : id_(id) {}
  uint64_t id_ = 0;
};

class Sequence {
 public:
  // Every stream is created from `config` (head_dim and RoPE from `shape`);
  // `codebooks` (nuq) has one per (layer, kv head) or is empty;
  // `calibration` (crq) gives each stream its head's statistics and is kept
  // (by this sequence and its forks) for as long as a stream uses it. A
  // calibration of another shape than `shape` is INVALID_ARGUMENT naming both.
  static absl::StatusOr<std::unique_ptr<Sequence>> Create(
      std::string ns, std::string id, const ModelShape& shape, const StreamConfig& config,
      const std::vector<Codebook>& codebooks, const KernelBackend* backend,
      PageAllocator* allocator, std::shared_ptr<const CalibrationFile> calibration = nullptr);

  const std::string& ns() const { return ns_; }
  const std::string& id() const { return id_; }
  const ModelShape& shape() const { return shape_; }
  const StreamConfig& config() const { return config_; }
  // The calibration its streams were created with (null: none).
  const std::shared_ptr<const CalibrationFile>& calibration() const { return calibration_; }
  // Prefix-reuse and raw-page granularity: a flush block for the schemes
  // with an fp16 tail (kivi; crq with a residual window), a page otherwise;
  // boundaries sit at sink + k * block_tokens().
  int block_tokens() const;

  // Everything below requires holding mu().
  absl::Mutex& mu() const ABSL_LOCK_RETURNED(mu_) { return mu_; }

  KvStream& stream(int layer, int head) { return *streams_[layer * shape_.num_kv_heads + head]; }
  const KvStream& stream(int layer, int head) const {
    return *streams_[layer * shape_.num_kv_heads + head];
  }
  int layer_tokens(int layer) const { return stream(layer, 0).num_tokens(); }
  // Tokens stored in every layer.
  int num_tokens() const;

  // All-or-nothing appends. On any error (validation, pool exhausted) every
  // stream is exactly as before.
  absl::Status AppendDense(const DenseKv& kv);
  // The checks AppendDense makes before touching anything.
  absl::Status ValidateDense(const DenseKv& kv) const;
  absl::Status AppendRaw(const RawPagesKv& pages);
  // Taken right before AppendDense(kv), what UndoAppend needs to take that
  // append back after it succeeded, one checkpoint per stream of kv's
  // layers: a multi-item call (AppendAttend) undoes the items before one
  // that failed, so the call changes nothing. Nothing may append to, fork or
  // seal those layers in between.
  using AppendUndo = std::vector<KvStream::AppendCheckpoint>;
  AppendUndo UndoPoint(const DenseKv& kv) const;
  void UndoAppend(const DenseKv& kv, const AppendUndo& undo);

  // Snapshots for multi-message all-or-nothing (the Append stream): Begin
  // forks every stream (sharing pages) and returns the token that owns the
  // transaction; only that token commits or rolls it back, so a writer that
  // was refused (ABORTED: another transaction is open) cannot undo or
  // commit the writer that holds the sequence. While one is open, readers
  // see only the tokens committed before it (committed_tokens(), Fork) and
  // every other writer is refused with ABORTED.
  absl::StatusOr<TransactionToken> BeginTransaction();
  // Restores the streams and token ids of the snapshot and ends the
  // transaction; Commit keeps the appends and ends it. Both consume
  // `token`. FAILED_PRECONDITION, changing nothing, when `token` does not
  // own the open transaction (none held, another's, or already ended).
  absl::Status Rollback(TransactionToken& token);
  absl::Status Commit(TransactionToken& token);
  bool in_transaction() const { return open_transaction_ != 0; }
  // Tokens of `layer` that readers may see.
  int committed_tokens(int layer) const;
  // Tokens stored in every layer that readers may see.
  int committed_num_tokens() const;
  // What readers read: the stream as committed, its snapshot while a
  // transaction is open. (The open append may have quantized the committed
  // fp16 tail already; the snapshot still holds it as committed.)
  const KvStream& committed_stream(int layer, int head) const;

  // Shares the first `tokens` tokens of the committed state (Fork of every
  // stream, or of its snapshot while a transaction is open).
  absl::StatusOr<std::unique_ptr<Sequence>> Fork(std::string ns, std::string id, int tokens) const;

  ByteBreakdown Bytes() const;

  // Token ids appended so far (for prefix reuse); may be shorter than
  // num_tokens() when the client did not send them.
  std::vector<int32_t>& token_ids() { return token_ids_; }

  // Lease bookkeeping, guarded by the store.
  std::string tenant;  // Set by the store before anyone else sees the sequence.
  absl::Time last_used;
  absl::Duration ttl;
  bool released = false;
  int active_calls = 0;

 private:
  Sequence(std::string ns, std::string id, const ModelShape& shape, const StreamConfig& config,
           std::shared_ptr<const CalibrationFile> calibration);
  ConstTensorView DenseView(const DenseKv& kv, const uint8_t* base, int layer, int head) const;
  // Checks that `token` owns the open transaction and clears both.
  absl::Status EndTransaction(TransactionToken& token);
  // Runs `body` (which appends to the streams of layers [begin, end)) so
  // that a failure restores them, snapshotting only when `body` may fail
  // half-way (when it allocates pages).
  absl::Status Atomically(int layer_begin, int layer_end, bool allocates,
                          const std::function<absl::Status()>& body);

  const std::string ns_;
  const std::string id_;
  const ModelShape shape_;
  const StreamConfig config_;
  // Before the streams, which point into it: it goes after them.
  const std::shared_ptr<const CalibrationFile> calibration_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<KvStream>> streams_;
  std::vector<std::unique_ptr<KvStream>> snapshot_;
  // The open transaction's id (0: none) and the token ids it started with.
  uint64_t open_transaction_ = 0;
  size_t snapshot_token_ids_ = 0;
  std::vector<int32_t> token_ids_;
};

// `sequence "id"` or `sequence "id" in namespace "ns"` for messages, each
// name cut to a short prefix (kernels/quoted.h).
std::string DescribeSequence(absl::string_view ns, absl::string_view id);

}  // namespace kvq

#endif  // KVQ_SERVICE_SEQUENCE_H_
