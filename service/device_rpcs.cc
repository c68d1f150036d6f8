// KvqService's device payload RPCs: OpenTransfer, CloseTransfer,
// AppendDevice, FetchDevice (docs/TRANSPORT.md). The messages carry
// descriptors; a KvTransport moves the bytes. Received bytes land in
// staging memory first and are appended as one transaction only once both
// payloads arrived whole, so a failed transfer allocates no page and leaves
// every stored sequence as it was.
#include <algorithm>
#include <array>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "service/kvq_service.h"
#include "service/tensor_codec.h"
#include "service/unary_call.h"

namespace kvq {
namespace {

// The transport both payloads of a request name, and their references.
struct Payloads {
  TransportKind kind = TransportKind::kCudaIpc;
  PayloadRef k, v;
};

absl::StatusOr<PayloadRef> RefFromWire(const v1::DevicePayload& p, absl::string_view field,
                                       TransportKind* kind) {
  PayloadRef r;
  r.field = std::string(field);
  switch (p.kind_case()) {
    case v1::DevicePayload::kCudaIpc:
      *kind = TransportKind::kCudaIpc;
      r.ipc_handle = p.cuda_ipc().handle();
      r.offset = p.cuda_ipc().offset();
      r.size = p.cuda_ipc().size();
      return r;
    case v1::DevicePayload::kTransfer:
      *kind = TransportKind::kNccl;
      r.session_id = p.transfer().session_id();
      r.size = p.transfer().size();
      return r;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must name a cuda_ipc or a transfer payload"));
  }
}

absl::StatusOr<Payloads> PayloadsFromWire(const v1::DevicePayload& k, const v1::DevicePayload& v) {
  Payloads p;
  TransportKind vk;
  KVQ_ASSIGN_OR_RETURN(p.k, RefFromWire(k, "k", &p.kind));
  KVQ_ASSIGN_OR_RETURN(p.v, RefFromWire(v, "v", &vk));
  if (vk != p.kind) {
    return absl::InvalidArgumentError("k and v must use the same transport");
  }
  if (p.kind == TransportKind::kNccl && p.k.session_id != p.v.session_id) {
    return absl::InvalidArgumentError("k and v must name the same transfer session");
  }
  return p;
}

absl::Status NoTransport(TransportKind kind) {
  return absl::FailedPreconditionError(absl::StrCat(
      "this server has no CUDA transport (", TransportKindName(kind),
      "): it was built without CUDA", kind == TransportKind::kNccl ? " or NCCL" : "",
      ", or found no GPU; send the tensors over gRPC (transport \"grpc\")"));
}

// What AppendDevice and FetchDevice start from: both payloads, the
// transport they name (FAILED_PRECONDITION without one) and the sequence.
struct DeviceCall {
  Payloads refs;
  KvTransport* transport = nullptr;
  SequenceStore::Handle seq;
};

template <typename Req>
absl::StatusOr<DeviceCall> StartDeviceCall(const Req& req,
                                           const std::array<KvTransport*, 2>& transports,
                                           SequenceStore* store, absl::string_view tenant) {
  DeviceCall dc;
  KVQ_ASSIGN_OR_RETURN(dc.refs, PayloadsFromWire(req.k(), req.v()));
  dc.transport = transports[static_cast<int>(dc.refs.kind)];
  if (dc.transport == nullptr) return NoTransport(dc.refs.kind);
  KVQ_ASSIGN_OR_RETURN(dc.seq, store->Get(req.sequence().namespace_(),
                                          req.sequence().sequence_id(), tenant));
  return dc;
}

}  // namespace

absl::Status KvqService::DoOpenTransfer(const v1::OpenTransferRequest& req,
                                        v1::OpenTransferResponse* resp, const CallInfo& call) {
  if (req.transport() != v1::TRANSPORT_NCCL) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport = ", v1::Transport_Name(req.transport()),
        ": only TRANSPORT_NCCL uses sessions (cuda_ipc payloads name their handles)"));
  }
  KvTransport* t = transports_[static_cast<int>(TransportKind::kNccl)];
  if (t == nullptr) return NoTransport(TransportKind::kNccl);
  const absl::Time now = absl::Now();
  KVQ_ASSIGN_OR_RETURN(TransferSessions::Opened opened,
                       sessions_.Open(t, call.tenant_name, absl::Seconds(req.ttl_seconds()), now,
                                      std::min(call.deadline, now + options_.transfer_timeout)));
  resp->set_session_id(opened.descriptor.session_id);
  resp->set_nccl_unique_id(opened.descriptor.nccl_unique_id);
  resp->set_world_size(opened.descriptor.world_size);
  resp->set_server_rank(opened.descriptor.server_rank);
  resp->set_client_rank(opened.descriptor.client_rank);
  resp->set_ttl_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(opened.ttl)));
  return absl::OkStatus();
}

