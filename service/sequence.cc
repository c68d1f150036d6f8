#include "service/sequence.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "kernels/quoted.h"
#include "kernels/status_macros.h"

namespace kvq {

absl::Status ModelShape::Validate() const {
  auto bad = [](absl::string_view field, int value, absl::string_view bound) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout.", field, " = ", value, " must be ", bound));
  };
  if (num_layers < 1 || num_layers > 1024) return bad("num_layers", num_layers, "in [1, 1024]");
  if (num_kv_heads < 1 || num_kv_heads > 256) return bad("num_kv_heads", num_kv_heads, "in [1, 256]");
  if (num_q_heads < num_kv_heads || num_q_heads % num_kv_heads != 0 ||
      num_q_heads / num_kv_heads > 64) {
    return bad("num_q_heads", num_q_heads,
               absl::StrCat("a multiple of num_kv_heads = ", num_kv_heads, ", at most 64x"));
  }
  if (head_dim < 16 || head_dim > 256 || head_dim % 16 != 0) {
    return bad("head_dim", head_dim, "a multiple of 16 in [16, 256]");
  }
  return absl::OkStatus();
}

Sequence::Sequence(std::string ns, std::string id, const ModelShape& shape,
                   const StreamConfig& config, std::shared_ptr<const CalibrationFile> calibration)
    : ns_(std::move(ns)),
      id_(std::move(id)),
      shape_(shape),
      config_(config),
      calibration_(std::move(calibration)) {}

absl::StatusOr<std::unique_ptr<Sequence>> Sequence::Create(
    std::string ns, std::string id, const ModelShape& shape, const StreamConfig& config,
    const std::vector<Codebook>& codebooks, const KernelBackend* backend,
    PageAllocator* allocator, std::shared_ptr<const CalibrationFile> calibration) {
  KVQ_RETURN_IF_ERROR(shape.Validate());
  const int streams = shape.num_layers * shape.num_kv_heads;
  if (config.spec.nuq && static_cast<int>(codebooks.size()) != streams) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codebooks: a nuq scheme needs one per (layer, kv head) = ", streams, ", got ",
        codebooks.size()));
  }
  if (calibration != nullptr) {
    KVQ_RETURN_IF_ERROR(CheckCalibrationShape(calibration->calibration, shape.num_layers,
                                              shape.num_kv_heads, shape.head_dim));
  }
  std::unique_ptr<Sequence> s(
      new Sequence(std::move(ns), std::move(id), shape, config, std::move(calibration)));
  s->streams_.reserve(streams);
  for (int i = 0; i < streams; ++i) {
    const HeadCalibration* head =
        s->calibration_ ? &s->calibration_->calibration.heads[i] : nullptr;
    absl::StatusOr<std::unique_ptr<KvStream>> stream = KvStream::Create(
        config, backend, allocator, config.spec.nuq ? &codebooks[i] : nullptr, head);
    // A calibration the stream refuses (its key scales split a RoPE pair of
    // this layout) says which one and where.
    if (!stream.ok() && head != nullptr && absl::IsInvalidArgument(stream.status())) {
      return absl::Status(stream.status().code(),
                          absl::StrCat("calibration ", Quoted(s->calibration_->calibration.name),
                                       ", layer ", i / shape.num_kv_heads, " KV head ",
                                       i % shape.num_kv_heads, ": ", stream.status().message()));
    }
    if (!stream.ok()) return stream.status();
    s->streams_.push_back(*std::move(stream));
  }
  return s;
}

int Sequence::block_tokens() const {
  // A stream with an fp16 tail (kivi; crq with a residual window) forks
  // only on its flush boundaries.
  return config_.spec.has_tail() ? config_.spec.flush_tokens()
                                 : streams_[0]->layout().page_tokens;
}

int Sequence::num_tokens() const {
  int n = layer_tokens(0);
  for (int l = 1; l < shape_.num_layers; ++l) n = std::min(n, layer_tokens(l));
  return n;
}

int Sequence::committed_tokens(int layer) const {
  return committed_stream(layer, 0).num_tokens();
}

int Sequence::committed_num_tokens() const {
  int n = committed_tokens(0);
  for (int l = 1; l < shape_.num_layers; ++l) n = std::min(n, committed_tokens(l));
  return n;
}

