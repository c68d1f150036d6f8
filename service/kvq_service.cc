#include "service/kvq_service.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"
#include "service/append_decoder.h"
#include "service/fetch_encoder.h"
#include "service/request_decoder.h"
#include "service/sequence_args.h"
#include "service/tensor_codec.h"
#include "service/unary_call.h"

namespace kvq {
namespace {

absl::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

// Locks (Lock: absl::ReaderMutexLock or absl::MutexLock) on several
// sequences, each once, taken in address order (no deadlock).
template <typename Lock>
class SequenceLocks {
 public:
  explicit SequenceLocks(std::vector<Sequence*> seqs) {
    std::sort(seqs.begin(), seqs.end());
    seqs.erase(std::unique(seqs.begin(), seqs.end()), seqs.end());
    for (Sequence* s : seqs) locks_.push_back(std::make_unique<Lock>(&s->mu()));
  }

 private:
  std::vector<std::unique_ptr<Lock>> locks_;
};
using ReadLocks = SequenceLocks<absl::ReaderMutexLock>;
using WriteLocks = SequenceLocks<absl::MutexLock>;

void FillBytes(const ByteBreakdown& b, v1::ByteBreakdown* out) {
  out->set_codes(b.codes);
  out->set_scales(b.scales);
  out->set_outliers(b.outliers);
  out->set_residual(b.residual);
  out->set_sink(b.sink);
  out->set_codebook(b.codebook);
  out->set_padding(b.padding);
  out->set_total(b.total());
}

// One item of a batched attention call.
struct AttendJob {
  SequenceStore::Handle seq;
  const float* q = nullptr;      // [num_queries, num_q_heads, head_dim]
  std::vector<float> q_storage;  // What `q` points into, unless the request's packed q.
  int num_queries = 0;
  std::vector<int32_t> positions;  // Empty: every key visible.
  int key_begin = 0;
  int key_end = 0;  // 0: every committed token.
  std::string field;  // "items[i]" for messages.
};

// Runs the jobs' attention over `layer` as one backend call, adding one
// result per job to `resp`, or with `packed` (jobs of one query and one
// num_q_heads and head_dim) row i of resp.out and resp.lse for job i.
// Callers must not hold the sequences' locks.
// A job whose pages fail their checksum ends the call with DATA_LOSS and
// is left in `corrupt` (removed by the caller once the locks are released).
absl::Status AttendInto(const KernelBackend& backend, KernelThread* kernel_thread,
                        Metrics* metrics, PageGuard* guard, RpcMethod method, int layer,
                        std::vector<AttendJob>& jobs, float softmax_scale, bool packed,
                        v1::AttendResponse* resp, std::shared_ptr<Sequence>* corrupt) {
  float* packed_out = nullptr;
  float* packed_lse = nullptr;
  if (packed) {
    const ModelShape& m = jobs.front().seq->shape();
    const int64_t n = static_cast<int64_t>(jobs.size());
    packed_out = ResizeFloat32Tensor(resp->mutable_out(), {n, m.num_q_heads, m.head_dim});
    packed_lse = ResizeFloat32Tensor(resp->mutable_lse(), {n, m.num_q_heads});
  }
  std::vector<Sequence*> seqs;
  for (AttendJob& j : jobs) seqs.push_back(&*j.seq);
  ReadLocks locks(seqs);
  // Sealed pages are checked by the backend's threads as they read them,
  // or here before the kernel for a backend that does not check pages.
  std::unique_ptr<PageReadCheck> check = guard->StartRead();
  std::vector<AttentionTask> tasks;
  int group = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    AttendJob& j = jobs[i];
    Sequence& s = *j.seq;
    const ModelShape& m = s.shape();
    if (group == 0) group = m.group_size();
    if (m.group_size() != group) {
      return absl::InvalidArgumentError(absl::StrCat(
          j.field, ": every item of one call must have the same GQA group size (",
          group, "), this sequence has ", m.group_size()));
    }
    if (layer < 0 || layer >= m.num_layers) {
      return absl::OutOfRangeError(
          absl::StrCat("layer = ", layer, " is not in [0, ", m.num_layers, ")"));
    }
    const int committed = s.committed_tokens(layer);
    const int end = j.key_end == 0 ? committed : j.key_end;
    if (j.key_begin < 0 || j.key_begin > end || end > committed) {
      return absl::OutOfRangeError(absl::StrCat(j.field, ": key range [", j.key_begin, ", ", end,
                                                ") is not inside the ", committed,
                                                " stored tokens of layer ", layer));
    }
    if (check != nullptr) check->Add(s, layer, j.key_begin, end);
    // The kernel writes straight into the response's tensors.
    float* out;
    float* lse;
    if (packed) {
      out = packed_out + i * static_cast<size_t>(m.num_q_heads) * m.head_dim;
      lse = packed_lse + i * static_cast<size_t>(m.num_q_heads);
    } else {
      v1::AttendResult* r = resp->add_results();
      out = ResizeFloat32Tensor(r->mutable_out(), {j.num_queries, m.num_q_heads, m.head_dim});
      lse = ResizeFloat32Tensor(r->mutable_lse(), {j.num_queries, m.num_q_heads});
    }
    for (int h = 0; h < m.num_kv_heads; ++h) {
      AttentionTask t;
      t.stream = &s.committed_stream(layer, h);
      t.key_begin = j.key_begin;
      t.key_end = end;
      t.num_queries = j.num_queries;
      t.q = j.q + static_cast<size_t>(h) * group * m.head_dim;
      t.q_stride = m.num_q_heads * m.head_dim;
      t.q_positions = j.positions.empty() ? nullptr : j.positions.data();
      t.out = out + static_cast<size_t>(h) * group * m.head_dim;
      t.out_stride = m.num_q_heads * m.head_dim;
      t.lse = lse + static_cast<size_t>(h) * group;
      t.lse_stride = m.num_q_heads;
      tasks.push_back(t);
    }
  }
  AttentionOptions opts;
  opts.group_size = group;
  opts.softmax_scale = softmax_scale;
  if (check != nullptr) {
    if (backend.ChecksPages()) {
      opts.page_check = check.get();
    } else {
      check->CheckAll();
    }
  }
  absl::Status st;
  if (check == nullptr || check->status().ok()) {
    const absl::Time start = absl::Now();
    st = backend.AttendUsesThreads(tasks, opts)
             ? kernel_thread->Run([&]() -> absl::Status { return backend.Attend(tasks, opts); })
             : backend.Attend(tasks, opts);
    metrics->RecordAttentionKernel(method, absl::ToDoubleSeconds(absl::Now() - start));
  }
  // A page that failed its check makes the whole call DATA_LOSS, whatever
  // the kernel computed from it.
  if (check != nullptr) {
    if (absl::Status v = guard->Finish(*check); !v.ok()) {
      for (AttendJob& j : jobs) {
        if (&*j.seq == check->failed()) *corrupt = j.seq.shared();
      }
      return v;
    }
  }
  return st;
}

// AttendInto that leaves no partial results behind on an error.
absl::Status RunAttention(const KernelBackend& backend, KernelThread* kernel_thread,
                          Metrics* metrics, PageGuard* guard, RpcMethod method, int layer,
                          std::vector<AttendJob>& jobs, float softmax_scale,
                          v1::AttendResponse* resp, bool packed = false) {
  std::shared_ptr<Sequence> corrupt;
  absl::Status st = AttendInto(backend, kernel_thread, metrics, guard, method, layer, jobs,
                               softmax_scale, packed, resp, &corrupt);
  if (corrupt != nullptr) guard->Remove(*corrupt);
  if (!st.ok()) {
    resp->clear_results();
    resp->clear_out();
    resp->clear_lse();
  }
  return st;
}

absl::Status CheckScale(float scale) {
  if (!(scale >= 0.0f) || !std::isfinite(scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("softmax_scale = ", scale, " must be finite and >= 0"));
  }
  return absl::OkStatus();
}

}  // namespace

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

