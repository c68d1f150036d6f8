#include "tests/client/fake_kv_cache.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/grpc_status.h"
#include "kernels/quant_spec.h"

namespace kvq {
namespace testing_fake {
namespace {

grpc::Status Invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
}

grpc::Status NotFound(const std::string& key) {
  return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("sequence ", key, " not found"));
}

// Rows [begin, end) of every head of one layer as [kv_heads, n, head_dim].
void ReadLayer(const LocalSequence& s, int layer, int begin, int end, DType dtype, bool apply_rope,
               v1::FetchResponse* out) {
  const int heads = s.kv_heads();
  const int d = s.stream(layer, 0).head_dim();
  const int n = end - begin;
  HostTensor k = HostTensor::Zeros(dtype, {heads, n, d});
  HostTensor v = HostTensor::Zeros(dtype, {heads, n, d});
  const size_t run = static_cast<size_t>(n) * d * DTypeBytes(dtype);
  ReadOptions read;
  read.dtype = dtype;
  read.apply_rope = apply_rope;
  for (int h = 0; h < heads; ++h) {
    const TensorView kv{k.mutable_bytes() + h * run, dtype, n, d, 0};
    const TensorView vv{v.mutable_bytes() + h * run, dtype, n, d, 0};
    (void)s.stream(layer, h).Read(begin, end, read, kv, vv);
  }
  out->set_layer(layer);
  out->set_token_begin(begin);
  ToProto(std::move(k), out->mutable_k());
  ToProto(std::move(v), out->mutable_v());
}

// Echo attention: out = q as fp32, lse = the layer index, so tests can
// check the marshalling of every item.
grpc::Status EchoAttend(int layer, const v1::Tensor& q, v1::AttendResult* result) {
  absl::StatusOr<HostTensor> qt = FromProto(q, "q");
  if (!qt.ok()) return ToGrpcStatus(qt.status());
  if (qt->rank() != 3) return Invalid("q must have rank 3");
  ToProto(qt->Cast(DType::kFloat32), result->mutable_out());
  std::vector<float> lse(qt->shape[0] * qt->shape[1], static_cast<float>(layer));
  ToProto(*HostTensor::FromFloats(lse, {qt->shape[0], qt->shape[1]}), result->mutable_lse());
  return grpc::Status::OK;
}

}  // namespace

void FakeKvCache::FailNext(const std::string& method, int n, grpc::Status status) {
  absl::MutexLock lock(&mu_);
  failures_[method] = {n, std::move(status)};
}

void FakeKvCache::HangNext(const std::string& method, int n) {
  absl::MutexLock lock(&mu_);
  hangs_[method] = n;
}

void FakeKvCache::LoseNextReleaseReply() {
  absl::MutexLock lock(&mu_);
  lose_release_reply_ = true;
}

int FakeKvCache::calls(const std::string& method) const {
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(method);
  return it == calls_.end() ? 0 : it->second;
}

absl::Duration FakeKvCache::last_deadline_left(const std::string& method) const {
  absl::MutexLock lock(&mu_);
  auto it = deadline_left_.find(method);
  return it == deadline_left_.end() ? absl::ZeroDuration() : it->second;
}

int FakeKvCache::append_messages() const {
  absl::MutexLock lock(&mu_);
  return append_messages_;
}

int FakeKvCache::num_tokens(const std::string& ns, const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(ns + "/" + id);
  return it == sequences_.end() ? -1 : it->second.local->num_tokens();
}

absl::StatusOr<FetchedKv> FakeKvCache::Read(const std::string& ns, const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(ns + "/" + id);
  if (it == sequences_.end()) return absl::NotFoundError(id);
  return it->second.local->Read(0, -1, ReadOptions());
}