absl::Status KvqService::DoCloseTransfer(const v1::CloseTransferRequest& req,
                                         v1::CloseTransferResponse*, const CallInfo& call) {
  return sessions_.Close(req.session_id(), call.tenant_name);
}

// Moves both payloads of a request over `kind`'s transport, k first; the
// session (if any) is held for the pair and closed when a transfer fails.
// Every payload moved or failed is counted.
class PayloadMover {
 public:
  PayloadMover(KvTransport* transport, TransferSessions* sessions, Metrics* metrics,
               const Payloads& refs, absl::string_view tenant, absl::Time deadline)
      : t_(transport), sessions_(sessions), metrics_(metrics), refs_(refs), tenant_(tenant),
        deadline_(deadline) {}

  absl::Status Receive(absl::Span<uint8_t> k, absl::Span<uint8_t> v) {
    return Move(/*receive=*/true, [&](const PayloadRef& ref, bool is_k) {
      return t_->Receive(ref, is_k ? k : v, deadline_);
    });
  }

  absl::Status Send(absl::Span<const uint8_t> k, absl::Span<const uint8_t> v) {
    return Move(/*receive=*/false, [&](const PayloadRef& ref, bool is_k) {
      return t_->Send(ref, is_k ? k : v, deadline_);
    });
  }

 private:
  // `one(ref, is_k)` moves one payload: k, then v unless k failed.
  template <typename One>
  absl::Status Move(bool receive, One one) {
    const bool session = refs_.kind == TransportKind::kNccl;
    if (session) {
      absl::StatusOr<KvTransport*> t =
          sessions_->Acquire(refs_.k.session_id, tenant_, absl::Now());
      if (!t.ok()) return t.status();
      if (*t != t_) return absl::InternalError("transfer session on another transport");
    }
    absl::Status st;
    for (const PayloadRef* ref : {&refs_.k, &refs_.v}) {
      st = one(*ref, ref == &refs_.k);
      metrics_->RecordTransfer(refs_.kind, receive, static_cast<int>(st.code()));
      if (!st.ok()) break;
    }
    if (session) sessions_->Release(refs_.k.session_id, !st.ok(), absl::Now());
    return st;
  }

  KvTransport* t_;
  TransferSessions* sessions_;
  Metrics* metrics_;
  const Payloads& refs_;
  absl::string_view tenant_;
  absl::Time deadline_;
};

