#include "client/kvq_client.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/fetch_placer.h"
#include "client/grpc_status.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "kernels/malloc_tuning.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

double JitterFactor(double jitter) {
  if (jitter <= 0.0) return 1.0;
  thread_local std::minstd_rand rng(std::random_device{}());
  std::uniform_real_distribution<double> d(1.0 - jitter, 1.0 + jitter);
  return d(rng);
}

absl::Status CheckTensor(const HostTensor& t, absl::string_view name, int rank) {
  if (t.rank() != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must have rank ", rank, ", got ", t.DebugString()));
  }
  if (absl::Status st = t.Validate(); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AttendOutput>> ToOutputs(v1::AttendResponse&& response) {
  std::vector<AttendOutput> out;
  out.reserve(response.results_size());
  for (int i = 0; i < response.results_size(); ++i) {
    v1::AttendResult* r = response.mutable_results(i);
    AttendOutput o;
    KVQ_ASSIGN_OR_RETURN(o.out, FromProto(std::move(*r->mutable_out()),
                                          absl::StrCat("results[", i, "].out")));
    KVQ_ASSIGN_OR_RETURN(o.lse, FromProto(std::move(*r->mutable_lse()),
                                          absl::StrCat("results[", i, "].lse")));
    out.push_back(std::move(o));
  }
  return out;
}

absl::Status FillAppendAttend(int layer, absl::Span<const AppendAttendItem> items,
                              float softmax_scale, absl::string_view ns,
                              v1::AppendAttendRequest* request) {
  request->set_layer(layer);
  request->set_softmax_scale(softmax_scale);
  for (size_t i = 0; i < items.size(); ++i) {
    const AppendAttendItem& it = items[i];
    const std::string at = absl::StrCat("items[", i, "].");
    KVQ_RETURN_IF_ERROR(CheckTensor(it.k, at + "k", 3));
    KVQ_RETURN_IF_ERROR(CheckTensor(it.v, at + "v", 3));
    KVQ_RETURN_IF_ERROR(CheckTensor(it.q, at + "q", 3));
    v1::AppendAttendItem* item = request->add_items();
    item->mutable_sequence()->set_namespace_(std::string(ns));
    item->mutable_sequence()->set_sequence_id(it.sequence_id);
    ToProto(it.k, item->mutable_k());
    ToProto(it.v, item->mutable_v());
    ToProto(it.q, item->mutable_q());
  }
  return absl::OkStatus();
}

absl::Status FillAppendAttendBatch(int layer, const DecodeBatch& batch, float softmax_scale,
                                   absl::string_view ns, v1::AppendAttendRequest* request) {
  KVQ_RETURN_IF_ERROR(CheckTensor(batch.k, "k", 3));
  KVQ_RETURN_IF_ERROR(CheckTensor(batch.v, "v", 3));
  KVQ_RETURN_IF_ERROR(CheckTensor(batch.q, "q", 3));
  const int64_t n = static_cast<int64_t>(batch.sequence_ids.size());
  for (const auto& [name, t] : {std::pair<const char*, const HostTensor*>{"k", &batch.k},
                                {"v", &batch.v}, {"q", &batch.q}}) {
    if (n == 0 || t->shape[0] != n) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".shape[0] = ", t->shape[0],
                                                     " must equal the ", n,
                                                     " sequences (one row each, at least one)"));
    }
  }
  request->set_layer(layer);
  request->set_softmax_scale(softmax_scale);
  for (const std::string& id : batch.sequence_ids) {
    v1::SequenceRef* ref = request->add_items()->mutable_sequence();
    ref->set_namespace_(std::string(ns));
    ref->set_sequence_id(id);
  }
  ToProto(batch.k, request->mutable_k());
  ToProto(batch.v, request->mutable_v());
  ToProto(batch.q, request->mutable_q());
  return absl::OkStatus();
}

// The packed reply of AttendBatch and AppendAttendBatch.
absl::StatusOr<AttendOutput> ToPackedOutput(v1::AttendResponse&& response) {
  if (!response.has_out() || !response.has_lse()) {
    return absl::UnimplementedError("the server answered without a packed out/lse: it predates "
                                    "the packed form");
  }
  AttendOutput o;
  KVQ_ASSIGN_OR_RETURN(o.out, FromProto(std::move(*response.mutable_out()), "out"));
  KVQ_ASSIGN_OR_RETURN(o.lse, FromProto(std::move(*response.mutable_lse()), "lse"));
  return o;
}

}  // namespace