KvqService::KvqService(SequenceStore* store, Metrics* metrics, const ServiceOptions& options)
    : store_(store),
      metrics_(metrics),
      options_(options),
      guard_(store, metrics, options.verify_fraction),
      sessions_(options.transfer_session_ttl, options.max_transfer_session_ttl) {}

absl::Status KvqService::CheckSize(const google::protobuf::Message& m) const {
  return CheckSize(m.ByteSizeLong());
}

absl::Status KvqService::CheckSize(size_t bytes) const {
  if (static_cast<int64_t>(bytes) > options_.max_message_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("message of ", bytes,
                                                   " bytes exceeds max_message_bytes = ",
                                                   options_.max_message_bytes));
  }
  return absl::OkStatus();
}

absl::Status KvqService::Admit(const grpc::CallbackServerContext* ctx,
                               std::shared_ptr<Tenant>* tenant) {
  tenant->reset();
  if (tenants_ == nullptr) return absl::OkStatus();
  const auto& md = ctx->client_metadata();
  // Two tokens would leave which one counts to the order of the headers.
  if (md.count("authorization") > 1) {
    return absl::UnauthenticatedError(
        "more than one authorization header; send exactly one bearer token");
  }
  auto it = md.find("authorization");
  absl::StatusOr<std::shared_ptr<Tenant>> t =
      it == md.end() ? tenants_->Authenticate(false, {})
                     : tenants_->Authenticate(true, absl::string_view(it->second.data(),
                                                                      it->second.size()));
  if (!t.ok()) return t.status();
  *tenant = std::move(*t);
  return AdmitStep(tenant->get());
}

absl::Status KvqService::AdmitStep(Tenant* tenant) {
  return tenant == nullptr ? absl::OkStatus() : tenant->Admit(absl::Now());
}

absl::Status KvqService::DoGetServerInfo(const v1::GetServerInfoRequest&, v1::ServerInfo* resp,
                                         const CallInfo&) {
  resp->set_version(options_.version);
  resp->set_backend(options_.backend_name);
  for (const std::string& s : SchemeNames()) resp->add_schemes(s);
  for (const char* o : {"vN", "gN", "rN", "fit", "p8", "pre_rope", "outliers=P", "sink=S",
                        "nuq", "rotate", "ktok"}) {
    resp->add_scheme_options(o);
  }
  for (v1::DType d : {v1::DTYPE_FP32, v1::DTYPE_FP16, v1::DTYPE_BF16}) {
    resp->add_input_dtypes(d);
    resp->add_output_dtypes(d);
  }
  resp->set_capacity_bytes(store_->pool().Stats().capacity_bytes);
  resp->set_max_message_bytes(options_.max_message_bytes);
  resp->set_max_tokens_per_sequence(1 << 24);
  if (calibrations_ != nullptr) {
    for (const std::string& name : calibrations_->Names()) resp->add_calibrations(name);
  }
  return absl::OkStatus();
}

absl::Status KvqService::DoCreateSequence(const v1::CreateSequenceRequest& req,
                                          v1::CreateSequenceResponse* resp,
                                          const CallInfo& call) {
  KVQ_ASSIGN_OR_RETURN(CreateSequenceArgs args,
                       SequenceArgsFromWire(call.tenant_name, req.namespace_(),
                                            req.layout(), req.scheme(), req.codebooks(),
                                            req.calibration(), calibrations_,
                                            req.prompt_token_ids()));
  args.id = req.sequence_id();
  args.ttl = absl::Seconds(req.ttl_seconds());
  KVQ_ASSIGN_OR_RETURN(SequenceStore::Handle seq, store_->Create(args));
  absl::MutexLock lock(&seq->mu());
  if (!args.prompt_token_ids.empty()) seq->token_ids() = args.prompt_token_ids;
  resp->set_sequence_id(seq->id());
  resp->set_scheme(seq->config().spec.ToString());
  resp->set_num_tokens(seq->num_tokens());
  resp->set_block_tokens(seq->block_tokens());
  resp->set_ttl_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(seq->ttl)));
  return absl::OkStatus();
}

