// Sequence: the KV cache of one request, one KvStream per (layer, KV head).
#ifndef KVQ_SERVICE_SEQUENCE_H_
#define KVQ_SERVICE_SEQUENCE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/byte_reader.h"
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

class Sequence {
 public:
  // Every stream is created from `config` (head_dim and RoPE from `shape`);
  // `codebooks` (nuq) has one per (layer, kv head) or is empty.
  static absl::StatusOr<std::unique_ptr<Sequence>> Create(
      std::string ns, std::string id, const ModelShape& shape, const StreamConfig& config,
      const std::vector<Codebook>& codebooks, const KernelBackend* backend,
      PageAllocator* allocator);

  const std::string& ns() const { return ns_; }
  const std::string& id() const { return id_; }
  const ModelShape& shape() const { return shape_; }
  const StreamConfig& config() const { return config_; }
  // Prefix-reuse and raw-page granularity: a flush block for kivi, a page
  // otherwise; boundaries sit at sink + k * block_tokens().
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

  // Snapshots for multi-message all-or-nothing (the Append stream): Begin
  // forks every stream (sharing pages); Rollback restores them; Commit drops
  // the snapshot. While one is open, readers see only the tokens committed
  // before it (committed_tokens()) and other appends fail with ABORTED.
  absl::Status BeginTransaction();
  void Rollback();
  void Commit();
  bool in_transaction() const { return !snapshot_.empty(); }
  // Tokens of `layer` that readers may see.
  int committed_tokens(int layer) const;

  // Shares the first `tokens` tokens (Fork of every stream).
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
  Sequence(std::string ns, std::string id, const ModelShape& shape, const StreamConfig& config);
  ConstTensorView DenseView(const DenseKv& kv, const uint8_t* base, int layer, int head) const;
  // Runs `body` (which appends to the streams of layers [begin, end)) so
  // that a failure restores them, snapshotting only when `body` may fail
  // half-way (when it allocates pages).
  absl::Status Atomically(int layer_begin, int layer_end, bool allocates,
                          const std::function<absl::Status()>& body);

  const std::string ns_;
  const std::string id_;
  const ModelShape shape_;
  const StreamConfig config_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<KvStream>> streams_;
  std::vector<std::unique_ptr<KvStream>> snapshot_;
  std::vector<int32_t> token_ids_;
};

// `sequence "id"` or `sequence "id" in namespace "ns"` for messages, each
// name cut to a short prefix (kernels/quoted.h).
std::string DescribeSequence(absl::string_view ns, absl::string_view id);

}  // namespace kvq

#endif  // KVQ_SERVICE_SEQUENCE_H_