bool IsRetryableCode(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

absl::Duration RetryBackoff(const RetryPolicy& policy, int retry) {
  absl::Duration d = policy.initial_backoff;
  for (int i = 1; i < retry && d < policy.max_backoff; ++i) d = d * policy.multiplier;
  return std::min(d, policy.max_backoff);
}

// ------------------------------------------------------------------ client

absl::StatusOr<std::unique_ptr<KvqClient>> KvqClient::Connect(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target is empty");
  if (options.deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("deadline must be > 0");
  }
  if (options.retry.max_attempts < 1) {
    return absl::InvalidArgumentError("retry.max_attempts must be >= 1");
  }
  if (options.max_reconnect_backoff <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_reconnect_backoff must be > 0");
  }
  // Best effort: a malloc other than glibc's keeps its own settings.
  if (options.retain_message_buffers) RetainMessageBuffers().IgnoreError();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  const int backoff_ms = static_cast<int>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(options.max_reconnect_backoff), 1, 3'600'000));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, backoff_ms);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::min(backoff_ms, 1000));
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, backoff_ms);
  auto creds = options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  return std::make_unique<KvqClient>(grpc::CreateCustomChannel(options.target, creds, args),
                                     options);
}

KvqClient::KvqClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::KvCache::NewStub(channel_)),
      local_pages_(std::make_unique<RecyclingPageAllocator>(options.local_page_cache_bytes)) {}