// ---------------------------------------------------- streaming RPCs' calls

namespace {

// What the Append and FetchDequant reactors hold of their call: the
// service, the context, the caller's tenant once admitted, and the call's
// timer.
class StreamCall {
 protected:
  StreamCall(KvqService* service, grpc::CallbackServerContext* ctx, RpcMethod method)
      : service_(service), ctx_(ctx), timer_(service->metrics(), method) {}

  // Admits the caller (its tenant and rate, KvqService::Admit) and labels
  // the timer with the tenant.
  absl::Status Admit() {
    KVQ_RETURN_IF_ERROR(service_->Admit(ctx_, &tenant_));
    if (tenant_ != nullptr) tenant_name_ = tenant_->name();
    timer_.set_tenant(tenant_.get());
    return absl::OkStatus();
  }

  KvqService* service_;
  grpc::CallbackServerContext* ctx_;
  std::shared_ptr<Tenant> tenant_;
  std::string tenant_name_;
  RpcTimer timer_;
};

}  // namespace

// ------------------------------------------------------------------ Append

// Raw method: each message is decoded by AppendMessage, which leaves raw
// pages in the received slices for AppendPages to copy into the pool.
class KvqService::AppendReactor : public grpc::ServerReadReactor<grpc::ByteBuffer>,
                                  private StreamCall {
 public:
  AppendReactor(KvqService* service, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp)
      : StreamCall(service, ctx, RpcMethod::kAppend), resp_(resp) {
    if (absl::Status st = Admit(); !st.ok()) {
      Done(st);
      return;
    }
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (ctx_->IsCancelled()) return Done(absl::CancelledError("append stream cancelled"));
      return Done(Commit());
    }
    service_->metrics()->AddReceivedBytes(RpcMethod::kAppend, in_.Length());
    absl::Status st = Process();
    in_.Clear();
    if (!st.ok()) return Done(st);
    StartRead(&in_);
  }

  void OnCancel() override {}

  void OnDone() override {
    RollbackOwn();
    delete this;
  }

 private:
  absl::Status Process() {
    KVQ_RETURN_IF_ERROR(service_->CheckSize(in_.Length()));
    KVQ_RETURN_IF_ERROR(msg_.Decode(in_));
    const v1::AppendRequest& req = msg_.request();
    if (!seq_.shared()) {
      if (req.sequence().sequence_id().empty()) {
        return absl::InvalidArgumentError("the first message must set sequence.sequence_id");
      }
      KVQ_ASSIGN_OR_RETURN(seq_, service_->store()->Get(req.sequence().namespace_(),
                                                         req.sequence().sequence_id(),
                                                         tenant_name_));
      absl::MutexLock lock(&seq_->mu());
      // Refused (ABORTED: another stream holds the sequence), this stream
      // owns no transaction and its end leaves the other's alone.
      KVQ_RETURN_IF_ERROR(service_->store()->WithEviction(&*seq_, [&] {
        absl::StatusOr<TransactionToken> begun = seq_->BeginTransaction();
        if (begun.ok()) txn_ = std::move(*begun);
        return begun.status();
      }));
    } else if (!req.sequence().sequence_id().empty() &&
               (req.sequence().sequence_id() != seq_->id() ||
                req.sequence().namespace_() != seq_->ns())) {
      return absl::InvalidArgumentError("sequence changed within one append stream");
    }
    absl::MutexLock lock(&seq_->mu());
    const ModelShape& m = seq_->shape();
    const int before = seq_->layer_tokens(0);
    if (req.has_chunk()) {
      const v1::KvChunk& c = req.chunk();
      const bool dense = c.has_k() || c.has_v();
      if (dense == c.has_pages()) {
        return absl::InvalidArgumentError("chunk must carry either k and v or pages");
      }
      if (dense) {
        KVQ_ASSIGN_OR_RETURN(WireTensor k, CheckTensor(c.k(), "chunk.k",
                                                       {-1, m.num_kv_heads, -1, m.head_dim}));
        KVQ_ASSIGN_OR_RETURN(WireTensor v, CheckTensor(c.v(), "chunk.v", k.shape));
        if (v.dtype != k.dtype) return absl::InvalidArgumentError("chunk.v.dtype differs from chunk.k.dtype");
        DenseKv kv{c.layer_begin(), static_cast<int>(k.shape[0]), static_cast<int>(k.shape[2]),
                   k.dtype, k.data, v.data};
        KVQ_RETURN_IF_ERROR(
            service_->store()->WithEviction(&*seq_, [&] { return seq_->AppendDense(kv); }));
        service_->guard().Seal(*seq_, kv.layer_begin, kv.layer_begin + kv.layers);
      } else {
        const v1::QuantizedPages& p = c.pages();
        const PageLayout& L = seq_->stream(0, 0).layout();
        if (p.page_bytes() != static_cast<int64_t>(L.page_bytes) || p.page_tokens() != L.page_tokens) {
          return absl::InvalidArgumentError(absl::StrCat(
              "chunk.pages: page_bytes = ", p.page_bytes(), " and page_tokens = ", p.page_tokens(),
              " must be ", L.page_bytes, " and ", L.page_tokens, " for this sequence's scheme"));
        }
        if (p.layers() < 1 || p.tokens() < 1) {
          return absl::InvalidArgumentError("chunk.pages: layers and tokens must be >= 1");
        }
        const uint64_t want = static_cast<uint64_t>(p.layers()) * m.num_kv_heads *
                              seq_->stream(0, 0).PagesFor(p.tokens()) * L.page_bytes;
        if (msg_.page_data_size() != want) {
          return absl::InvalidArgumentError(absl::StrCat("chunk.pages.page_data has ",
                                                         msg_.page_data_size(),
                                                         " bytes, expected ", want));
        }
        RawPagesKv raw{c.layer_begin(), p.layers(), p.tokens(), msg_.page_data()};
        KVQ_RETURN_IF_ERROR(
            service_->store()->WithEviction(&*seq_, [&] { return seq_->AppendRaw(raw); }));
        service_->guard().Seal(*seq_, raw.layer_begin, raw.layer_begin + raw.layers);
      }
    }
    if (req.token_ids_size() > 0) {
      std::vector<int32_t>& ids = seq_->token_ids();
      if (static_cast<int>(ids.size()) != before) {
        return absl::InvalidArgumentError(absl::StrCat(
            "token_ids must continue the sequence's known ids: ", ids.size(),
            " ids are known for ", before, " stored tokens"));
      }
      ids.insert(ids.end(), req.token_ids().begin(), req.token_ids().end());
    }
    return absl::OkStatus();
  }

  absl::Status Commit() {
    if (!seq_.shared()) return absl::InvalidArgumentError("append stream carried no message");
    absl::MutexLock lock(&seq_->mu());
    // Released (or removed) while the stream was open: nothing is stored.
    if (absl::Status live = service_->store()->CheckLive(*seq_); !live.ok()) {
      KVQ_RETURN_IF_ERROR(seq_->Rollback(txn_));
      return live;
    }
    KVQ_RETURN_IF_ERROR(seq_->Commit(txn_));
    service_->store()->RegisterPrefixBlocks(seq_.shared());
    v1::AppendResponse resp;
    resp.set_num_tokens(seq_->num_tokens());
    resp.set_bytes_stored(seq_->Bytes().total());
    grpc::Slice bytes(resp.SerializeAsString());
    *resp_ = grpc::ByteBuffer(&bytes, 1);
    return absl::OkStatus();
  }

  // Undoes this stream's own transaction, if it still holds one.
  void RollbackOwn() {
    if (!txn_.held()) return;
    absl::MutexLock lock(&seq_->mu());
    seq_->Rollback(txn_).IgnoreError();  // The token owns the open transaction.
  }

  void Done(const absl::Status& st) {
    if (!st.ok()) RollbackOwn();
    timer_.Finish(static_cast<int>(st.code()));
    Finish(ToGrpc(st));
  }

  grpc::ByteBuffer* resp_;
  grpc::ByteBuffer in_;  // The message read.
  AppendMessage msg_;    // in_ decoded.
  SequenceStore::Handle seq_;
  TransactionToken txn_;  // Held from the first message until commit or rollback.
};