const KvStream& Sequence::committed_stream(int layer, int head) const {
  const int i = layer * shape_.num_kv_heads + head;
  return in_transaction() ? *snapshot_[i] : *streams_[i];
}

absl::Status Sequence::Atomically(int layer_begin, int layer_end, bool allocates,
                                  const std::function<absl::Status()>& body) {
  if (!allocates || in_transaction()) return body();  // Cannot fail half-way / outer snapshot.
  const int h = shape_.num_kv_heads;
  std::vector<std::unique_ptr<KvStream>> saved;
  for (int i = layer_begin * h; i < layer_end * h; ++i) {
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvStream> copy,
                         streams_[i]->Fork(streams_[i]->num_tokens()));
    saved.push_back(std::move(copy));
  }
  absl::Status status = body();
  if (!status.ok()) {
    for (int i = layer_begin * h; i < layer_end * h; ++i) {
      streams_[i] = std::move(saved[i - layer_begin * h]);
    }
  }
  return status;
}

absl::Status Sequence::ValidateDense(const DenseKv& kv) const {
  if (kv.layers < 1 || kv.layer_begin < 0 || kv.layer_begin + kv.layers > shape_.num_layers) {
    return absl::OutOfRangeError(absl::StrCat("layers [", kv.layer_begin, ", ",
                                              kv.layer_begin + kv.layers, ") are not inside [0, ",
                                              shape_.num_layers, ")"));
  }
  if (kv.tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tokens = ", kv.tokens, " must be >= 1"));
  }
  const int h = shape_.num_kv_heads;
  for (int l = 0; l < kv.layers; ++l) {
    for (int head = 0; head < h; ++head) {
      const KvStream& s = stream(kv.layer_begin + l, head);
      absl::Status st = s.ValidateAppend(DenseView(kv, kv.k, l, head), DenseView(kv, kv.v, l, head));
      if (!st.ok()) {
        return absl::Status(st.code(), absl::StrCat("layer ", kv.layer_begin + l, " kv_head ",
                                                    head, ": ", st.message()));
      }
    }
  }
  return absl::OkStatus();
}

ConstTensorView Sequence::DenseView(const DenseKv& kv, const uint8_t* base, int l, int head) const {
  const size_t stride = static_cast<size_t>(kv.tokens) * shape_.head_dim * DTypeBytes(kv.dtype);
  return ConstTensorView{base + (static_cast<size_t>(l) * shape_.num_kv_heads + head) * stride,
                         kv.dtype, kv.tokens, shape_.head_dim, 0};
}

absl::Status Sequence::AppendDense(const DenseKv& kv) {
  KVQ_RETURN_IF_ERROR(ValidateDense(kv));
  const int h = shape_.num_kv_heads;
  bool allocates = false;
  for (int l = 0; l < kv.layers; ++l) {
    for (int head = 0; head < h; ++head) {
      allocates |= stream(kv.layer_begin + l, head).PagesNeeded(kv.tokens) > 0;
    }
  }
  // A device backend, or pages in device memory, can fail after the checks
  // even without allocating (KernelBackend::Synchronize, the allocator's
  // copies): a stream then undoes its own append, and the snapshot undoes
  // the streams before it.
  const KvStream& s0 = *streams_[0];
  allocates |= s0.backend()->enqueues() || !s0.allocator()->host_accessible();
  auto view = [&](const uint8_t* base, int l, int head) { return DenseView(kv, base, l, head); };
  return Atomically(kv.layer_begin, kv.layer_begin + kv.layers, allocates, [&] {
    for (int l = 0; l < kv.layers; ++l) {
      for (int head = 0; head < h; ++head) {
        KVQ_RETURN_IF_ERROR(
            stream(kv.layer_begin + l, head)
                .AppendValidated(view(kv.k, l, head), view(kv.v, l, head)));
      }
    }
    return absl::OkStatus();
  });
}

Sequence::AppendUndo Sequence::UndoPoint(const DenseKv& kv) const {
  AppendUndo undo;
  for (int l = 0; l < kv.layers; ++l) {
    for (int head = 0; head < shape_.num_kv_heads; ++head) {
      undo.push_back(stream(kv.layer_begin + l, head).UndoPoint(kv.tokens));
    }
  }
  return undo;
}