void KvqClient::SetDeadline(grpc::ClientContext* context, const CallOptions& call) const {
  const absl::Duration d =
      call.deadline > absl::ZeroDuration() ? call.deadline : options_.deadline;
  if (d == absl::InfiniteDuration()) return;
  context->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

void KvqClient::AddToken(grpc::ClientContext* context) const {
  if (!options_.token.empty()) context->AddMetadata("authorization", "Bearer " + options_.token);
}

void KvqClient::Ref(absl::string_view sequence_id, v1::SequenceRef* out) const {
  out->set_namespace_(options_.ns);
  out->set_sequence_id(std::string(sequence_id));
}

absl::Status KvqClient::Call(
    bool idempotent, const CallOptions& call,
    const std::function<grpc::Status(grpc::ClientContext*, int attempt)>& attempt) {
  const int attempts = idempotent ? std::max(options_.retry.max_attempts, 1) : 1;
  absl::Status status;
  for (int i = 1; i <= attempts; ++i) {
    if (i > 1) {
      absl::SleepFor(RetryBackoff(options_.retry, i - 1) * JitterFactor(options_.retry.jitter));
    }
    grpc::ClientContext context;
    SetDeadline(&context, call);
    AddToken(&context);
    status = FromGrpcStatus(attempt(&context, i));
    if (status.ok() || !IsRetryableCode(status.code())) return status;
  }
  return status;
}

absl::StatusOr<v1::ServerInfo> KvqClient::GetServerInfo(const CallOptions& call) {
  v1::ServerInfo info;
  KVQ_RETURN_IF_ERROR(Call(true, call, [&](grpc::ClientContext* ctx, int) {
    info.Clear();
    return stub_->GetServerInfo(ctx, v1::GetServerInfoRequest(), &info);
  }));
  return info;
}

absl::StatusOr<SequenceInfo> KvqClient::CreateSequence(const CreateOptions& options) {
  KVQ_RETURN_IF_ERROR(options.config.ToStreamConfig().status());
  v1::CreateSequenceRequest request;
  request.set_namespace_(options_.ns);
  request.set_sequence_id(options.sequence_id);
  ToProto(options.config.layout, request.mutable_layout());
  request.set_scheme(options.config.scheme);
  request.set_ttl_seconds(options.ttl_seconds);
  for (const Codebook& c : options.config.codebooks) ToProto(c, request.add_codebooks());
  request.set_calibration(options.config.calibration);
  request.mutable_prompt_token_ids()->Assign(options.prompt_token_ids.begin(),
                                             options.prompt_token_ids.end());
  v1::CreateSequenceResponse response;
  KVQ_RETURN_IF_ERROR(Call(false, options.call, [&](grpc::ClientContext* ctx, int) {
    return stub_->CreateSequence(ctx, request, &response);
  }));
  return SequenceInfo{response.sequence_id(), response.scheme(), response.num_tokens(),
                      response.block_tokens(), response.ttl_seconds()};
}

absl::StatusOr<PrefixMatch> KvqClient::MatchPrefix(const SequenceConfig& config,
                                                   const std::vector<int32_t>& prompt_token_ids,
                                                   const CallOptions& call) {
  KVQ_RETURN_IF_ERROR(config.ToStreamConfig().status());
  v1::MatchPrefixRequest request;
  request.set_namespace_(options_.ns);
  ToProto(config.layout, request.mutable_layout());
  request.set_scheme(config.scheme);
  for (const Codebook& c : config.codebooks) ToProto(c, request.add_codebooks());
  request.set_calibration(config.calibration);
  request.mutable_prompt_token_ids()->Assign(prompt_token_ids.begin(), prompt_token_ids.end());
  v1::MatchPrefixResponse response;
  KVQ_RETURN_IF_ERROR(Call(true, call, [&](grpc::ClientContext* ctx, int) {
    return stub_->MatchPrefix(ctx, request, &response);
  }));
  return PrefixMatch{response.matched_tokens(), response.block_tokens()};
}

absl::StatusOr<AppendResult> KvqClient::SendPlan(absl::string_view sequence_id,
                                                 const HostTensor& k, const HostTensor& v,
                                                 const AppendPlan& plan,
                                                 const AppendOptions& options,
                                                 const SequenceConfig* config) {
  PlanOptions plan_options{options.max_chunk_bytes, options.layer_begin,
                           options.quantize_threads};
  ChunkBuilder builder(k, v, plan, plan_options, config,
                       options.backend ? options.backend : &CpuBackend());
  AppendResult result;
  // Append is never retried: one attempt, one stream.
  v1::AppendResponse response;
  absl::Status local;  // A client-side failure that cancelled the stream.
  const absl::Status st = Call(false, options.call, [&](grpc::ClientContext* ctx, int) {
    std::unique_ptr<grpc::ClientWriterInterface<v1::AppendRequest>> writer =
        stub_->Append(ctx, &response);
    v1::AppendRequest request;
    Ref(sequence_id, request.mutable_sequence());
    request.mutable_token_ids()->Assign(options.token_ids.begin(), options.token_ids.end());
    bool ok = true;
    if (options.progress) options.progress(0, plan.total_bytes);
    for (const PlannedChunk& chunk : plan.chunks) {
      absl::StatusOr<v1::KvChunk> built = builder.Build(chunk);
      if (!built.ok()) {
        local = built.status();
        ctx->TryCancel();  // Nothing is committed without a half-close.
        break;
      }
      request.mutable_chunk()->Swap(&*built);
      ok = writer->Write(request);
      if (!ok) break;
      request.Clear();
      ++result.chunks;
      result.wire_bytes += chunk.payload_bytes;
      if (options.progress) options.progress(result.wire_bytes, plan.total_bytes);
    }
    if (local.ok() && ok && plan.chunks.empty()) ok = writer->Write(request);
    if (local.ok() && ok) writer->WritesDone();
    return writer->Finish();
  });
  if (!local.ok()) return local;
  KVQ_RETURN_IF_ERROR(st);
  result.num_tokens = response.num_tokens();
  result.bytes_stored = response.bytes_stored();
  return result;
}

absl::StatusOr<AppendResult> KvqClient::AppendPrompt(absl::string_view sequence_id,
                                                     const HostTensor& k, const HostTensor& v,
                                                     const AppendOptions& options) {
  if (options.device.transport != PayloadTransport::kGrpc) {
    return AppendDevice(sequence_id, k, v, options);
  }
  PlanOptions plan_options{options.max_chunk_bytes, options.layer_begin,
                           options.quantize_threads};
  KVQ_ASSIGN_OR_RETURN(const AppendPlan plan,
                       PlanDenseAppend(k, v, options.wire_dtype.value_or(k.dtype), plan_options));
  return SendPlan(sequence_id, k, v, plan, options, nullptr);
}

absl::StatusOr<AppendResult> KvqClient::AppendPromptQuantized(absl::string_view sequence_id,
                                                              const SequenceConfig& config,
                                                              const HostTensor& k,
                                                              const HostTensor& v,
                                                              const AppendOptions& options) {
  KVQ_ASSIGN_OR_RETURN(const StreamConfig stream_config, config.ToStreamConfig());
  if (k.rank() == 4 && (k.shape[0] + options.layer_begin > config.layout.num_layers ||
                        k.shape[1] != config.layout.num_kv_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k is ", k.DebugString(), " from layer ", options.layer_begin, "; the sequence has ",
        config.layout.num_layers, " layers and ", config.layout.num_kv_heads, " kv heads"));
  }
  PlanOptions plan_options{options.max_chunk_bytes, options.layer_begin,
                           options.quantize_threads};
  KVQ_ASSIGN_OR_RETURN(const AppendPlan plan,
                       PlanQuantizedAppend(k, v, stream_config, options.start_tokens,
                                           options.block_tokens, plan_options));
  return SendPlan(sequence_id, k, v, plan, options, &config);
}