grpc::ServerReadReactor<grpc::ByteBuffer>* KvqService::Append(grpc::CallbackServerContext* ctx,
                                                              grpc::ByteBuffer* resp) {
  return new AppendReactor(this, ctx, resp);
}

// ------------------------------------------------------------ FetchDequant

// Raw method (ByteBuffer in and out): dense pieces are encoded by
// DenseFetchMessage and dequantized straight into the message buffer; raw
// pages go out as slices of the pages themselves (RawFetchMessage).
class KvqService::FetchReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                 private StreamCall {
 public:
  FetchReactor(KvqService* service, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req)
      : StreamCall(service, ctx, RpcMethod::kFetchDequant) {
    service_->metrics()->AddReceivedBytes(RpcMethod::kFetchDequant, req->Length());
    if (absl::Status st = Admit(); !st.ok()) {
      Done(st);
      return;
    }
    absl::Status st = DecodeRequest(*req, &req_);
    if (st.ok()) st = Plan();
    if (!st.ok()) {
      Done(st);
      return;
    }
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Done(absl::CancelledError("fetch stream broken"));
    Next();
  }

  void OnDone() override { delete this; }

 private:
  struct Piece {
    int layer, begin, end;
  };

  absl::Status Plan() {
    KVQ_ASSIGN_OR_RETURN(seq_, service_->store()->Get(req_.sequence().namespace_(),
                                                       req_.sequence().sequence_id(),
                                                       tenant_name_));
    absl::ReaderMutexLock lock(&seq_->mu());
    const ModelShape& m = seq_->shape();
    const int lb = req_.layer_begin();
    const int le = req_.layer_end() == 0 ? m.num_layers : req_.layer_end();
    if (lb < 0 || lb >= le || le > m.num_layers) {
      return absl::OutOfRangeError(absl::StrCat("layers [", lb, ", ", le, ") are not inside [0, ",
                                                m.num_layers, ")"));
    }
    int available = std::numeric_limits<int>::max();
    for (int l = lb; l < le; ++l) available = std::min(available, seq_->committed_tokens(l));
    const int tb = req_.token_begin();
    const int te = req_.token_end() == 0 ? available : req_.token_end();
    if (tb < 0 || tb > te || te > available) {
      return absl::OutOfRangeError(absl::StrCat("tokens [", tb, ", ", te, ") are not inside the ",
                                                available, " tokens stored in layers [", lb, ", ",
                                                le, ")"));
    }
    range_layer_end_ = le;
    range_token_end_ = te;
    // A larger chunk would make messages the transport refuses to send
    // (its limit is twice max_message_bytes): say so before sending any.
    const int64_t limit = service_->options().max_message_bytes;
    if (req_.max_chunk_bytes() < 0 || req_.max_chunk_bytes() > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("max_chunk_bytes = ", req_.max_chunk_bytes(),
                       " must be in [0, max_message_bytes = ", limit, "] (0: the server's default)"));
    }
    const int64_t chunk = req_.max_chunk_bytes() > 0 ? req_.max_chunk_bytes()
                                                     : service_->options().fetch_chunk_bytes;
    if (req_.raw()) {
      if (req_.dtype() != v1::DTYPE_UNSPECIFIED) {
        return absl::InvalidArgumentError("dtype must be unset for a raw fetch");
      }
      const KvStream& s = seq_->committed_stream(lb, 0);
      if (s.spec().kind == SchemeKind::kFp8E4m3) {
        return absl::FailedPreconditionError("raw fetch is not available for fp8_e4m3");
      }
      const int base = s.page_base();
      const int pt = s.layout().page_tokens;
      int quantized = std::numeric_limits<int>::max();
      for (int l = lb; l < le; ++l) {
        quantized = std::min(quantized, seq_->committed_stream(l, 0).quantized_tokens());
      }
      if (tb < base || te > base + quantized || (tb - base) % pt != 0) {
        return absl::OutOfRangeError(absl::StrCat(
            "a raw fetch covers quantized tokens: [token_begin, token_end) must start on a page "
            "boundary (sink ", base, " + k * ", pt, ") inside [", base, ", ", base + quantized,
            "); fetch the sink and the fp16 tail with raw = false"));
      }
      const int64_t page_set = static_cast<int64_t>(m.num_kv_heads) * s.layout().page_bytes;
      const int pages_per_msg = static_cast<int>(std::max<int64_t>(1, chunk / page_set));
      for (int l = lb; l < le; ++l) {
        for (int t = tb; t < te; t += pages_per_msg * pt) {
          pieces_.push_back({l, t, std::min(te, t + pages_per_msg * pt)});
        }
      }
      return absl::OkStatus();
    }
    KVQ_ASSIGN_OR_RETURN(dtype_, req_.dtype() == v1::DTYPE_UNSPECIFIED
                                     ? absl::StatusOr<DType>(DType::kFloat16)
                                     : FromWire(req_.dtype(), "dtype"));
    const int64_t per_token = static_cast<int64_t>(m.num_kv_heads) * m.head_dim * 2 * DTypeBytes(dtype_);
    const int step = static_cast<int>(std::max<int64_t>(1, chunk / per_token));
    for (int l = lb; l < le; ++l) {
      for (int t = tb; t < te; t += step) pieces_.push_back({l, t, std::min(te, t + step)});
      if (tb == te) pieces_.push_back({l, tb, te});
    }
    return absl::OkStatus();
  }

  // The message of piece `p` in out_; the first also carries the range.
  absl::Status Fill(const Piece& p, bool first) {
    const int32_t range_layers = first ? range_layer_end_ : 0;
    const int32_t range_tokens = first ? range_token_end_ : 0;
    absl::ReaderMutexLock lock(&seq_->mu());
    const ModelShape& m = seq_->shape();
    const int n = p.end - p.begin;
    if (absl::Status st = service_->guard().Verify(*seq_, p.layer, p.begin, p.end); !st.ok()) {
      corrupt_ = true;  // Next() removes the sequence once this lock is released.
      return st;
    }
    if (req_.raw()) {
      const KvStream& s0 = seq_->committed_stream(p.layer, 0);
      const size_t per_stream = static_cast<size_t>(s0.PagesFor(n)) * s0.layout().page_bytes;
      const size_t page_bytes = s0.layout().page_bytes;
      RawFetchMessage msg(p.layer, p.begin, 1, n, static_cast<int64_t>(page_bytes),
                          s0.layout().page_tokens, per_stream * m.num_kv_heads, range_layers,
                          range_tokens);
      // Full pages of the pool travel as themselves, referenced until gRPC
      // has sent them; a partial last page is copied (it may gain rows).
      // The owner is the pool, or the tenant's allocator over it (which
      // must see the last reference go).
      const std::shared_ptr<PageAllocator> owner =
          service_->store()->SharedAllocator(s0.allocator());
      for (int h = 0; h < m.num_kv_heads; ++h) {
        const KvStream& s = seq_->committed_stream(p.layer, h);
        const bool pooled = owner != nullptr && s.allocator() == owner.get();
        KVQ_RETURN_IF_ERROR(s.VisitPages(
            p.begin - s.page_base(), p.end - s.page_base(), [&](const uint8_t* page, bool full) {
              if (full && pooled) {
                msg.AddShared(owner, page, page_bytes);
              } else {
                msg.AddCopy(page, page_bytes);
              }
            }));
      }
      out_ = msg.Release();
      return absl::OkStatus();
    }
    const size_t per_head = static_cast<size_t>(n) * m.head_dim * DTypeBytes(dtype_);
    DenseFetchMessage msg(p.layer, p.begin, ToWire(dtype_), {m.num_kv_heads, n, m.head_dim},
                          per_head * m.num_kv_heads, range_layers, range_tokens);
    ReadOptions ro;
    ro.dtype = dtype_;
    ro.apply_rope = req_.apply_rope();
    for (int h = 0; h < m.num_kv_heads; ++h) {
      TensorView ko{msg.k_data() + h * per_head, dtype_, n, m.head_dim, 0};
      TensorView vo{msg.v_data() + h * per_head, dtype_, n, m.head_dim, 0};
      KVQ_RETURN_IF_ERROR(seq_->committed_stream(p.layer, h).Read(p.begin, p.end, ro, ko, vo));
    }
    out_ = msg.Release();
    return absl::OkStatus();
  }

  void Next() {
    if (next_ == pieces_.size()) return Done(absl::OkStatus());
    const bool first = next_ == 0;
    absl::Status st = Fill(pieces_[next_++], first);
    if (corrupt_) service_->guard().Remove(*seq_);
    if (!st.ok()) return Done(st);
    service_->metrics()->AddSentBytes(RpcMethod::kFetchDequant, out_.Length());
    StartWrite(&out_);
  }

  void Done(const absl::Status& st) {
    timer_.Finish(static_cast<int>(st.code()));
    Finish(ToGrpc(st));
  }

  v1::FetchRequest req_;
  SequenceStore::Handle seq_;
  DType dtype_ = DType::kFloat16;
  std::vector<Piece> pieces_;
  size_t next_ = 0;
  bool corrupt_ = false;  // A page of seq_ failed its checksum.
  int32_t range_layer_end_ = 0, range_token_end_ = 0;  // Resolved in Plan().
  grpc::ByteBuffer out_;                               // The message in flight.
};

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvqService::FetchDequant(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req) {
  return new FetchReactor(this, ctx, req);
}