absl::Status KvqService::DoAppendDevice(const v1::AppendDeviceRequest& req,
                                        v1::AppendResponse* resp, const CallInfo& call) {
  KVQ_ASSIGN_OR_RETURN(DeviceCall dc,
                       StartDeviceCall(req, transports_, store_, call.tenant_name));
  const Payloads& refs = dc.refs;
  KvTransport* t = dc.transport;
  SequenceStore::Handle& seq = dc.seq;
  KVQ_ASSIGN_OR_RETURN(DType dtype, FromWire(req.dtype(), "dtype"));
  const ModelShape& m = seq->shape();
  const auto& s = req.shape();
  if (s.size() != 4 || s[0] < 1 || s[1] != m.num_kv_heads || s[2] < 1 ||
      s[3] != m.head_dim) {
    // Of a shape of any other rank only the rank is repeated.
    return absl::InvalidArgumentError(absl::StrCat(
        s.size() == 4 ? absl::StrCat("shape = [", absl::StrJoin(s, ", "), "]")
                      : absl::StrCat("shape has ", s.size(), " dimensions; it"),
        " must be [layers >= 1, ", m.num_kv_heads, ", tokens >= 1, ", m.head_dim,
        "] for this sequence"));
  }
  if (req.layer_begin() < 0 || s[0] > m.num_layers - req.layer_begin()) {
    return absl::OutOfRangeError(absl::StrCat("layers [", req.layer_begin(), ", ",
                                              req.layer_begin() + s[0], ") are not inside [0, ",
                                              m.num_layers, ")"));
  }
  if (s[2] > std::numeric_limits<int>::max() / 2) {
    return absl::InvalidArgumentError(absl::StrCat("shape[2] (tokens) = ", s[2], " is too large"));
  }
  const uint64_t bytes = static_cast<uint64_t>(s[0]) * s[1] * s[2] * s[3] * DTypeBytes(dtype);
  KVQ_RETURN_IF_ERROR(CheckPayloadRef(refs.kind, refs.k, bytes));
  KVQ_RETURN_IF_ERROR(CheckPayloadRef(refs.kind, refs.v, bytes));
  // Staging: nothing of the store is touched until both payloads are here.
  std::vector<uint8_t> k(bytes), v(bytes);
  PayloadMover mover(t, &sessions_, metrics_, refs, call.tenant_name,
                     std::min(call.deadline, absl::Now() + options_.transfer_timeout));
  KVQ_RETURN_IF_ERROR(mover.Receive(absl::MakeSpan(k), absl::MakeSpan(v)));

  absl::MutexLock lock(&seq->mu());
  // ABORTED while an Append stream holds the sequence; this call then owns
  // nothing and leaves that stream's transaction alone.
  TransactionToken txn;
  KVQ_RETURN_IF_ERROR(store_->WithEviction(&*seq, [&] {
    absl::StatusOr<TransactionToken> begun = seq->BeginTransaction();
    if (begun.ok()) txn = std::move(*begun);
    return begun.status();
  }));
  const int before = seq->layer_tokens(0);
  DenseKv kv{req.layer_begin(), static_cast<int>(s[0]), static_cast<int>(s[2]), dtype, k.data(),
             v.data()};
  absl::Status st = store_->WithEviction(&*seq, [&] { return seq->AppendDense(kv); });
  if (st.ok() && req.token_ids_size() > 0) {
    std::vector<int32_t>& ids = seq->token_ids();
    if (static_cast<int>(ids.size()) != before) {
      st = absl::InvalidArgumentError(absl::StrCat("token_ids must continue the sequence's known ids: ",
                                                   ids.size(), " ids are known for ", before,
                                                   " stored tokens"));
    }
  }
  if (st.ok()) st = store_->CheckLive(*seq);  // Released while the payloads moved.
  if (!st.ok()) {
    KVQ_RETURN_IF_ERROR(seq->Rollback(txn));
    return st;
  }
  if (req.token_ids_size() > 0) {
    seq->token_ids().insert(seq->token_ids().end(), req.token_ids().begin(),
                            req.token_ids().end());
  }
  guard_.Seal(*seq, kv.layer_begin, kv.layer_begin + kv.layers);
  KVQ_RETURN_IF_ERROR(seq->Commit(txn));
  store_->RegisterPrefixBlocks(seq.shared());
  resp->set_num_tokens(seq->num_tokens());
  resp->set_bytes_stored(seq->Bytes().total());
  return absl::OkStatus();
}