absl::Status KvqClient::FetchStream(
    absl::string_view sequence_id, const FetchOptions& options, bool raw,
    const std::function<absl::Status(v1::FetchResponse&&)>& on_message,
    const std::function<void()>& on_restart) {
  v1::FetchRequest request;
  Ref(sequence_id, request.mutable_sequence());
  request.set_layer_begin(options.layer_begin);
  request.set_layer_end(options.layer_end);
  request.set_token_begin(options.token_begin);
  request.set_token_end(options.token_end);
  if (!raw) request.set_dtype(ToProtoDType(options.dtype));  // Raw: unset.
  request.set_apply_rope(options.apply_rope && !raw);
  request.set_raw(raw);
  request.set_max_chunk_bytes(options.max_chunk_bytes);
  absl::Status local;
  absl::Status st = Call(true, options.call, [&](grpc::ClientContext* ctx, int attempt) {
    if (attempt > 1) on_restart();
    std::unique_ptr<grpc::ClientReaderInterface<v1::FetchResponse>> reader =
        stub_->FetchDequant(ctx, request);
    v1::FetchResponse message;
    while (reader->Read(&message)) {
      local = on_message(std::move(message));
      if (!local.ok()) {
        ctx->TryCancel();
        break;
      }
      message.Clear();
    }
    return reader->Finish();
  });
  return local.ok() ? st : local;
}


absl::StatusOr<FetchedKv> KvqClient::FetchDequant(absl::string_view sequence_id,
                                                  const FetchOptions& options) {
  // The first message states the resolved range: the output is sized once
  // and every message copied into place (peak memory: the result).
  FetchedKv out;
  std::optional<FetchPlacer> placer;
  KVQ_RETURN_IF_ERROR(FetchStream(
      sequence_id, options, /*raw=*/false,
      [&](v1::FetchResponse&& m) -> absl::Status {
        if (!placer) {
          const int64_t layers = int64_t{m.range_layer_end()} - options.layer_begin;
          const int64_t tokens = int64_t{m.range_token_end()} - options.token_begin;
          if (layers <= 0 || tokens < 0 || m.k().shape_size() != 3) {
            return absl::DataLossError(
                absl::StrCat("the first fetch response states layers [", options.layer_begin, ", ",
                             m.range_layer_end(), ") and tokens [", options.token_begin, ", ",
                             m.range_token_end(), ") with k ", m.k().shape_size(),
                             "-d; expected a range and [kv_heads, tokens, head_dim]"));
          }
          const std::vector<int64_t> shape = {layers, m.k().shape(0), tokens, m.k().shape(2)};
          out.layer_begin = options.layer_begin;
          out.token_begin = options.token_begin;
          out.k = HostTensor::Zeros(options.dtype, shape);
          out.v = HostTensor::Zeros(options.dtype, shape);
          placer.emplace(options, &out.k, &out.v);
        }
        return placer->Place(m);
      },
      [&] {
        placer.reset();
        out = FetchedKv();
      }));
  if (!placer) return absl::DataLossError("the fetch stream ended without a message");
  KVQ_RETURN_IF_ERROR(placer->CheckComplete());
  return out;
}

namespace {

// The fetch range that output tensors k and v ([layers, kv_heads, tokens,
// head_dim] of options.dtype) set: options with layer_end and token_end
// filled in, which must be 0 or agree.
absl::StatusOr<FetchOptions> RangeOfOutputs(const FetchOptions& options, const HostTensor* k,
                                            const HostTensor* v) {
  if (k == nullptr || v == nullptr) return absl::InvalidArgumentError("k and v must not be null");
  KVQ_RETURN_IF_ERROR(CheckTensor(*k, "k", 4));
  KVQ_RETURN_IF_ERROR(CheckTensor(*v, "v", 4));
  if (k->shape != v->shape || k->dtype != options.dtype || v->dtype != options.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k and v must both be [layers, kv_heads, tokens, head_dim] of ", DTypeName(options.dtype),
        ", got ", k->DebugString(), " and ", v->DebugString()));
  }
  FetchOptions o = options;
  o.layer_end = static_cast<int>(options.layer_begin + k->shape[0]);
  o.token_end = static_cast<int>(options.token_begin + k->shape[2]);
  if ((options.layer_end != 0 && options.layer_end != o.layer_end) ||
      (options.token_end != 0 && options.token_end != o.token_end)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k is ", k->DebugString(), ": layers [", options.layer_begin, ", ", o.layer_end,
        ") and tokens [", options.token_begin, ", ", o.token_end, "), but options ask for layer_end ",
        options.layer_end, " and token_end ", options.token_end));
  }
  return o;
}

}  // namespace