// ------------------------------------------------------------------ Attend

absl::Status KvqService::DoAttend(const v1::AttendRequest& req, v1::AttendResponse* resp,
                                  absl::string_view tenant) {
  KVQ_RETURN_IF_ERROR(CheckScale(req.softmax_scale()));
  if (req.items_size() == 0) return absl::InvalidArgumentError("items is empty");
  const bool packed = req.has_q();
  WireTensor packed_q;
  std::vector<float> packed_floats;
  if (packed) {
    KVQ_ASSIGN_OR_RETURN(packed_q, CheckTensor(req.q(), "q", {req.items_size(), -1, -1}));
    packed_floats = ToFloats(packed_q);
  }
  std::vector<AttendJob> jobs;
  jobs.reserve(req.items_size());
  for (int i = 0; i < req.items_size(); ++i) {
    const v1::AttendItem& it = req.items(i);
    AttendJob j;
    j.field = absl::StrCat("items[", i, "]");
    absl::StatusOr<SequenceStore::Handle> h =
        store_->Get(it.sequence().namespace_(), it.sequence().sequence_id(), tenant);
    if (!h.ok()) return Prefixed(h.status(), j.field + ".sequence: ");
    j.seq = std::move(*h);
    const ModelShape& m = j.seq->shape();
    if (packed) {
      if (it.has_q()) {
        return absl::InvalidArgumentError(j.field + ".q must be empty when q (packed) is set");
      }
      if (m.num_q_heads != packed_q.shape[1] || m.head_dim != packed_q.shape[2]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "q.shape = [", absl::StrJoin(packed_q.shape, ", "), "] does not fit ", j.field,
            ".sequence: num_q_heads = ", m.num_q_heads, ", head_dim = ", m.head_dim));
      }
      j.num_queries = 1;
      j.q = packed_floats.data() + static_cast<size_t>(i) * m.num_q_heads * m.head_dim;
    } else {
      KVQ_ASSIGN_OR_RETURN(WireTensor q,
                           CheckTensor(it.q(), j.field + ".q", {-1, m.num_q_heads, m.head_dim}));
      j.num_queries = static_cast<int>(q.shape[0]);
      j.q_storage = ToFloats(q);
      j.q = j.q_storage.data();
    }
    if (it.q_positions_size() != 0 && it.q_positions_size() != j.num_queries) {
      return absl::InvalidArgumentError(absl::StrCat(j.field, ".q_positions has ",
                                                     it.q_positions_size(), " entries for ",
                                                     j.num_queries, " queries"));
    }
    j.positions.assign(it.q_positions().begin(), it.q_positions().end());
    j.key_begin = it.key_begin();
    j.key_end = it.key_end();
    jobs.push_back(std::move(j));
  }
  absl::Status st = RunAttention(*store_->backend(), &kernel_thread_, metrics_, &guard_,
                                 RpcMethod::kAttend, req.layer(), jobs, req.softmax_scale(), resp,
                                 packed);
  if (st.code() == absl::StatusCode::kInvalidArgument &&
      absl::StartsWith(st.message(), "attention task ")) {
    return absl::InvalidArgumentError(absl::StrCat("q: ", st.message()));
  }
  return st;
}