void Sequence::UndoAppend(const DenseKv& kv, const AppendUndo& undo) {
  size_t i = 0;
  for (int l = 0; l < kv.layers; ++l) {
    for (int head = 0; head < shape_.num_kv_heads; ++head) {
      stream(kv.layer_begin + l, head).Undo(undo[i++]);
    }
  }
}

absl::Status Sequence::AppendRaw(const RawPagesKv& raw) {
  if (raw.layers < 1 || raw.layer_begin < 0 || raw.layer_begin + raw.layers > shape_.num_layers) {
    return absl::OutOfRangeError(absl::StrCat("layers [", raw.layer_begin, ", ",
                                              raw.layer_begin + raw.layers,
                                              ") are not inside [0, ", shape_.num_layers, ")"));
  }
  const int h = shape_.num_kv_heads;
  const KvStream& first = stream(raw.layer_begin, 0);
  const size_t per_stream = static_cast<size_t>(first.PagesFor(raw.tokens)) * first.layout().page_bytes;
  return Atomically(raw.layer_begin, raw.layer_begin + raw.layers, true, [&] {
    ByteReader data = raw.data;  // Streams in order: [layer][kv_head].
    for (int l = 0; l < raw.layers; ++l) {
      for (int head = 0; head < h; ++head) {
        ByteReader pages = data;
        if (data.remaining() >= per_stream) data.Skip(per_stream);
        absl::Status st = stream(raw.layer_begin + l, head).AppendPages(pages, raw.tokens);
        if (!st.ok()) {
          return absl::Status(st.code(), absl::StrCat("layer ", raw.layer_begin + l, " kv_head ",
                                                      head, ": ", st.message()));
        }
      }
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<TransactionToken> Sequence::BeginTransaction() {
  if (in_transaction()) return absl::AbortedError("another append stream is in progress");
  std::vector<std::unique_ptr<KvStream>> saved;
  for (const auto& s : streams_) {
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvStream> copy, s->Fork(s->num_tokens()));
    saved.push_back(std::move(copy));
  }
  // Unique across sequences, so a token never ends another sequence's
  // transaction either.
  static std::atomic<uint64_t> next_id{0};
  snapshot_ = std::move(saved);
  snapshot_token_ids_ = token_ids_.size();
  open_transaction_ = ++next_id;
  return TransactionToken(open_transaction_);
}

absl::Status Sequence::EndTransaction(TransactionToken& token) {
  if (!token.held() || token.id_ != open_transaction_) {
    return absl::FailedPreconditionError(
        "the transaction is not open or belongs to another append");
  }
  token.id_ = 0;
  open_transaction_ = 0;
  return absl::OkStatus();
}

absl::Status Sequence::Rollback(TransactionToken& token) {
  KVQ_RETURN_IF_ERROR(EndTransaction(token));
  streams_ = std::move(snapshot_);
  snapshot_.clear();
  // Ids the undone appends added would otherwise name later tokens (and
  // register wrong prefix blocks).
  token_ids_.resize(std::min(token_ids_.size(), snapshot_token_ids_));
  return absl::OkStatus();
}

absl::Status Sequence::Commit(TransactionToken& token) {
  KVQ_RETURN_IF_ERROR(EndTransaction(token));
  snapshot_.clear();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Sequence>> Sequence::Fork(std::string ns, std::string id,
                                                         int tokens) const {
  std::unique_ptr<Sequence> f(
      new Sequence(std::move(ns), std::move(id), shape_, config_, calibration_));
  for (int l = 0; l < shape_.num_layers; ++l) {
    for (int head = 0; head < shape_.num_kv_heads; ++head) {
      KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvStream> s, committed_stream(l, head).Fork(tokens));
      f->streams_.push_back(std::move(s));
    }
  }
  const size_t ids = in_transaction() ? snapshot_token_ids_ : token_ids_.size();
  f->token_ids_.assign(token_ids_.begin(), token_ids_.begin() + std::min<size_t>(ids, tokens));
  return f;
}

ByteBreakdown Sequence::Bytes() const {
  ByteBreakdown b;
  for (const auto& s : streams_) b += s->AllocatedBytes();
  return b;
}

std::string DescribeSequence(absl::string_view ns, absl::string_view id) {
  return ns.empty() ? absl::StrCat("sequence ", Quoted(id))
                    : absl::StrCat("sequence ", Quoted(id), " in namespace ", Quoted(ns));
}

}  // namespace kvq