absl::Status KvqClient::FetchDequantInto(absl::string_view sequence_id,
                                         const FetchOptions& options, HostTensor* k,
                                         HostTensor* v) {
  if (options.device.transport != PayloadTransport::kGrpc) {
    if (k == nullptr || v == nullptr) return absl::InvalidArgumentError("k and v must not be null");
    return FetchDevice(sequence_id, options, *k, *v);
  }
  KVQ_ASSIGN_OR_RETURN(const FetchOptions o, RangeOfOutputs(options, k, v));
  if (o.layer_end == o.layer_begin) return absl::OkStatus();
  FetchPlacer placer(options, k, v);
  KVQ_RETURN_IF_ERROR(FetchStream(
      sequence_id, o, /*raw=*/false,
      // Not moved from: the next Read reuses this message's buffers.
      [&](v1::FetchResponse&& m) { return placer.Place(m); }, [&] { placer.Reset(); }));
  return placer.CheckComplete();
}

absl::StatusOr<RawFetch> KvqClient::FetchRaw(absl::string_view sequence_id,
                                             const FetchOptions& options) {
  RawFetch raw;
  KVQ_RETURN_IF_ERROR(FetchStream(
      sequence_id, options, /*raw=*/true,
      [&](v1::FetchResponse&& m) {
        raw.wire_bytes += static_cast<int64_t>(m.k().data().size() + m.v().data().size() +
                                               m.pages().page_data().size());
        raw.responses.push_back(std::move(m));
        if (options.progress) options.progress(raw.wire_bytes, -1);
        return absl::OkStatus();
      },
      [&] { raw = RawFetch(); }));
  return raw;
}

absl::Status KvqClient::FetchLocalInto(absl::string_view sequence_id,
                                       const SequenceConfig& config, const FetchOptions& o,
                                       int num_tokens, HostTensor* k, HostTensor* v) {
  KVQ_ASSIGN_OR_RETURN(const StreamConfig stream_config, config.ToStreamConfig());
  KVQ_ASSIGN_OR_RETURN(const std::unique_ptr<LocalSequence> local,
                       LocalSequence::Create(config, o.layer_begin, o.layer_end - o.layer_begin,
                                             &CpuBackend(), local_pages_.get()));
  const TokenPlacement place = PlaceTokens(stream_config, num_tokens);
  const int q_begin = place.sink, q_end = place.sink + place.quantized;
  int64_t done = 0;
  // One stream of the fetch, each message placed as it arrives.
  auto stream_into = [&](const FetchOptions& part, bool raw, auto& placer) -> absl::Status {
    KVQ_RETURN_IF_ERROR(FetchStream(
        sequence_id, part, raw,
        [&](v1::FetchResponse&& m) {
          KVQ_RETURN_IF_ERROR(placer.Place(m));
          if (o.progress) o.progress(done + placer.bytes(), -1);
          return absl::OkStatus();
        },
        [&] { placer.Reset(); }));
    KVQ_RETURN_IF_ERROR(placer.CheckComplete());
    done += placer.bytes();
    return absl::OkStatus();
  };
  // The sink and the fp16 tail come dequantized by the server, as
  // FetchDequantInto would place them.
  auto dense = [&](int begin, int end) -> absl::Status {
    if (begin >= end) return absl::OkStatus();
    FetchOptions part = o;
    part.token_begin = begin;
    part.token_end = end;
    part.progress = nullptr;
    FetchPlacer placer(part, k, v, begin - o.token_begin, end - begin);
    return stream_into(part, /*raw=*/false, placer);
  };
  KVQ_RETURN_IF_ERROR(dense(o.token_begin, std::min(o.token_end, q_begin)));
  // The quantized part as raw pages from the page holding its first token,
  // dequantized here as each message arrives (while the server prepares
  // the next); a restarted stream rewrites the same rows.
  const int begin = std::max(o.token_begin, q_begin), end = std::min(o.token_end, q_end);
  if (begin < end) {
    const int pt = local->stream(o.layer_begin, 0).layout().page_tokens;
    FetchOptions part = o;
    part.token_begin = q_begin + (begin - q_begin) / pt * pt;
    part.token_end = end;
    ReadOptions read;
    read.dtype = o.dtype;
    read.apply_rope = o.apply_rope;
    read.streaming_output =
        o.streaming_output_bytes >= 0 &&
        static_cast<int64_t>(k->byte_size() + v->byte_size()) >= o.streaming_output_bytes;
    RawPagePlacer placer(*local, read, part.token_begin, begin, end, o.token_begin, k, v);
    KVQ_RETURN_IF_ERROR(stream_into(part, /*raw=*/true, placer));
  }
  return dense(std::max(o.token_begin, q_end), o.token_end);
}