absl::Status KvqService::DoAppendAttend(const v1::AppendAttendRequest& req,
                                        v1::AttendResponse* resp, RpcMethod method,
                                        absl::string_view tenant) {
  KVQ_RETURN_IF_ERROR(CheckScale(req.softmax_scale()));
  if (req.items_size() == 0) return absl::InvalidArgumentError("items is empty");
  struct Item {
    SequenceStore::Handle seq;
    DenseKv kv;
    WireTensor q;
    std::vector<float> q_floats;
  };
  const int n = req.items_size();
  const bool packed = req.has_k() || req.has_v() || req.has_q();
  WireTensor pk, pv, pq;  // Packed form: [items, kv_heads | num_q_heads, head_dim].
  if (packed) {
    if (!req.has_k() || !req.has_v() || !req.has_q()) {
      return absl::InvalidArgumentError("k, v and q (packed) must be set together");
    }
    KVQ_ASSIGN_OR_RETURN(pk, CheckTensor(req.k(), "k", {n, -1, -1}));
    KVQ_ASSIGN_OR_RETURN(pv, CheckTensor(req.v(), "v", pk.shape));
    if (pv.dtype != pk.dtype) return absl::InvalidArgumentError("v.dtype differs from k");
    KVQ_ASSIGN_OR_RETURN(pq, CheckTensor(req.q(), "q", {n, -1, pk.shape[2]}));
  }
  std::vector<Item> items;
  // Which item names each sequence: one sequence twice in one call would
  // be appended twice and attend over its own step twice.
  absl::flat_hash_map<const Sequence*, int> item_of;
  // Check every item before appending any.
  for (int i = 0; i < n; ++i) {
    const v1::AppendAttendItem& it = req.items(i);
    const std::string field = absl::StrCat("items[", i, "]");
    absl::StatusOr<SequenceStore::Handle> h =
        store_->Get(it.sequence().namespace_(), it.sequence().sequence_id(), tenant);
    if (!h.ok()) return Prefixed(h.status(), field + ".sequence: ");
    if (auto [first, inserted] = item_of.emplace(&**h, i); !inserted) {
      return absl::InvalidArgumentError(absl::StrCat(field, " names the same sequence as items[",
                                                     first->second,
                                                     "]; a sequence may appear once per call"));
    }
    Item item{std::move(*h), {}, {}, {}};
    const ModelShape& m = item.seq->shape();
    // Attention runs every item in one call of one GQA group size: checked
    // here, before any item is appended.
    if (i > 0 && m.group_size() != items.front().seq->shape().group_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": every item of one call must have the same GQA group size (",
          items.front().seq->shape().group_size(), "), this sequence has ", m.group_size()));
    }
    if (packed) {
      if (it.has_k() || it.has_v() || it.has_q()) {
        return absl::InvalidArgumentError(
            field + ".k, .v and .q must be empty when k, v and q (packed) are set");
      }
      if (pk.shape[1] != m.num_kv_heads || pk.shape[2] != m.head_dim ||
          pq.shape[1] != m.num_q_heads) {
        return absl::InvalidArgumentError(absl::StrCat(
            "k.shape = [", absl::StrJoin(pk.shape, ", "), "] and q.shape = [",
            absl::StrJoin(pq.shape, ", "), "] do not fit ", field, ".sequence: kv_heads = ",
            m.num_kv_heads, ", num_q_heads = ", m.num_q_heads, ", head_dim = ", m.head_dim));
      }
      // Row i of k and v is [kv_heads, head_dim]: one layer's [kv_heads, 1,
      // head_dim] as DenseKv reads it.
      const size_t kv_row = static_cast<size_t>(m.num_kv_heads) * m.head_dim * DTypeBytes(pk.dtype);
      const size_t q_row = static_cast<size_t>(m.num_q_heads) * m.head_dim * DTypeBytes(pq.dtype);
      item.kv = DenseKv{req.layer(), 1, 1, pk.dtype, pk.data + i * kv_row, pv.data + i * kv_row};
      item.q = WireTensor{pq.dtype, {1, m.num_q_heads, m.head_dim}, pq.data + i * q_row};
    } else {
      KVQ_ASSIGN_OR_RETURN(WireTensor k,
                           CheckTensor(it.k(), field + ".k", {m.num_kv_heads, -1, m.head_dim}));
      KVQ_ASSIGN_OR_RETURN(WireTensor v, CheckTensor(it.v(), field + ".v", k.shape));
      if (v.dtype != k.dtype) return absl::InvalidArgumentError(field + ".v.dtype differs from k");
      KVQ_ASSIGN_OR_RETURN(item.q, CheckTensor(it.q(), field + ".q",
                                               {k.shape[1], m.num_q_heads, m.head_dim}));
      item.kv = DenseKv{req.layer(), 1, static_cast<int>(k.shape[1]), k.dtype, k.data, v.data};
    }
    // Attention refuses a non-finite query: found here, before any item is
    // appended, the call changes nothing.
    item.q_floats = ToFloats(item.q);
    for (size_t e = 0; e < item.q_floats.size(); ++e) {
      if (!std::isfinite(item.q_floats[e])) {
        return absl::InvalidArgumentError(absl::StrCat(
            packed ? absl::StrCat("q[", i, "]") : field + ".q", ": element ", e, " is not finite"));
      }
    }
    {
      absl::ReaderMutexLock lock(&item.seq->mu());
      KVQ_RETURN_IF_ERROR(Prefixed(item.seq->ValidateDense(item.kv), field + ": "));
      if (item.seq->in_transaction()) {
        return absl::AbortedError(field + ": an append stream is in progress on this sequence");
      }
    }
    items.push_back(std::move(item));
  }
  std::vector<AttendJob> jobs;
  // Every item's sequence stays locked from the check below to its append:
  // an Append stream that opened since the checks above is refused here,
  // before any item is appended (its transaction would otherwise take in,
  // and could roll back, this call's acknowledged tokens).
  std::vector<Sequence*> seqs;
  for (Item& item : items) seqs.push_back(&*item.seq);
  std::optional<WriteLocks> locks(std::in_place, seqs);
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].seq->in_transaction()) {
      return absl::AbortedError(
          absl::StrCat("items[", i, "]: an append stream is in progress on this sequence"));
    }
  }
  // All or nothing: an item that fails (the pool full after eviction) undoes
  // the items appended before it, and their pages are sealed only once every
  // item is in.
  std::vector<int> before(items.size());
  std::vector<Sequence::AppendUndo> undo(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    Item& item = items[i];
    before[i] = item.seq->layer_tokens(req.layer());
    if (items.size() > 1) undo[i] = item.seq->UndoPoint(item.kv);
    absl::Status st = store_->WithEviction(&*item.seq, [&] { return item.seq->AppendDense(item.kv); });
    if (!st.ok()) {
      for (size_t u = i; u-- > 0;) items[u].seq->UndoAppend(items[u].kv, undo[u]);
      return Prefixed(st, absl::StrCat("items[", i, "]: "));
    }
  }
  for (size_t i = 0; i < items.size(); ++i) {
    Item& item = items[i];
    guard_.Seal(*item.seq, req.layer(), req.layer() + 1);
    AttendJob j;
    j.field = absl::StrCat("items[", i, "]");
    for (int t = 0; t < item.kv.tokens; ++t) j.positions.push_back(before[i] + t);
    j.key_end = before[i] + item.kv.tokens;
    j.q_storage = std::move(item.q_floats);
    j.q = j.q_storage.data();
    j.num_queries = item.kv.tokens;
    j.seq = std::move(item.seq);
    jobs.push_back(std::move(j));
  }
  locks.reset();  // Attention takes reader locks.
  return RunAttention(*store_->backend(), &kernel_thread_, metrics_, &guard_, method, req.layer(),
                      jobs, req.softmax_scale(), resp, packed);
}