grpc::Status FakeKvCache::Enter(const std::string& method, grpc::ServerContext* context) {
  bool hang = false;
  {
    absl::MutexLock lock(&mu_);
    ++calls_[method];
    deadline_left_[method] = absl::FromChrono(context->deadline()) - absl::Now();
    auto f = failures_.find(method);
    if (f != failures_.end() && f->second.first > 0) {
      --f->second.first;
      return f->second.second;
    }
    auto h = hangs_.find(method);
    if (h != hangs_.end() && h->second > 0) {
      --h->second;
      hang = true;
    }
  }
  if (hang) {
    // Until the client's deadline cancels the call (bounded, so a broken
    // test cannot hang forever).
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (!context->IsCancelled() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
    return grpc::Status(grpc::StatusCode::CANCELLED, "hung until cancelled");
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::GetServerInfo(grpc::ServerContext* context,
                                        const v1::GetServerInfoRequest*, v1::ServerInfo* response) {
  if (grpc::Status st = Enter("GetServerInfo", context); !st.ok()) return st;
  response->set_version("fake");
  response->set_backend("cpu");
  for (const std::string& s : SchemeNames()) response->add_schemes(s);
  response->add_input_dtypes(v1::DTYPE_FP32);
  response->add_input_dtypes(v1::DTYPE_FP16);
  response->add_output_dtypes(v1::DTYPE_FP16);
  response->set_max_message_bytes(64 << 20);
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::CreateSequence(grpc::ServerContext* context,
                                         const v1::CreateSequenceRequest* request,
                                         v1::CreateSequenceResponse* response) {
  if (grpc::Status st = Enter("CreateSequence", context); !st.ok()) return st;
  if (request->codebooks_size() > 0) return Invalid("the fake does not take codebooks");
  absl::MutexLock lock(&mu_);
  Stored s;
  s.config.layout = FromProto(request->layout());
  absl::StatusOr<QuantSpec> spec = QuantSpec::Parse(request->scheme());
  if (!spec.ok()) return ToGrpcStatus(spec.status());
  s.config.scheme = spec->ToString();
  absl::StatusOr<std::unique_ptr<LocalSequence>> local = LocalSequence::Create(s.config);
  if (!local.ok()) return ToGrpcStatus(local.status());
  s.local = std::move(*local);
  const std::string id =
      request->sequence_id().empty() ? absl::StrCat("seq-", next_id_++) : request->sequence_id();
  const std::string key = request->namespace_() + "/" + id;
  if (sequences_.count(key)) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, absl::StrCat(key, " exists"));
  }
  const KvStream& first = s.local->stream(0, 0);
  response->set_sequence_id(id);
  response->set_scheme(s.config.scheme);
  response->set_num_tokens(0);
  response->set_block_tokens(spec->is_kivi() ? spec->flush_tokens() : first.layout().page_tokens);
  sequences_.emplace(key, std::move(s));
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::Append(grpc::ServerContext* context,
                                 grpc::ServerReader<v1::AppendRequest>* reader,
                                 v1::AppendResponse* response) {
  if (grpc::Status st = Enter("Append", context); !st.ok()) return st;
  v1::AppendRequest message;
  std::string key;
  std::vector<v1::KvChunk> chunks;
  bool first = true;
  while (reader->Read(&message)) {
    {
      absl::MutexLock lock(&mu_);
      ++append_messages_;
    }
    if (first) key = Key(message.sequence());
    first = false;
    if (message.has_chunk()) chunks.push_back(std::move(*message.mutable_chunk()));
  }
  // Committed only on a clean half-close.
  if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(key);
  if (it == sequences_.end()) return NotFound(key);
  for (const v1::KvChunk& c : chunks) {
    if (absl::Status st = it->second.local->ApplyChunk(c); !st.ok()) return ToGrpcStatus(st);
  }
  response->set_num_tokens(it->second.local->num_tokens());
  response->set_bytes_stored(1);
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::FetchDequant(grpc::ServerContext* context,
                                       const v1::FetchRequest* request,
                                       grpc::ServerWriter<v1::FetchResponse>* writer) {
  if (grpc::Status st = Enter("FetchDequant", context); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  const std::string key = Key(request->sequence());
  auto it = sequences_.find(key);
  if (it == sequences_.end()) return NotFound(key);
  const LocalSequence& s = *it->second.local;
  const int layer_end = request->layer_end() > 0 ? request->layer_end() : s.layers();
  const int token_end = request->token_end() > 0 ? request->token_end() : s.num_tokens();
  if (request->layer_begin() < 0 || layer_end > s.layers() || request->token_begin() < 0 ||
      token_end > s.num_tokens() || request->token_begin() > token_end) {
    return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "range outside the sequence");
  }
  // As the service does: the first message states the resolved range.
  bool first = true;
  auto write = [&](v1::FetchResponse& m) {
    if (first) {
      m.set_range_layer_end(layer_end);
      m.set_range_token_end(token_end);
      first = false;
    }
    return writer->Write(m);
  };
  for (int l = request->layer_begin(); l < layer_end; ++l) {
    if (request->raw()) {
      // As the service does: raw pages only for quantized tokens, from a
      // page boundary, in messages of whole pages of max_chunk_bytes.
      if (request->dtype() != v1::DTYPE_UNSPECIFIED) return Invalid("dtype must be unset for raw");
      const KvStream& first = s.stream(l, 0);
      const int base = first.page_base(), pt = first.layout().page_tokens;
      const int tb = request->token_begin();
      if (tb < base || token_end > base + first.quantized_tokens() || (tb - base) % pt != 0) {
        return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "raw range outside the pages");
      }
      const int64_t page_set = int64_t{s.kv_heads()} * first.layout().page_bytes;
      const int64_t max_bytes = request->max_chunk_bytes() > 0 ? request->max_chunk_bytes() : 1 << 20;
      const int step = static_cast<int>(std::max<int64_t>(1, max_bytes / page_set)) * pt;
      for (int t = tb; t < token_end; t += step) {
        const int e = std::min(token_end, t + step);
        v1::FetchResponse m;
        m.set_layer(l);
        m.set_token_begin(t);
        v1::QuantizedPages* p = m.mutable_pages();
        const size_t run = static_cast<size_t>(first.PagesFor(e - t)) * first.layout().page_bytes;
        p->set_layers(1);
        p->set_tokens(e - t);
        p->set_page_bytes(first.layout().page_bytes);
        p->set_page_tokens(pt);
        p->mutable_page_data()->resize(run * s.kv_heads());
        for (int h = 0; h < s.kv_heads(); ++h) {
          (void)s.stream(l, h).CopyPages(t - base, e - base,
                                         reinterpret_cast<uint8_t*>(p->mutable_page_data()->data()) + h * run);
        }
        if (!write(m)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      }
      continue;
    }
    absl::StatusOr<DType> dtype =
        request->dtype() == v1::DTYPE_UNSPECIFIED ? DType::kFloat16 : FromProtoDType(request->dtype());
    if (!dtype.ok()) return ToGrpcStatus(dtype.status());
    const int64_t token_bytes =
        2 * int64_t{s.kv_heads()} * s.stream(l, 0).head_dim() * DTypeBytes(*dtype);
    const int64_t max_bytes = request->max_chunk_bytes() > 0 ? request->max_chunk_bytes() : 1 << 20;
    const int step = static_cast<int>(std::max<int64_t>(1, max_bytes / token_bytes));
    for (int t = request->token_begin();
         t < token_end || (t == token_end && t == request->token_begin());
         t += step) {  // An empty range still sends one (empty) message per layer.
      v1::FetchResponse m;
      ReadLayer(s, l, t, std::min(t + step, token_end), *dtype, request->apply_rope(), &m);
      if (!write(m)) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::Attend(grpc::ServerContext* context, const v1::AttendRequest* request,
                                 v1::AttendResponse* response) {
  if (grpc::Status st = Enter("Attend", context); !st.ok()) return st;
  for (const v1::AttendItem& item : request->items()) {
    if (grpc::Status st = EchoAttend(request->layer(), item.q(), response->add_results()); !st.ok()) {
      return st;
    }
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::AppendAttend(grpc::ServerContext* context,
                                       const v1::AppendAttendRequest* request,
                                       v1::AttendResponse* response) {
  if (grpc::Status st = Enter("AppendAttend", context); !st.ok()) return st;
  for (const v1::AppendAttendItem& item : request->items()) {
    if (grpc::Status st = EchoAttend(request->layer(), item.q(), response->add_results()); !st.ok()) {
      return st;
    }
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::DecodeStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) {
  if (grpc::Status st = Enter("DecodeStream", context); !st.ok()) return st;
  v1::DecodeRequest request;
  while (stream->Read(&request)) {
    if (request.step().layer() < 0) {
      return Invalid(absl::StrCat("layer ", request.step().layer(), " is negative"));
    }
    v1::DecodeResponse response;
    for (const v1::AppendAttendItem& item : request.step().items()) {
      grpc::Status st = EchoAttend(request.step().layer(), item.q(), response.mutable_result()->add_results());
      if (!st.ok()) return st;
    }
    stream->Write(response);
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::Fork(grpc::ServerContext* context, const v1::ForkRequest*,
                               v1::ForkResponse* response) {
  if (grpc::Status st = Enter("Fork", context); !st.ok()) return st;
  response->set_sequence_id("forked");
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::Release(grpc::ServerContext* context, const v1::ReleaseRequest* request,
                                  v1::ReleaseResponse* response) {
  if (grpc::Status st = Enter("Release", context); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  const std::string key = Key(request->sequence());
  if (sequences_.erase(key) == 0) return NotFound(key);
  response->set_bytes_freed(4096);
  if (lose_release_reply_) {
    lose_release_reply_ = false;
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "reply lost");
  }
  return grpc::Status::OK;
}

grpc::Status FakeKvCache::Stats(grpc::ServerContext* context, const v1::StatsRequest* request,
                                v1::StatsResponse* response) {
  if (grpc::Status st = Enter("Stats", context); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  response->set_sequences(static_cast<int64_t>(sequences_.size()));
  if (request->sequence().sequence_id().empty()) return grpc::Status::OK;
  const std::string key = Key(request->sequence());
  auto it = sequences_.find(key);
  if (it == sequences_.end()) return NotFound(key);
  response->set_num_tokens(it->second.local->num_tokens());
  response->set_scheme(it->second.config.scheme);
  return grpc::Status::OK;
}

}  // namespace testing_fake
}  // namespace kvq