absl::StatusOr<FetchedKv> KvqClient::FetchDequantLocal(absl::string_view sequence_id,
                                                       const SequenceConfig& config,
                                                       const FetchOptions& options) {
  KVQ_ASSIGN_OR_RETURN(const StreamConfig stream_config, config.ToStreamConfig());
  if (stream_config.spec.kind == SchemeKind::kFp8E4m3) return FetchDequant(sequence_id, options);
  KVQ_ASSIGN_OR_RETURN(const v1::StatsResponse stats, Stats(sequence_id, options.call));
  FetchOptions o = options;
  if (o.layer_end <= 0) o.layer_end = config.layout.num_layers;
  if (o.token_end <= 0) o.token_end = stats.num_tokens();
  if (o.layer_begin < 0 || o.layer_begin >= o.layer_end || o.layer_end > config.layout.num_layers) {
    return absl::OutOfRangeError(absl::StrCat("layers [", o.layer_begin, ", ", o.layer_end,
                                              ") are not a range inside [0, ",
                                              config.layout.num_layers, ")"));
  }
  if (o.token_begin < 0 || o.token_begin > o.token_end || o.token_end > stats.num_tokens()) {
    return absl::OutOfRangeError(absl::StrCat("token range [", o.token_begin, ", ", o.token_end,
                                              ") is not inside [0, ", stats.num_tokens(), "]"));
  }
  FetchedKv out;
  out.layer_begin = o.layer_begin;
  out.token_begin = o.token_begin;
  const std::vector<int64_t> shape = {o.layer_end - o.layer_begin, config.layout.num_kv_heads,
                                      o.token_end - o.token_begin, config.layout.head_dim};
  out.k = HostTensor::Zeros(o.dtype, shape);
  out.v = HostTensor::Zeros(o.dtype, shape);
  KVQ_RETURN_IF_ERROR(FetchLocalInto(sequence_id, config, o, stats.num_tokens(), &out.k, &out.v));
  return out;
}

absl::Status KvqClient::FetchDequantLocalInto(absl::string_view sequence_id,
                                              const SequenceConfig& config,
                                              const FetchOptions& options, HostTensor* k,
                                              HostTensor* v) {
  KVQ_ASSIGN_OR_RETURN(const StreamConfig stream_config, config.ToStreamConfig());
  if (stream_config.spec.kind == SchemeKind::kFp8E4m3) {
    return FetchDequantInto(sequence_id, options, k, v);
  }
  KVQ_ASSIGN_OR_RETURN(const FetchOptions o, RangeOfOutputs(options, k, v));
  if (o.layer_end == o.layer_begin) return absl::OkStatus();
  if (k->shape[1] != config.layout.num_kv_heads || k->shape[3] != config.layout.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k is ", k->DebugString(), "; the sequence has ", config.layout.num_kv_heads,
        " kv heads of head_dim ", config.layout.head_dim));
  }
  KVQ_ASSIGN_OR_RETURN(const v1::StatsResponse stats, Stats(sequence_id, o.call));
  if (o.token_end > stats.num_tokens() || o.layer_end > config.layout.num_layers) {
    return absl::OutOfRangeError(absl::StrCat(
        "k is ", k->DebugString(), " from layer ", o.layer_begin, " token ", o.token_begin,
        "; the sequence has ", config.layout.num_layers, " layers and ", stats.num_tokens(),
        " tokens"));
  }
  return FetchLocalInto(sequence_id, config, o, stats.num_tokens(), k, v);
}

absl::StatusOr<std::vector<AttendOutput>> KvqClient::Attend(int layer,
                                                            absl::Span<const AttendQuery> items,
                                                            float softmax_scale,
                                                            const CallOptions& call) {
  v1::AttendRequest request;
  request.set_layer(layer);
  request.set_softmax_scale(softmax_scale);
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendQuery& it = items[i];
    KVQ_RETURN_IF_ERROR(CheckTensor(it.q, absl::StrCat("items[", i, "].q"), 3));
    v1::AttendItem* item = request.add_items();
    Ref(it.sequence_id, item->mutable_sequence());
    ToProto(it.q, item->mutable_q());
    item->mutable_q_positions()->Assign(it.q_positions.begin(), it.q_positions.end());
    item->set_key_begin(it.key_begin);
    item->set_key_end(it.key_end);
  }
  v1::AttendResponse response;
  KVQ_RETURN_IF_ERROR(Call(true, call, [&](grpc::ClientContext* ctx, int) {
    response.Clear();
    return stub_->Attend(ctx, request, &response);
  }));
  return ToOutputs(std::move(response));
}