// ------------------------------------------------------------ DecodeStream

class KvqService::DecodeReactor
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  DecodeReactor(KvqService* service, grpc::CallbackServerContext* ctx) : service_(service) {
    // The stream's tenant is settled once; every step is one request of
    // its rate.
    if (absl::Status st = service_->Admit(ctx, &tenant_); !st.ok()) {
      Finish(ToGrpc(st));
      return;
    }
    if (tenant_ != nullptr) tenant_name_ = tenant_->name();
    admitted_ = true;
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::OK);  // Client closed (or cancelled).
    RpcTimer timer(service_->metrics(), RpcMethod::kDecodeStream);
    timer.set_tenant(tenant_.get());
    service_->metrics()->AddReceivedBytes(RpcMethod::kDecodeStream, in_.Length());
    resp_.Clear();
    absl::Status st = admitted_ ? absl::OkStatus() : service_->AdmitStep(tenant_.get());
    admitted_ = false;
    if (st.ok()) st = service_->CheckSize(in_.Length());
    if (st.ok()) st = DecodeRequest(in_, &req_);
    in_.Clear();
    if (st.ok()) {
      st = service_->DoAppendAttend(req_.step(), resp_.mutable_result(), RpcMethod::kDecodeStream,
                                    tenant_name_);
    }
    if (st.ok()) st = EncodeResponse(resp_, &out_);
    timer.Finish(static_cast<int>(st.code()));
    if (!st.ok()) return Finish(ToGrpc(st));
    service_->metrics()->AddSentBytes(RpcMethod::kDecodeStream, out_.Length());
    StartWrite(&out_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "decode stream broken"));
    StartRead(&in_);
  }

  void OnDone() override { delete this; }

 private:
  KvqService* service_;
  std::shared_ptr<Tenant> tenant_;
  std::string tenant_name_;
  bool admitted_ = false;  // The first step was admitted with the stream.
  grpc::ByteBuffer in_;    // The step read, decoded into req_.
  v1::DecodeRequest req_;
  v1::DecodeResponse resp_;
  grpc::ByteBuffer out_;  // resp_ encoded, in flight.
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvqService::DecodeStream(
    grpc::CallbackServerContext* ctx) {
  return new DecodeReactor(this, ctx);
}