absl::Status KvqService::DoFetchDevice(const v1::FetchDeviceRequest& req,
                                       v1::FetchDeviceResponse* resp, const CallInfo& call) {
  KVQ_ASSIGN_OR_RETURN(DeviceCall dc,
                       StartDeviceCall(req, transports_, store_, call.tenant_name));
  const Payloads& refs = dc.refs;
  KvTransport* t = dc.transport;
  SequenceStore::Handle& seq = dc.seq;
  KVQ_ASSIGN_OR_RETURN(DType dtype, req.dtype() == v1::DTYPE_UNSPECIFIED
                                        ? absl::StatusOr<DType>(DType::kFloat16)
                                        : FromWire(req.dtype(), "dtype"));
  std::vector<uint8_t> k, v;
  int lb = 0, le = 0, tb = 0, te = 0, heads = 0, dim = 0;
  bool corrupt = false;
  absl::Status read = [&]() -> absl::Status {
    absl::ReaderMutexLock lock(&seq->mu());
    const ModelShape& m = seq->shape();
    heads = m.num_kv_heads;
    dim = m.head_dim;
    lb = req.layer_begin();
    le = req.layer_end() == 0 ? m.num_layers : req.layer_end();
    if (lb < 0 || lb >= le || le > m.num_layers) {
      return absl::OutOfRangeError(absl::StrCat("layers [", lb, ", ", le, ") are not inside [0, ",
                                                m.num_layers, ")"));
    }
    int available = std::numeric_limits<int>::max();
    for (int l = lb; l < le; ++l) available = std::min(available, seq->committed_tokens(l));
    tb = req.token_begin();
    te = req.token_end() == 0 ? available : req.token_end();
    if (tb < 0 || tb >= te || te > available) {
      return absl::OutOfRangeError(absl::StrCat("tokens [", tb, ", ", te,
                                                ") are not a non-empty range inside the ",
                                                available, " tokens stored in layers [", lb, ", ",
                                                le, ")"));
    }
    const size_t per_head = static_cast<size_t>(te - tb) * dim * DTypeBytes(dtype);
    const uint64_t bytes = per_head * heads * (le - lb);
    KVQ_RETURN_IF_ERROR(CheckPayloadRef(refs.kind, refs.k, bytes));
    KVQ_RETURN_IF_ERROR(CheckPayloadRef(refs.kind, refs.v, bytes));
    k.resize(bytes);
    v.resize(bytes);
    ReadOptions ro;
    ro.dtype = dtype;
    ro.apply_rope = req.apply_rope();
    for (int l = lb; l < le; ++l) {
      if (absl::Status st = guard_.Verify(*seq, l, tb, te); !st.ok()) {
        corrupt = true;
        return st;
      }
      for (int h = 0; h < heads; ++h) {
        const size_t at = (static_cast<size_t>(l - lb) * heads + h) * per_head;
        TensorView ko{k.data() + at, dtype, te - tb, dim, 0};
        TensorView vo{v.data() + at, dtype, te - tb, dim, 0};
        KVQ_RETURN_IF_ERROR(seq->committed_stream(l, h).Read(tb, te, ro, ko, vo));
      }
    }
    return absl::OkStatus();
  }();
  if (corrupt) guard_.Remove(*seq);
  KVQ_RETURN_IF_ERROR(read);
  PayloadMover mover(t, &sessions_, metrics_, refs, call.tenant_name,
                     std::min(call.deadline, absl::Now() + options_.transfer_timeout));
  KVQ_RETURN_IF_ERROR(mover.Send(k, v));
  resp->set_layer_begin(lb);
  resp->set_layer_end(le);
  resp->set_token_begin(tb);
  resp->set_token_end(te);
  resp->set_dtype(ToWire(dtype));
  for (int64_t d : {int64_t{le - lb}, int64_t{heads}, int64_t{te - tb}, int64_t{dim}}) {
    resp->add_shape(d);
  }
  return absl::OkStatus();
}

}  // namespace kvq