absl::StatusOr<AttendOutput> KvqClient::AttendBatch(int layer,
                                                    absl::Span<const std::string> sequence_ids,
                                                    const HostTensor& q,
                                                    const AttendBatchOptions& options) {
  KVQ_RETURN_IF_ERROR(CheckTensor(q, "q", 3));
  if (sequence_ids.empty() || q.shape[0] != static_cast<int64_t>(sequence_ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat("q.shape[0] = ", q.shape[0], " must equal the ",
                                                   sequence_ids.size(),
                                                   " sequences (one query row each, at least one)"));
  }
  v1::AttendRequest request;
  request.set_layer(layer);
  request.set_softmax_scale(options.softmax_scale);
  for (const std::string& id : sequence_ids) {
    v1::AttendItem* item = request.add_items();
    Ref(id, item->mutable_sequence());
    item->set_key_end(options.key_end);
  }
  ToProto(q, request.mutable_q());
  v1::AttendResponse response;
  KVQ_RETURN_IF_ERROR(Call(true, options.call, [&](grpc::ClientContext* ctx, int) {
    response.Clear();
    return stub_->Attend(ctx, request, &response);
  }));
  return ToPackedOutput(std::move(response));
}

absl::StatusOr<std::vector<AttendOutput>> KvqClient::AppendAttend(
    int layer, absl::Span<const AppendAttendItem> items, float softmax_scale,
    const CallOptions& call) {
  v1::AppendAttendRequest request;
  KVQ_RETURN_IF_ERROR(FillAppendAttend(layer, items, softmax_scale, options_.ns, &request));
  KVQ_ASSIGN_OR_RETURN(v1::AttendResponse response, CallAppendAttend(request, call));
  return ToOutputs(std::move(response));
}

absl::StatusOr<v1::AttendResponse> KvqClient::CallAppendAttend(
    const v1::AppendAttendRequest& request, const CallOptions& call) {
  v1::AttendResponse response;
  KVQ_RETURN_IF_ERROR(Call(false, call, [&](grpc::ClientContext* ctx, int) {
    return stub_->AppendAttend(ctx, request, &response);
  }));
  return response;
}

absl::StatusOr<AttendOutput> KvqClient::AppendAttendBatch(int layer, const DecodeBatch& batch,
                                                          float softmax_scale,
                                                          const CallOptions& call) {
  v1::AppendAttendRequest request;
  KVQ_RETURN_IF_ERROR(FillAppendAttendBatch(layer, batch, softmax_scale, options_.ns, &request));
  KVQ_ASSIGN_OR_RETURN(v1::AttendResponse response, CallAppendAttend(request, call));
  return ToPackedOutput(std::move(response));
}

absl::StatusOr<std::unique_ptr<DecodeSession>> KvqClient::OpenDecodeSession(
    absl::Duration deadline) {
  std::unique_ptr<DecodeSession> s(new DecodeSession());
  s->ns_ = options_.ns;
  if (deadline != absl::InfiniteDuration()) {
    s->context_.set_deadline(std::chrono::system_clock::now() +
                             absl::ToChronoMilliseconds(deadline));
  }
  AddToken(&s->context_);
  s->stream_ = stub_->DecodeStream(&s->context_);
  if (s->stream_ == nullptr) return absl::InternalError("DecodeStream returned no stream");
  return s;
}

absl::StatusOr<ForkResult> KvqClient::Fork(absl::string_view source_id,
                                           const ForkOptions& options) {
  v1::ForkRequest request;
  Ref(source_id, request.mutable_source());
  request.set_new_sequence_id(options.new_sequence_id);
  request.set_num_tokens(options.num_tokens);
  request.set_ttl_seconds(options.ttl_seconds);
  v1::ForkResponse response;
  KVQ_RETURN_IF_ERROR(Call(false, options.call, [&](grpc::ClientContext* ctx, int) {
    return stub_->Fork(ctx, request, &response);
  }));
  return ForkResult{response.sequence_id(), response.num_tokens(), response.ttl_seconds()};
}