// ------------------------------------------------------ fork, release, stats

absl::Status KvqService::DoFork(const v1::ForkRequest& req, v1::ForkResponse* resp,
                                const CallInfo& call) {
  KVQ_ASSIGN_OR_RETURN(SequenceStore::Handle f,
                       store_->Fork(req.source().namespace_(), req.source().sequence_id(),
                                    req.new_sequence_id(), req.num_tokens(),
                                    absl::Seconds(req.ttl_seconds()), call.tenant_name));
  absl::ReaderMutexLock lock(&f->mu());
  resp->set_sequence_id(f->id());
  resp->set_num_tokens(f->num_tokens());
  resp->set_ttl_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(f->ttl)));
  return absl::OkStatus();
}

absl::Status KvqService::DoRelease(const v1::ReleaseRequest& req, v1::ReleaseResponse* resp,
                                   const CallInfo& call) {
  KVQ_ASSIGN_OR_RETURN(int64_t bytes,
                       store_->Release(req.sequence().namespace_(),
                                       req.sequence().sequence_id(), call.tenant_name));
  resp->set_bytes_freed(bytes);
  return absl::OkStatus();
}

absl::Status KvqService::DoStats(const v1::StatsRequest& req, v1::StatsResponse* resp,
                                 const CallInfo& call) {
  // A tenant sees only its own figures: its quota as the capacity (the
  // pool's without one), its bytes, its sequences; no pool-wide count.
  const bool scoped = call.tenant != nullptr;
  StoreStats scoped_stats;
  if (scoped) scoped_stats = store_->TenantStats(call.tenant_name);
  const PagePoolStats pool = scoped ? scoped_stats.pool : store_->pool().Stats();
  resp->set_capacity_bytes(scoped && pool.capacity_bytes == 0
                               ? store_->pool().Stats().capacity_bytes
                               : pool.capacity_bytes);
  resp->set_used_bytes(pool.used_bytes);
  resp->set_pages_total(pool.slabs_total);
  resp->set_pages_used(pool.slabs_used);
  ByteBreakdown bytes;
  int64_t fp16 = 0;
  int64_t elements = 0;
  if (req.sequence().sequence_id().empty()) {
    StoreStats st = scoped ? std::move(scoped_stats) : store_->Stats();
    resp->set_sequences(st.sequences);
    resp->set_calibrations_loaded(
        calibrations_ ? static_cast<int32_t>(calibrations_->size()) : 0);
    bytes = st.bytes;
    fp16 = st.fp16_equivalent_bytes;
    elements = fp16 / 2;
  } else {
    KVQ_ASSIGN_OR_RETURN(SequenceStore::Handle seq,
                         store_->Get(req.sequence().namespace_(),
                                     req.sequence().sequence_id(), call.tenant_name));
    absl::ReaderMutexLock lock(&seq->mu());
    const ModelShape& m = seq->shape();
    resp->set_sequences(1);
    // Tokens as readers see them (an open append stream's are not yet).
    resp->set_num_tokens(seq->committed_num_tokens());
    resp->set_scheme(seq->config().spec.ToString());
    if (seq->calibration()) resp->set_calibration(seq->calibration()->calibration.name);
    bytes = seq->Bytes();
    elements = int64_t{seq->committed_num_tokens()} * m.num_layers * m.num_kv_heads *
               m.head_dim * 2;
    fp16 = elements * 2;
  }
  FillBytes(bytes, resp->mutable_bytes());
  resp->set_bits_per_element(elements ? 8.0 * bytes.total() / elements : 0.0);
  resp->set_compression_vs_fp16(bytes.total() ? static_cast<double>(fp16) / bytes.total()
                                              : 0.0);
  return absl::OkStatus();
}

// ------------------------------------------------------------- MatchPrefix

}  // namespace kvq