absl::StatusOr<int64_t> KvqClient::Release(absl::string_view sequence_id,
                                           const CallOptions& call) {
  v1::ReleaseRequest request;
  Ref(sequence_id, request.mutable_sequence());
  v1::ReleaseResponse response;
  KVQ_RETURN_IF_ERROR(Call(true, call, [&](grpc::ClientContext* ctx, int attempt) {
    response.Clear();
    grpc::Status st = stub_->Release(ctx, request, &response);
    // An earlier attempt may have released it and lost the reply.
    if (attempt > 1 && st.error_code() == grpc::StatusCode::NOT_FOUND) return grpc::Status::OK;
    return st;
  }));
  return response.bytes_freed();
}

absl::StatusOr<v1::StatsResponse> KvqClient::Stats(absl::string_view sequence_id,
                                                   const CallOptions& call) {
  v1::StatsRequest request;
  Ref(sequence_id, request.mutable_sequence());
  v1::StatsResponse response;
  KVQ_RETURN_IF_ERROR(Call(true, call, [&](grpc::ClientContext* ctx, int) {
    response.Clear();
    return stub_->Stats(ctx, request, &response);
  }));
  return response;
}

// ---------------------------------------------------------- decode session

DecodeSession::~DecodeSession() {
  if (stream_ != nullptr && !final_.has_value()) {
    context_.TryCancel();
    stream_->Finish();
  }
}

absl::Status DecodeSession::Broken() {
  if (!final_.has_value()) {
    absl::Status st = FromGrpcStatus(stream_->Finish());
    final_ = st.ok() ? absl::UnavailableError("decode stream closed by the server") : st;
  }
  return *final_;
}

absl::Status DecodeSession::CheckOpen(bool writing) const {
  if (final_.has_value()) {
    return final_->ok() ? absl::FailedPreconditionError("session closed") : *final_;
  }
  if (writing && writes_done_) return absl::FailedPreconditionError("session closed");
  return absl::OkStatus();
}

absl::Status DecodeSession::Send(const v1::DecodeRequest& request) {
  if (!stream_->Write(request)) return Broken();
  return absl::OkStatus();
}

absl::StatusOr<v1::AttendResponse> DecodeSession::Receive() {
  KVQ_RETURN_IF_ERROR(CheckOpen(false));
  v1::DecodeResponse response;
  if (!stream_->Read(&response)) return Broken();
  return std::move(*response.mutable_result());
}

absl::Status DecodeSession::Write(int layer, absl::Span<const AppendAttendItem> items,
                                  float softmax_scale) {
  KVQ_RETURN_IF_ERROR(CheckOpen(true));
  v1::DecodeRequest request;
  KVQ_RETURN_IF_ERROR(FillAppendAttend(layer, items, softmax_scale, ns_, request.mutable_step()));
  return Send(request);
}

absl::StatusOr<std::vector<AttendOutput>> DecodeSession::Read() {
  KVQ_ASSIGN_OR_RETURN(v1::AttendResponse result, Receive());
  return ToOutputs(std::move(result));
}

absl::Status DecodeSession::WriteBatch(int layer, const DecodeBatch& batch,
                                       float softmax_scale) {
  KVQ_RETURN_IF_ERROR(CheckOpen(true));
  v1::DecodeRequest request;
  KVQ_RETURN_IF_ERROR(
      FillAppendAttendBatch(layer, batch, softmax_scale, ns_, request.mutable_step()));
  return Send(request);
}

absl::StatusOr<AttendOutput> DecodeSession::ReadBatch() {
  KVQ_ASSIGN_OR_RETURN(v1::AttendResponse result, Receive());
  return ToPackedOutput(std::move(result));
}

absl::StatusOr<AttendOutput> DecodeSession::StepBatch(int layer, const DecodeBatch& batch,
                                                      float softmax_scale) {
  KVQ_RETURN_IF_ERROR(WriteBatch(layer, batch, softmax_scale));
  return ReadBatch();
}

absl::StatusOr<std::vector<AttendOutput>> DecodeSession::Step(
    int layer, absl::Span<const AppendAttendItem> items, float softmax_scale) {
  KVQ_RETURN_IF_ERROR(Write(layer, items, softmax_scale));
  return Read();
}

absl::Status DecodeSession::Close() {
  if (final_.has_value()) return *final_;
  if (!writes_done_) {
    stream_->WritesDone();
    writes_done_ = true;
  }
  // Drain responses nobody read so that Finish() can complete.
  v1::DecodeResponse unread;
  while (stream_->Read(&unread)) {
  }
  final_ = FromGrpcStatus(stream_->Finish());
  return *final_;
}

}  // namespace kvq
