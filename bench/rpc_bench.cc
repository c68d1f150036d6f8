#include "bench/rpc_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_kvq_server.h"
#include "bench/bench_stats.h"
#include "bench/child_process.h"
#include "bench/raw_echo.grpc.pb.h"
#include "bench/resp_client.h"
#include "bench/smollm_prompt.h"
#include "client/append_plan.h"
#include "client/grpc_status.h"
#include "client/kvq_client.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kernels/status_macros.h"
#include "service/page_pool.h"

namespace kvq {
namespace {

using bench::Clock;

// SmolLM2-135M (bench/smollm_prompt.h).
using smollm::kHeadDim;
using smollm::kKvHeads;
using smollm::kLayers;
using smollm::kQHeads;
using smollm::MakeKv;
using smollm::RandomTensor;

constexpr int kDefaultTokens = 4096;
constexpr int kQuickTokens = 1024;
constexpr int kDefaultBulkReps = 7;
constexpr int kQuickBulkReps = 2;
constexpr int kDefaultLatencyReps = 300;
constexpr int kQuickLatencyReps = 30;
constexpr int kSmallEchoBytes = 64;
constexpr int kLatencyRounds = 10;  // Kernel and RPC timings alternate in this many blocks.
constexpr char kNamespace[] = "kvq-bench-rpc";
// The schemes of the round trip and of the latency sections.
constexpr const char* kRoundTripSchemes[] = {"kivi4", "kivi2"};
constexpr const char* kAttendSchemes[] = {"fp16", "kivi2"};
constexpr int kShortContext = 32;  // Keys of the RPC-path Attend rows.

using bench::Median;
using bench::SecondsSince;

// Nearest rank.
double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * v.size()));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

LatencyStats Summarize(std::vector<double> us) {
  LatencyStats s;
  s.p50_us = Median(us);
  s.p99_us = Percentile(us, 99.0);
  s.min_us = us.empty() ? 0.0 : *std::min_element(us.begin(), us.end());
  s.us = std::move(us);
  return s;
}

void Summarize(ThroughputRow* row) {
  row->median_s = Median(row->seconds);
  row->client_cpu_s = Median(row->client_cpu);
  const bool known =
      !row->server_cpu.empty() &&
      std::all_of(row->server_cpu.begin(), row->server_cpu.end(), [](double x) { return x >= 0; });
  row->server_cpu_s = known ? Median(row->server_cpu) : -1.0;
  row->store_s = row->store_seconds.empty() ? -1.0 : Median(row->store_seconds);
  row->min_s =
      row->seconds.empty() ? 0.0 : *std::min_element(row->seconds.begin(), row->seconds.end());
}

// The 1-minute load average (0 when unknown).
double LoadAverage() {
  double load = 0.0;
  std::ifstream in("/proc/loadavg");
  in >> load;
  return load;
}

absl::Status Annotate(const absl::Status& st, absl::string_view what) {
  if (st.ok()) return st;
  return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
}

// Wall and CPU time of one operation: the bench process and the server
// that serves it.
class Span {
 public:
  explicit Span(const ChildProcess* server)
      : server_(server),
        client_cpu_(SelfCpuSeconds()),
        server_cpu_(server ? server->CpuSeconds() : -1.0),
        start_(Clock::now()) {}

  // Wall seconds; adds the repetition to `row` when `timed`.
  double End(ThroughputRow* row, bool timed) {
    const double wall = SecondsSince(start_);
    if (timed) Add(row, wall);
    return wall;
  }

  double Elapsed() const { return SecondsSince(start_); }

  // For a row that sums two spans of one repetition.
  static void AddSum(ThroughputRow* row, const ThroughputRow& a, const ThroughputRow& b) {
    row->seconds.push_back(a.seconds.back() + b.seconds.back());
    row->store_seconds.push_back(a.seconds.back());
    row->client_cpu.push_back(a.client_cpu.back() + b.client_cpu.back());
    const double sa = a.server_cpu.back(), sb = b.server_cpu.back();
    row->server_cpu.push_back(sa >= 0 && sb >= 0 ? sa + sb : -1.0);
  }

 private:
  void Add(ThroughputRow* row, double wall) const {
    row->seconds.push_back(wall);
    row->client_cpu.push_back(SelfCpuSeconds() - client_cpu_);
    const double now = server_ ? server_->CpuSeconds() : -1.0;
    row->server_cpu.push_back(now >= 0 && server_cpu_ >= 0 ? now - server_cpu_ : -1.0);
  }

  const ChildProcess* server_;
  double client_cpu_;
  double server_cpu_;
  Clock::time_point start_;
};

// Keeps every hardware thread busy for `ms` (see warm_cores_ms).
void KeepCoresBusy(int ms) {
  if (ms <= 0) return;
  const auto until = Clock::now() + std::chrono::milliseconds(ms);
  auto spin = [until] {
    uint64_t n = 0;
    while (Clock::now() < until) ++n;
    return n;
  };
  std::vector<std::thread> others;
  for (unsigned i = 1; i < std::max(1u, std::thread::hardware_concurrency()); ++i) {
    others.emplace_back([spin] { (void)spin(); });
  }
  (void)spin();
  for (std::thread& t : others) t.join();
}

ThroughputRow MakeRow(std::string id, std::string label, int64_t fp16_bytes, int64_t wire_bytes,
                      int64_t tokens) {
  ThroughputRow row;
  row.id = std::move(id);
  row.label = std::move(label);
  row.fp16_bytes = fp16_bytes;
  row.wire_bytes = wire_bytes;
  row.tokens = tokens;
  return row;
}

// The chunk_bytes pieces of some buffers laid end to end.
struct Piece {
  const char* src;
  char* dst;
  size_t size;
};
std::vector<Piece> CutPieces(const std::vector<std::pair<const char*, char*>>& buffers,
                             size_t buffer_bytes, size_t chunk) {
  std::vector<Piece> pieces;
  for (const auto& [src, dst] : buffers) {
    for (size_t off = 0; off < buffer_bytes; off += chunk) {
      pieces.push_back({src + off, dst + off, std::min(chunk, buffer_bytes - off)});
    }
  }
  return pieces;
}

// ----------------------------------------------------------- raw client

class RawEchoClient {
 public:
  explicit RawEchoClient(const std::string& target) {
    grpc::ChannelArguments args;  // As KvqClient::Connect.
    args.SetMaxReceiveMessageSize(static_cast<int>(ClientOptions().max_message_bytes));
    args.SetMaxSendMessageSize(static_cast<int>(ClientOptions().max_message_bytes));
    stub_ = bench::RawEcho::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }

  // One client stream carrying every piece (copied into its message).
  absl::Status SinkStream(const std::vector<Piece>& pieces) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    bench::SinkReply reply;
    std::unique_ptr<grpc::ClientWriter<bench::Blob>> writer = stub_->SinkStream(&ctx, &reply);
    bench::Blob blob;
    int64_t sent = 0;
    for (const Piece& p : pieces) {
      blob.set_data(p.src, p.size);
      if (!writer->Write(blob)) break;
      sent += static_cast<int64_t>(p.size);
    }
    writer->WritesDone();
    KVQ_RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()));
    if (reply.bytes() != sent) {
      return absl::InternalError(
          absl::StrCat("SinkStream: sent ", sent, " bytes, the server got ", reply.bytes()));
    }
    return absl::OkStatus();
  }

  // One unary Sink per piece.
  absl::Status SinkUnary(const std::vector<Piece>& pieces) {
    bench::Blob blob;
    bench::SinkReply reply;
    for (const Piece& p : pieces) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      blob.set_data(p.src, p.size);
      KVQ_RETURN_IF_ERROR(FromGrpcStatus(stub_->Sink(&ctx, blob, &reply)));
    }
    return absl::OkStatus();
  }

  // total bytes in messages of `chunk`, copied to dst in order.
  absl::Status Source(int64_t total, int64_t chunk, char* dst) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    bench::SourceRequest request;
    request.set_total_bytes(total);
    request.set_chunk_bytes(static_cast<int32_t>(chunk));
    std::unique_ptr<grpc::ClientReader<bench::Blob>> reader = stub_->Source(&ctx, request);
    bench::Blob blob;
    int64_t got = 0;
    while (reader->Read(&blob)) {
      const size_t n = blob.data().size();
      if (got + static_cast<int64_t>(n) > total) {
        ctx.TryCancel();
        break;
      }
      std::memcpy(dst + got, blob.data().data(), n);
      got += static_cast<int64_t>(n);
    }
    KVQ_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
    if (got != total) {
      return absl::InternalError(absl::StrCat("Source: got ", got, " of ", total, " bytes"));
    }
    return absl::OkStatus();
  }

  // A request of payload.size() bytes, a reply of reply_bytes.
  absl::Status Echo(const std::string& payload, int reply_bytes) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    bench::EchoRequest request;
    request.set_data(payload);
    request.set_reply_bytes(reply_bytes);
    bench::Blob reply;
    KVQ_RETURN_IF_ERROR(FromGrpcStatus(stub_->Echo(&ctx, request, &reply)));
    if (static_cast<int>(reply.data().size()) != reply_bytes) {
      return absl::InternalError("Echo: wrong reply size");
    }
    return absl::OkStatus();
  }

 private:
  static void SetDeadline(grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  }
  std::unique_ptr<bench::RawEcho::Stub> stub_;
};

// ---------------------------------------------------------------- redis

// A Redis layout of the prompt's fp16 K and V: keys, each the
// concatenation of some source pieces, read back into `dst`.
struct RedisKey {
  std::string name;
  std::vector<absl::string_view> parts;
  char* dst = nullptr;
  size_t size = 0;
};

struct RedisVariant {
  std::string id;
  std::string label;
  int connections = 1;
  std::vector<RedisKey> keys;
};

// SET every key (pipelined on each connection), then GET every key back;
// with several connections, each takes every n-th key on its own thread.
// `set_seconds` (may be null) receives the time until every SET was acked.
absl::Status RedisRoundTrip(const RedisVariant& v,
                            const std::vector<std::unique_ptr<RespClient>>& conns,
                            double* set_seconds = nullptr) {
  const auto start = Clock::now();
  const int n = v.connections;
  auto run = [&](int c, bool set) -> absl::Status {
    RespClient& client = *conns[c];
    for (size_t i = c; i < v.keys.size(); i += n) {
      const RedisKey& key = v.keys[i];
      KVQ_RETURN_IF_ERROR(set ? client.SendSet(key.name, key.parts) : client.SendGet(key.name));
    }
    for (size_t i = c; i < v.keys.size(); i += n) {
      const RedisKey& key = v.keys[i];
      if (set) {
        absl::StatusOr<std::string> ok = client.ReadSimple();
        if (!ok.ok()) return ok.status();
      } else {
        absl::StatusOr<size_t> got = client.ReadBulkInto(key.dst, key.size);
        if (!got.ok()) return got.status();
        if (*got != key.size) {
          return absl::InternalError(
              absl::StrCat("GET ", key.name, ": ", *got, " bytes, expected ", key.size));
        }
      }
    }
    return absl::OkStatus();
  };
  for (bool set : {true, false}) {
    if (n == 1) {
      KVQ_RETURN_IF_ERROR(run(0, set));
      if (set && set_seconds != nullptr) *set_seconds = SecondsSince(start);
      continue;
    }
    std::vector<absl::Status> status(n);
    std::vector<std::thread> threads;
    for (int c = 0; c < n; ++c) threads.emplace_back([&, c] { status[c] = run(c, set); });
    for (std::thread& t : threads) t.join();
    for (const absl::Status& st : status) KVQ_RETURN_IF_ERROR(st);
    if (set && set_seconds != nullptr) *set_seconds = SecondsSince(start);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- bench

class RpcBench {
 public:
  RpcBench(const RpcBenchOptions& options, std::ostream* progress)
      : options_(options), progress_(progress), start_(Clock::now()) {}

  absl::StatusOr<RpcBenchResult> Run();

 private:
  template <typename... Args>
  void Log(const absl::FormatSpec<Args...>& format, const Args&... args) {
    if (progress_ == nullptr) return;
    *progress_ << absl::StrFormat("[%6.1fs] ", SecondsSince(start_))
               << absl::StrFormat(format, args...) << "\n";
    progress_->flush();
  }

  absl::Status StartServers();
  absl::Status StartRedis();
  absl::Status RunBulk();
  absl::Status RunRoundTrip();
  absl::Status RunLatency();

  absl::StatusOr<SequenceInfo> Create(const std::string& scheme) {
    CreateOptions create;
    create.config.layout = smollm::Layout();
    create.config.scheme = scheme;
    return client_->CreateSequence(create);
  }
  SequenceConfig Config(const std::string& canonical_scheme) const {
    SequenceConfig c;
    c.layout = smollm::Layout();
    c.scheme = canonical_scheme;
    return c;
  }

  RpcBenchOptions options_;
  std::ostream* progress_;
  Clock::time_point start_;
  RpcBenchResult result_;
  int tokens_ = 0;

  // Declared in teardown order: clients go before the servers they talk to.
  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ChildProcess> kvq_server_;
  std::unique_ptr<ChildProcess> echo_server_;
  std::unique_ptr<ChildProcess> redis_server_;
  int redis_port_ = 0;
  std::unique_ptr<KvqClient> client_;
  std::unique_ptr<RawEchoClient> raw_;
  std::vector<std::unique_ptr<RespClient>> redis_;

  HostTensor k_, v_;  // The prompt, fp16 [layers, kv_heads, tokens, head_dim].
};

absl::Status RpcBench::StartServers() {
  KVQ_ASSIGN_OR_RETURN(dir_, ScratchDir::Create("kvq-bench-rpc-"));
  KVQ_ASSIGN_OR_RETURN(const std::string self, SelfExecutable());
  if (options_.server.empty()) {
    KVQ_ASSIGN_OR_RETURN(
        StartedKvqServer started,
        StartKvqServer(options_.kvq_server_path, "--server", options_.capacity_bytes, *dir_));
    kvq_server_ = std::move(started.process);
    result_.kvq_target = absl::StrCat("127.0.0.1:", started.port);
    result_.kvq_started = true;
  } else {
    result_.kvq_target = options_.server;
  }

  const std::string echo_port_file = dir_->File("echo.port");
  KVQ_ASSIGN_OR_RETURN(echo_server_, ChildProcess::Start("kvq-bench rpc-echo-server",
                                                         {self, "rpc-echo-server",
                                                          "--echo_port_file=" + echo_port_file},
                                                         dir_->File("echo.log")));
  KVQ_ASSIGN_OR_RETURN(const int echo_port,
                       WaitForPortFile(echo_port_file, echo_server_.get(), absl::Seconds(60)));
  raw_ = std::make_unique<RawEchoClient>(absl::StrCat("127.0.0.1:", echo_port));

  ClientOptions client_options;
  client_options.target = result_.kvq_target;
  client_options.ns = kNamespace;
  client_options.deadline = absl::Seconds(120);
  KVQ_ASSIGN_OR_RETURN(client_, KvqClient::Connect(client_options));
  KVQ_ASSIGN_OR_RETURN(const v1::ServerInfo info, client_->GetServerInfo());
  result_.kvq_version = info.version();
  result_.kvq_backend = info.backend();
  // Both channels connected before anything is timed.
  KVQ_RETURN_IF_ERROR(raw_->Echo(std::string(kSmallEchoBytes, 'x'), kSmallEchoBytes));
  Log("kvq-server %s (backend %s) at %s%s; RawEcho at 127.0.0.1:%d", info.version(), info.backend(),
      result_.kvq_target, result_.kvq_started ? " (started)" : "", echo_port);
  return StartRedis();
}

absl::Status RpcBench::StartRedis() {
  if (options_.redis_server.empty()) {
    result_.redis_note = "Redis skipped: --redis_server is empty";
    Log("%s", result_.redis_note);
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> path = FindExecutable(options_.redis_server);
  if (!path.ok()) {
    result_.redis_note = absl::StrCat("Redis skipped: ", path.status().message(),
                                      " (scripts/install_deps.sh installs it)");
    Log("%s", result_.redis_note);
    return absl::OkStatus();
  }
  // The port is free when picked but not reserved: retry if another
  // process takes it first.
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    KVQ_ASSIGN_OR_RETURN(const int port, FreeLoopbackPort());
    KVQ_ASSIGN_OR_RETURN(
        redis_server_,
        ChildProcess::Start(
            "redis-server",
            {*path, "--port", absl::StrCat(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", dir_->path(), "--daemonize", "no", "--logfile", ""},
            dir_->File(absl::StrCat("redis-", attempt, ".log"))));
    absl::StatusOr<std::unique_ptr<RespClient>> c;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    do {
      c = RespClient::Connect("127.0.0.1", port, absl::Milliseconds(200));
    } while (!c.ok() && redis_server_->Running() && absl::Now() < deadline);
    if (!c.ok()) {
      last =
          absl::UnavailableError(absl::StrCat("redis-server did not start: ", c.status().message(),
                                              "; log: ", redis_server_->LogTail()));
      (void)redis_server_->Stop();
      redis_server_.reset();
      continue;
    }
    redis_port_ = port;
    redis_.push_back(*std::move(c));
    break;
  }
  if (redis_.empty()) return last;
  const absl::string_view ping[] = {"PING"};
  KVQ_ASSIGN_OR_RETURN(const std::string pong, redis_[0]->Call(ping));
  if (pong != "PONG") return absl::InternalError(absl::StrCat("redis PING: ", pong));
  const absl::string_view info[] = {"INFO", "server"};
  KVQ_RETURN_IF_ERROR(redis_[0]->Send(info));
  KVQ_ASSIGN_OR_RETURN(const std::string text, redis_[0]->ReadBulk());
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, "redis_version:")) {
      result_.redis_version = std::string(absl::StripAsciiWhitespace(line));
    }
  }
  for (int i = 1; i < std::max(1, options_.redis_connections); ++i) {
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<RespClient> c,
                         RespClient::Connect("127.0.0.1", redis_port_, absl::Seconds(5)));
    redis_.push_back(std::move(c));
  }
  result_.redis_ran = true;
  result_.redis_note = absl::StrCat("redis-server ", result_.redis_version,
                                    " started with --save \"\" --appendonly no (defaults "
                                    "otherwise: one I/O thread)");
  Log("%s, port %d", result_.redis_note, redis_port_);
  return absl::OkStatus();
}

absl::Status RpcBench::RunBulk() {
  const int64_t bytes = result_.prompt_fp16_bytes;
  const int T = tokens_;
  const size_t chunk = static_cast<size_t>(options_.chunk_bytes);
  std::string dst(static_cast<size_t>(bytes), '\0');
  const std::vector<Piece> pieces =
      CutPieces({{k_.data.data(), dst.data()}, {v_.data.data(), dst.data() + k_.byte_size()}},
                k_.byte_size(), chunk);
  const std::string mib = absl::StrFormat("%d KiB", chunk >> 10);
  ThroughputRow append =
      MakeRow("kvq_append_fp16", absl::StrCat("kvq Append fp16 (AppendPrompt, ", mib, " chunks)"),
              bytes, 0, T);
  ThroughputRow sink =
      MakeRow("raw_sink_stream", absl::StrCat("raw client stream (RawEcho.SinkStream, ", mib, ")"),
              bytes, 0, T);
  ThroughputRow fetch =
      MakeRow("kvq_fetch_fp16", "kvq FetchDequant fp16 (all layers)", bytes, 0, T);
  ThroughputRow fetch_into = MakeRow(
      "kvq_fetch_into_fp16", "kvq FetchDequantInto fp16 (all layers, reused k/v)", bytes, 0, T);
  // The caller's tensors, allocated and touched once, as raw Source's dst.
  HostTensor k_into = HostTensor::Zeros(DType::kFloat16, k_.shape);
  HostTensor v_into = HostTensor::Zeros(DType::kFloat16, v_.shape);
  ThroughputRow source =
      MakeRow("raw_source_stream", absl::StrCat("raw server stream (RawEcho.Source, ", mib, ")"),
              bytes, 0, T);
  ThroughputRow unary =
      MakeRow("raw_sink_unary",
              absl::StrCat("raw unary, a call per ", mib, " (RawEcho.Sink) [ref]"), bytes, 0, T);
  ThroughputRow roundtrip =
      MakeRow("kvq_roundtrip_fp16", "kvq fp16 (AppendPrompt + FetchDequant)", 2 * bytes, 0, T);
  roundtrip.wire_bytes = 2 * bytes;
  AppendOptions append_options;
  append_options.max_chunk_bytes = options_.chunk_bytes;
  const int total = result_.bulk_warmup + result_.bulk_reps;
  // Interleaved, so that a noisy neighbour slows kvq and the ceiling alike.
  for (int rep = 0; rep < total; ++rep) {
    const bool timed = rep >= result_.bulk_warmup;
    KVQ_ASSIGN_OR_RETURN(const SequenceInfo seq, Create("fp16"));
    KeepCoresBusy(options_.warm_cores_ms);
    Span span(kvq_server_.get());
    KVQ_RETURN_IF_ERROR(Annotate(
        client_->AppendPrompt(seq.sequence_id, k_, v_, append_options).status(), "AppendPrompt"));
    const double t_append = span.End(&append, timed);

    KeepCoresBusy(options_.warm_cores_ms);
    span = Span(echo_server_.get());
    KVQ_RETURN_IF_ERROR(raw_->SinkStream(pieces));
    const double t_sink = span.End(&sink, timed);

    KeepCoresBusy(options_.warm_cores_ms);
    span = Span(kvq_server_.get());
    absl::StatusOr<FetchedKv> fetched = client_->FetchDequant(seq.sequence_id);
    const double t_fetch = span.End(&fetch, timed);
    KVQ_RETURN_IF_ERROR(Annotate(fetched.status(), "FetchDequant"));
    if (rep == 0 && (fetched->k.data != k_.data || fetched->v.data != v_.data)) {
      return absl::InternalError("FetchDequant of an fp16 sequence returned other bytes");
    }
    fetched = FetchedKv();

    KeepCoresBusy(options_.warm_cores_ms);
    span = Span(kvq_server_.get());
    KVQ_RETURN_IF_ERROR(
        Annotate(client_->FetchDequantInto(seq.sequence_id, {}, &k_into, &v_into), "FetchDequantInto"));
    span.End(&fetch_into, timed);
    if (rep == 0 && (k_into.data != k_.data || v_into.data != v_.data)) {
      return absl::InternalError("FetchDequantInto of an fp16 sequence returned other bytes");
    }

    KeepCoresBusy(options_.warm_cores_ms);
    span = Span(echo_server_.get());
    KVQ_RETURN_IF_ERROR(raw_->Source(bytes, options_.chunk_bytes, dst.data()));
    const double t_source = span.End(&source, timed);

    KeepCoresBusy(options_.warm_cores_ms);
    span = Span(echo_server_.get());
    KVQ_RETURN_IF_ERROR(raw_->SinkUnary(pieces));
    const double t_unary = span.End(&unary, timed);
    KVQ_RETURN_IF_ERROR(client_->Release(seq.sequence_id).status());
    if (timed) Span::AddSum(&roundtrip, append, fetch);
    Log("bulk %s %d/%d: append %.1f ms (raw %.1f), fetch %.1f ms (raw %.1f), unary %.1f ms",
        timed ? "rep" : "warm-up", timed ? rep - result_.bulk_warmup + 1 : rep + 1,
        timed ? result_.bulk_reps : result_.bulk_warmup, 1e3 * t_append, 1e3 * t_sink,
        1e3 * t_fetch, 1e3 * t_source, 1e3 * t_unary);
  }
  for (ThroughputRow* r : {&append, &sink, &fetch, &fetch_into, &source, &unary, &roundtrip}) {
    Summarize(r);
  }
  result_.bulk = {append, sink, fetch, fetch_into, source, unary};
  result_.roundtrip.push_back(roundtrip);
  return absl::OkStatus();
}

absl::Status RpcBench::RunRoundTrip() {
  const int64_t bytes = result_.prompt_fp16_bytes;
  const int T = tokens_;
  std::vector<ThroughputRow> kvq_rows;
  for (const char* scheme : kRoundTripSchemes) {
    kvq_rows.push_back(
        MakeRow(absl::StrCat("kvq_roundtrip_", scheme),
                absl::StrCat("kvq ", scheme, " (AppendPromptQuantized + FetchDequantLocalInto)"),
                2 * bytes, 0, T));
  }
  // Redis layouts of the same bytes: a key per layer (K then V of the
  // layer) or per chunk, on one connection or several.
  std::string dst(static_cast<size_t>(bytes), '\0');
  char* dst_k = dst.data();
  char* dst_v = dst.data() + k_.byte_size();
  std::vector<char> layer_dst(result_.redis_ran ? static_cast<size_t>(bytes) : 0);
  std::vector<RedisVariant> variants;
  std::vector<ThroughputRow> redis_rows;
  if (result_.redis_ran) {
    const size_t layer_bytes = k_.byte_size() / kLayers;
    const size_t chunk = static_cast<size_t>(options_.chunk_bytes);
    const int many = std::max(1, options_.redis_connections);
    for (int connections : {1, many}) {
      RedisVariant per_layer;
      per_layer.connections = connections;
      per_layer.id = absl::StrCat("redis_layer_keys_", connections, "conn");
      per_layer.label =
          absl::StrFormat("Redis SET+GET, a key per layer (%.1f MiB), %d conn%s",
                          2.0 * layer_bytes / 1048576.0, connections, connections > 1 ? "s" : "");
      for (int l = 0; l < kLayers; ++l) {
        RedisKey key;
        key.name = absl::StrCat("kvq-bench:layer:", l);
        key.parts = {absl::string_view(k_.data).substr(l * layer_bytes, layer_bytes),
                     absl::string_view(v_.data).substr(l * layer_bytes, layer_bytes)};
        key.size = 2 * layer_bytes;
        per_layer.keys.push_back(key);
      }
      RedisVariant per_chunk;
      per_chunk.connections = connections;
      per_chunk.id = absl::StrCat("redis_chunk_keys_", connections, "conn");
      per_chunk.label = absl::StrFormat("Redis SET+GET, a key per %d KiB, %d conn%s", chunk >> 10,
                                        connections, connections > 1 ? "s" : "");
      const std::vector<Piece> pieces =
          CutPieces({{k_.data.data(), dst_k}, {v_.data.data(), dst_v}}, k_.byte_size(), chunk);
      for (size_t i = 0; i < pieces.size(); ++i) {
        RedisKey key;
        key.name = absl::StrCat("kvq-bench:chunk:", i);
        key.parts = {absl::string_view(pieces[i].src, pieces[i].size)};
        key.dst = pieces[i].dst;
        key.size = pieces[i].size;
        per_chunk.keys.push_back(key);
      }
      variants.push_back(std::move(per_layer));
      variants.push_back(std::move(per_chunk));
      if (many == 1) break;
    }
    // Per-layer keys come back as K then V of the layer, into a buffer laid
    // out layer by layer.
    for (RedisVariant& v : variants) {
      if (!absl::StrContains(v.id, "layer")) continue;
      for (int l = 0; l < kLayers; ++l) v.keys[l].dst = layer_dst.data() + l * v.keys[l].size;
    }
    for (const RedisVariant& v : variants) {
      redis_rows.push_back(MakeRow(v.id, v.label, 2 * bytes, 2 * bytes, T));
    }
    // Checked once, untimed: every variant returns the bytes it stored.
    for (const RedisVariant& v : variants) {
      KVQ_RETURN_IF_ERROR(Annotate(RedisRoundTrip(v, redis_), v.id));
      for (const RedisKey& key : v.keys) {
        size_t off = 0;
        for (absl::string_view part : key.parts) {
          if (std::memcmp(key.dst + off, part.data(), part.size()) != 0) {
            return absl::InternalError(
                absl::StrCat(v.id, ": GET ", key.name, " returned other bytes than SET stored"));
          }
          off += part.size();
        }
      }
    }
  }

  // Fetched K/V land in tensors allocated once, as Redis's GETs land in
  // `dst` (FetchDequantInto's row of the bulk section is the same choice).
  HostTensor k_back = HostTensor::Zeros(k_.dtype, k_.shape);
  HostTensor v_back = HostTensor::Zeros(v_.dtype, v_.shape);
  const int total = result_.bulk_warmup + result_.bulk_reps;
  // One round trip of kvq scheme s; timed ones go into its row.
  auto kvq_round_trip = [&](size_t s, bool timed) -> absl::StatusOr<double> {
    ThroughputRow& row = kvq_rows[s];
    AppendOptions append_options;
    append_options.max_chunk_bytes = options_.chunk_bytes;
    int64_t fetched_wire = 0;
    FetchOptions fetch_options;
    fetch_options.progress = [&](int64_t done, int64_t) { fetched_wire = done; };
    KeepCoresBusy(options_.warm_cores_ms);
    Span span(kvq_server_.get());
    KVQ_ASSIGN_OR_RETURN(const SequenceInfo seq, Create(kRoundTripSchemes[s]));
    const SequenceConfig config = Config(seq.scheme);
    absl::StatusOr<AppendResult> appended =
        client_->AppendPromptQuantized(seq.sequence_id, config, k_, v_, append_options);
    KVQ_RETURN_IF_ERROR(Annotate(appended.status(), "AppendPromptQuantized"));
    const double t_store = span.Elapsed();
    const absl::Status back =
        client_->FetchDequantLocalInto(seq.sequence_id, config, fetch_options, &k_back, &v_back);
    const double t = span.End(&row, timed);
    KVQ_RETURN_IF_ERROR(Annotate(back, "FetchDequantLocalInto"));
    row.wire_bytes = appended->wire_bytes + fetched_wire;
    if (timed) row.store_seconds.push_back(t_store);
    KVQ_RETURN_IF_ERROR(client_->Release(seq.sequence_id).status());
    return t;
  };
  auto redis_round_trip = [&](size_t i, bool timed) -> absl::StatusOr<double> {
    KeepCoresBusy(options_.warm_cores_ms);
    Span span(redis_server_.get());
    double t_set = 0.0;
    KVQ_RETURN_IF_ERROR(Annotate(RedisRoundTrip(variants[i], redis_, &t_set), variants[i].id));
    const double t = span.End(&redis_rows[i], timed);
    if (timed) redis_rows[i].store_seconds.push_back(t_set);
    return t;
  };
  // With --roundtrip_warm_pass every timed round trip follows an untimed
  // one of the same path, so each path is timed back to back with itself
  // (tokens per second of repeated round trips), whatever ran before it:
  // BENCHMARKS.md section 5 found the first multi-threaded round trip after Redis's
  // single-connection ping-pong 11-18 ms slower, a cost of this virtual
  // machine's idle cores that only the path after Redis paid.
  const bool warm_pass = options_.roundtrip_warm_pass;
  for (int rep = 0; rep < total; ++rep) {
    const bool timed = rep >= result_.bulk_warmup;
    std::string line;
    for (size_t s = 0; s < kvq_rows.size(); ++s) {
      if (warm_pass) KVQ_RETURN_IF_ERROR(kvq_round_trip(s, false).status());
      KVQ_ASSIGN_OR_RETURN(const double t, kvq_round_trip(s, timed));
      absl::StrAppendFormat(&line, " %s %.1f ms", kRoundTripSchemes[s], 1e3 * t);
    }
    for (size_t i = 0; i < variants.size(); ++i) {
      if (warm_pass) KVQ_RETURN_IF_ERROR(redis_round_trip(i, false).status());
      KVQ_ASSIGN_OR_RETURN(const double t, redis_round_trip(i, timed));
      absl::StrAppendFormat(&line, ", %s %.1f ms", variants[i].id, 1e3 * t);
    }
    Log("round trip %s %d/%d:%s", timed ? "rep" : "warm-up",
        timed ? rep - result_.bulk_warmup + 1 : rep + 1,
        timed ? result_.bulk_reps : result_.bulk_warmup, line);
  }
  if (result_.redis_ran) {
    const absl::string_view del[] = {"FLUSHALL"};
    KVQ_RETURN_IF_ERROR(redis_[0]->Call(del).status());
  }
  double best = 0.0;
  for (ThroughputRow& r : redis_rows) {
    Summarize(&r);
    if (r.tokens_per_s() > best) {
      best = r.tokens_per_s();
      result_.redis_best_id = r.id;
    }
  }
  std::vector<ThroughputRow> rows;
  for (ThroughputRow& r : kvq_rows) {
    Summarize(&r);
    rows.push_back(std::move(r));
  }
  for (ThroughputRow& r : result_.roundtrip) rows.push_back(std::move(r));  // kvq fp16.
  for (ThroughputRow& r : redis_rows) rows.push_back(std::move(r));
  result_.roundtrip = std::move(rows);
  return absl::OkStatus();
}

// The sequences of one scheme that the latency figures use, on the server
// and (for the kernel baseline) as local streams built the same way.
struct AttendSet {
  std::string scheme;  // Canonical.
  std::vector<std::string> ids;
  std::vector<HostTensor> q;                                    // [1, q_heads, head_dim] fp16.
  std::vector<std::vector<float>> q_floats;                     // The same queries.
  std::vector<std::vector<std::unique_ptr<KvStream>>> streams;  // [sequence][kv_head].
  std::vector<int> appended;  // Decode tokens appended per sequence.
};

absl::Status RpcBench::RunLatency() {
  const int T = tokens_;
  const int lat_warmup = result_.latency_warmup;
  const int reps = result_.latency_reps;
  const int max_batch =
      *std::max_element(options_.attend_batches.begin(), options_.attend_batches.end());
  const int max_decode =
      *std::max_element(options_.decode_batches.begin(), options_.decode_batches.end());
  const int sequences = std::max(max_batch, max_decode);

  {  // The transport's own round trip, 64 B each way.
    const std::string payload(kSmallEchoBytes, 'x');
    std::vector<double> us;
    for (int i = 0; i < lat_warmup + reps; ++i) {
      const auto t0 = Clock::now();
      KVQ_RETURN_IF_ERROR(raw_->Echo(payload, kSmallEchoBytes));
      if (i >= lat_warmup) us.push_back(1e6 * SecondsSince(t0));
    }
    result_.echo_small = Summarize(std::move(us));
    Log("raw Echo 64 B: p50 %.0f us, p99 %.0f us", result_.echo_small.p50_us,
        result_.echo_small.p99_us);
  }

  // The kernel baseline's streams live in a page pool like the server's
  // (huge pages included), so both sides read the same kind of memory.
  PagePoolOptions pool_options;
  pool_options.capacity_bytes = size_t{1} << 30;  // Reserved, touched as used.
  KVQ_ASSIGN_OR_RETURN(std::unique_ptr<PagePool> local_pool, PagePool::Create(pool_options));
  std::vector<AttendSet> sets;
  for (const char* scheme : kAttendSchemes) {
    AttendSet set;
    AppendOptions append_options;
    append_options.max_chunk_bytes = options_.chunk_bytes;
    for (int i = 0; i < sequences; ++i) {
      KVQ_ASSIGN_OR_RETURN(const SequenceInfo seq, Create(scheme));
      set.scheme = seq.scheme;
      const SequenceConfig config = Config(seq.scheme);
      // Sequence i holds prompt layer i % 30 as its layer 0.
      const HostTensor k = SliceKv(k_, ChunkRange{i % kLayers, 1, 0, T}, DType::kFloat16);
      const HostTensor v = SliceKv(v_, ChunkRange{i % kLayers, 1, 0, T}, DType::kFloat16);
      absl::StatusOr<AppendResult> appended =
          set.scheme == "fp16"
              ? client_->AppendPrompt(seq.sequence_id, k, v, append_options)
              : client_->AppendPromptQuantized(seq.sequence_id, config, k, v, append_options);
      KVQ_RETURN_IF_ERROR(Annotate(appended.status(), absl::StrCat("append ", scheme)));
      KVQ_ASSIGN_OR_RETURN(const StreamConfig stream_config, config.ToStreamConfig());
      std::vector<std::unique_ptr<KvStream>> heads;
      for (int h = 0; h < kKvHeads; ++h) {
        KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvStream> s,
                             KvStream::Create(stream_config, &CpuBackend(), local_pool.get()));
        const size_t off = static_cast<size_t>(h) * T * kHeadDim * 2;
        KVQ_RETURN_IF_ERROR(s->Append({k.bytes() + off, DType::kFloat16, T, kHeadDim, 0},
                                      {v.bytes() + off, DType::kFloat16, T, kHeadDim, 0}));
        heads.push_back(std::move(s));
      }
      set.streams.push_back(std::move(heads));
      set.ids.push_back(seq.sequence_id);
      set.q.push_back(RandomTensor({1, kQHeads, kHeadDim}, 1000 + i, 1.0f));
      set.q_floats.push_back(set.q.back().ToFloats());
      set.appended.push_back(0);
    }
    Log("attend: %d sequences of %d tokens stored as %s (server and local streams)", sequences, T,
        set.scheme);
    sets.push_back(std::move(set));
  }

  for (AttendSet& set : sets) {
    // Each batch over the whole context, then over its first kShortContext
    // keys: the same messages with a kernel of a few microseconds, so the
    // RPC path's own cost shows without a long kernel in between.
    // Each batch in both forms: a query tensor per item (Attend) and one
    // packed tensor for the batch (AttendBatch).
    for (const int context : {T, std::min(T, kShortContext)}) {
      for (int batch : options_.attend_batches) {
      for (const bool packed : {false, true}) {
          AttendFigures f;
          f.scheme = set.scheme;
          f.batch = batch;
          f.context = context;
          f.packed = packed;
          const int key_end = context == T ? 0 : context;  // 0: every stored token.
          std::vector<AttendQuery> items;
          std::vector<std::string> ids(set.ids.begin(), set.ids.begin() + batch);
          HostTensor packed_q{DType::kFloat16, {batch, kQHeads, kHeadDim}, ""};  // Rows below.
          v1::AttendRequest request;  // What the client sends, for its size.
          v1::AttendResponse response;
          for (int i = 0; i < batch; ++i) {
            items.push_back({set.ids[i], set.q[i], {}, 0, key_end});
            packed_q.data += set.q[i].data;
            v1::AttendItem* item = request.add_items();
            item->mutable_sequence()->set_namespace_(kNamespace);
            item->mutable_sequence()->set_sequence_id(set.ids[i]);
            item->set_key_end(key_end);
            if (packed) continue;
            ToProto(set.q[i], item->mutable_q());
            v1::AttendResult* r = response.add_results();
            ToProto(HostTensor::Zeros(DType::kFloat32, {1, kQHeads, kHeadDim}), r->mutable_out());
            ToProto(HostTensor::Zeros(DType::kFloat32, {1, kQHeads}), r->mutable_lse());
          }
          if (packed) {
            ToProto(packed_q, request.mutable_q());
            ToProto(HostTensor::Zeros(DType::kFloat32, {batch, kQHeads, kHeadDim}),
                    response.mutable_out());
            ToProto(HostTensor::Zeros(DType::kFloat32, {batch, kQHeads}), response.mutable_lse());
          }
          AttendBatchOptions batch_options;
          batch_options.key_end = key_end;
          f.request_bytes = static_cast<int64_t>(request.ByteSizeLong());
          f.response_bytes = static_cast<int64_t>(response.ByteSizeLong());

          // The kernel alone: the tasks the server builds for this request.
          std::vector<float> out(static_cast<size_t>(batch) * kQHeads * kHeadDim);
          std::vector<float> lse(static_cast<size_t>(batch) * kQHeads);
          std::vector<AttentionTask> tasks;
          const int group = kQHeads / kKvHeads;
          for (int i = 0; i < batch; ++i) {
            for (int h = 0; h < kKvHeads; ++h) {
              AttentionTask t;
              t.stream = set.streams[i][h].get();
              t.num_queries = 1;
              t.key_end = context;
              t.q = set.q_floats[i].data() + h * group * kHeadDim;
              t.q_stride = kQHeads * kHeadDim;
              t.out = out.data() + (static_cast<size_t>(i) * kQHeads + h * group) * kHeadDim;
              t.out_stride = kQHeads * kHeadDim;
              t.lse = lse.data() + static_cast<size_t>(i) * kQHeads + h * group;
              t.lse_stride = kQHeads;
              tasks.push_back(t);
            }
          }
          AttentionOptions attention;
          attention.group_size = group;
          const std::string payload(static_cast<size_t>(f.request_bytes), 'x');
          std::vector<double> kernel_us, rpc_us, echo_us;
          // The kernel alone, then the RPC and the raw round trip of the same
          // sizes call by call; in rounds, so that all three see the same
          // background load, and in blocks, so that the server's threads
          // winding down after an RPC do not land on a kernel call.
          auto kernel_block = [&](int calls, bool timed) -> absl::Status {
            for (int i = 0; i < calls; ++i) {
              const auto t0 = Clock::now();
              KVQ_RETURN_IF_ERROR(CpuBackend().Attend(tasks, attention));
              if (timed) kernel_us.push_back(1e6 * SecondsSince(t0));
            }
            return absl::OkStatus();
          };
          auto rpc_block = [&](int calls, bool timed) -> absl::Status {
            for (int i = 0; i < calls; ++i) {
              auto t0 = Clock::now();
              if (packed) {
                absl::StatusOr<AttendOutput> got =
                    client_->AttendBatch(0, ids, packed_q, batch_options);
                KVQ_RETURN_IF_ERROR(Annotate(got.status(), "AttendBatch"));
                if (got->out.shape.front() != batch) {
                  return absl::InternalError("AttendBatch returned a row count other than batch");
                }
              } else {
                absl::StatusOr<std::vector<AttendOutput>> got = client_->Attend(0, items);
                KVQ_RETURN_IF_ERROR(Annotate(got.status(), "Attend"));
                if (got->size() != static_cast<size_t>(batch)) {
                  return absl::InternalError("Attend returned a result count other than batch");
                }
              }
              const double t_rpc = 1e6 * SecondsSince(t0);
              t0 = Clock::now();
              KVQ_RETURN_IF_ERROR(raw_->Echo(payload, static_cast<int>(f.response_bytes)));
              const double t_echo = 1e6 * SecondsSince(t0);
              if (timed) {
                rpc_us.push_back(t_rpc);
                echo_us.push_back(t_echo);
              }
            }
            return absl::OkStatus();
          };
          KVQ_RETURN_IF_ERROR(kernel_block(lat_warmup, false));
          KVQ_RETURN_IF_ERROR(rpc_block(lat_warmup, false));
          const int rounds = std::min(reps, kLatencyRounds);
          for (int round = 0; round < rounds; ++round) {
            const int calls = reps / rounds + (round < reps % rounds ? 1 : 0);
            KVQ_RETURN_IF_ERROR(kernel_block(calls, true));
            KVQ_RETURN_IF_ERROR(rpc_block(calls, true));
          }
          f.kernel = Summarize(std::move(kernel_us));
          f.rpc = Summarize(std::move(rpc_us));
          f.echo = Summarize(std::move(echo_us));
          Log("attend %s batch %d context %d%s: p50 %.0f us (p99 %.0f), kernel %.0f us, raw echo "
              "%.0f us",
              f.scheme, batch, context, packed ? " packed" : "", f.rpc.p50_us, f.rpc.p99_us,
              f.kernel.p50_us, f.echo.p50_us);
          result_.attend.push_back(std::move(f));
        }
      }
    }

    // What attending locally would need first: this layer of the
    // sequences' KV, fetched to the client.
    LayerFetchFigures fetch;
    fetch.scheme = set.scheme;
    fetch.sequences = max_batch;
    fetch.context = T;
    fetch.fp16_bytes = static_cast<int64_t>(max_batch) * 2 * kKvHeads * T * kHeadDim * 2;
    FetchOptions layer0;
    layer0.layer_end = 1;
    for (int rep = 0; rep < result_.bulk_warmup + result_.bulk_reps; ++rep) {
      const auto t0 = Clock::now();
      for (int i = 0; i < max_batch; ++i) {
        KVQ_RETURN_IF_ERROR(
            Annotate(client_->FetchDequant(set.ids[i], layer0).status(), "FetchDequant layer 0"));
      }
      if (rep >= result_.bulk_warmup) fetch.seconds.push_back(SecondsSince(t0));
    }
    fetch.median_s = Median(fetch.seconds);
    Log("fetch of layer 0 of %d %s sequences: %.1f ms", max_batch, set.scheme,
        1e3 * fetch.median_s);
    result_.layer_fetch.push_back(std::move(fetch));
  }

  // Decode steps: unary AppendAttend and a DecodeStream step, interleaved so
  // both see the same (growing) context.
  for (auto it = sets.rbegin(); it != sets.rend(); ++it) {  // kivi2 first.
    AttendSet& set = *it;
    for (int batch : options_.decode_batches) {
      DecodeFigures f;
      f.scheme = set.scheme;
      f.batch = batch;
      f.context = T + set.appended[0];
      std::vector<AppendAttendItem> items;
      // The same step packed: row i of k, v and q is item i's.
      DecodeBatch packed{{set.ids.begin(), set.ids.begin() + batch},
                         {DType::kFloat16, {batch, kKvHeads, kHeadDim}, ""},
                         {DType::kFloat16, {batch, kKvHeads, kHeadDim}, ""},
                         {DType::kFloat16, {batch, kQHeads, kHeadDim}, ""}};
      for (int i = 0; i < batch; ++i) {
        items.push_back({set.ids[i], RandomTensor({kKvHeads, 1, kHeadDim}, 2000 + i, 1.0f),
                         RandomTensor({kKvHeads, 1, kHeadDim}, 3000 + i, 0.5f),
                         RandomTensor({1, kQHeads, kHeadDim}, 4000 + i, 1.0f)});
        packed.k.data += items.back().k.data;
        packed.v.data += items.back().v.data;
        packed.q.data += items.back().q.data;
      }
      KVQ_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSession> session, client_->OpenDecodeSession());
      std::vector<double> unary_us, stream_us, packed_us;
      for (int i = 0; i < lat_warmup + reps; ++i) {
        auto t0 = Clock::now();
        absl::StatusOr<std::vector<AttendOutput>> a = client_->AppendAttend(0, items);
        const double t_unary = 1e6 * SecondsSince(t0);
        KVQ_RETURN_IF_ERROR(Annotate(a.status(), "AppendAttend"));
        t0 = Clock::now();
        absl::StatusOr<std::vector<AttendOutput>> b = session->Step(0, items);
        const double t_stream = 1e6 * SecondsSince(t0);
        KVQ_RETURN_IF_ERROR(Annotate(b.status(), "DecodeStream"));
        t0 = Clock::now();
        absl::StatusOr<AttendOutput> c = session->StepBatch(0, packed);
        const double t_packed = 1e6 * SecondsSince(t0);
        KVQ_RETURN_IF_ERROR(Annotate(c.status(), "DecodeStream packed"));
        if (i >= lat_warmup) {
          unary_us.push_back(t_unary);
          stream_us.push_back(t_stream);
          packed_us.push_back(t_packed);
        }
      }
      KVQ_RETURN_IF_ERROR(Annotate(session->Close(), "DecodeStream close"));
      for (int i = 0; i < batch; ++i) set.appended[i] += 3 * (lat_warmup + reps);
      f.append_attend = Summarize(std::move(unary_us));
      f.decode_stream = Summarize(std::move(stream_us));
      f.decode_stream_packed = Summarize(std::move(packed_us));
      Log("decode %s batch %d: AppendAttend p50 %.0f us, DecodeStream p50 %.0f us", f.scheme, batch,
          f.append_attend.p50_us, f.decode_stream.p50_us);
      result_.decode.push_back(std::move(f));
    }
  }
  for (const AttendSet& set : sets) {
    for (const std::string& id : set.ids) KVQ_RETURN_IF_ERROR(client_->Release(id).status());
  }
  return absl::OkStatus();
}

absl::StatusOr<RpcBenchResult> RpcBench::Run() {
  const bool quick = options_.quick;
  tokens_ = options_.tokens > 0 ? options_.tokens : (quick ? kQuickTokens : kDefaultTokens);
  result_.bulk_reps =
      options_.bulk_reps > 0 ? options_.bulk_reps : (quick ? kQuickBulkReps : kDefaultBulkReps);
  result_.latency_reps = options_.latency_reps > 0
                             ? options_.latency_reps
                             : (quick ? kQuickLatencyReps : kDefaultLatencyReps);
  result_.bulk_warmup = quick ? std::min(options_.warmup, 1) : options_.warmup;
  result_.latency_warmup = 10 * result_.bulk_warmup;
  result_.warm_cores_ms = options_.warm_cores_ms;
  result_.roundtrip_warm_pass = options_.roundtrip_warm_pass;
  if (tokens_ < 256 || tokens_ > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens = ", tokens_, " must be in [256, 65536]"));
  }
  if (options_.warmup < 0) return absl::InvalidArgumentError("warmup must be >= 0");
  if (options_.chunk_bytes < (int64_t{64} << 10) || options_.chunk_bytes > (int64_t{32} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes = ", options_.chunk_bytes, " must be in [64 KiB, 32 MiB]"));
  }
  for (const std::vector<int>* batches : {&options_.attend_batches, &options_.decode_batches}) {
    if (batches->empty()) return absl::InvalidArgumentError("batch lists must not be empty");
    for (int b : *batches) {
      if (b < 1 || b > 1024) {
        return absl::InvalidArgumentError(absl::StrCat("batch ", b, " must be in [1, 1024]"));
      }
    }
  }
  result_.cpus = static_cast<int>(std::thread::hardware_concurrency());
  result_.load_start = LoadAverage();
  result_.layers = kLayers;
  result_.kv_heads = kKvHeads;
  result_.q_heads = kQHeads;
  result_.head_dim = kHeadDim;
  result_.tokens = tokens_;
  result_.chunk_bytes = options_.chunk_bytes;

  KVQ_RETURN_IF_ERROR(StartServers());
  k_ = MakeKv(kLayers, tokens_, 1, /*keys=*/true);
  v_ = MakeKv(kLayers, tokens_, 2, /*keys=*/false);
  result_.prompt_fp16_bytes = static_cast<int64_t>(k_.byte_size() + v_.byte_size());
  Log("prompt: %d tokens, %.1f MiB of fp16 K+V", tokens_, result_.prompt_fp16_bytes / 1048576.0);
  if (options_.run_bulk) KVQ_RETURN_IF_ERROR(RunBulk());
  if (options_.run_roundtrip) KVQ_RETURN_IF_ERROR(RunRoundTrip());
  if (options_.run_latency) {
    KVQ_RETURN_IF_ERROR(RunLatency());
    result_.latency_ran = true;
  }

  // Orderly shutdown; the destructors cover the error paths.
  client_.reset();
  raw_.reset();
  redis_.clear();
  for (std::unique_ptr<ChildProcess>* child : {&echo_server_, &kvq_server_, &redis_server_}) {
    if (*child == nullptr) continue;
    absl::Status st = (*child)->Stop();
    if (!st.ok()) Log("warning: %s", st.message());
    child->reset();
  }
  result_.load_end = LoadAverage();
  result_.total_seconds = SecondsSince(start_);
  return result_;
}

// ------------------------------------------------------------- output


// CPU milliseconds, "-" when unknown.
std::string CpuMs(double seconds) {
  return seconds >= 0 ? absl::StrFormat("%.0f ms", 1e3 * seconds) : std::string("-");
}

std::string Margin(double value, double target) {
  return absl::StrFormat("%+.0f%%", 100.0 * (value / target - 1.0));
}

const AttendFigures* FindAttend(const RpcBenchResult& r, absl::string_view scheme, int batch) {
  for (const AttendFigures& f : r.attend) {
    if (f.scheme == scheme && f.batch == batch && f.context == r.tokens && !f.packed) return &f;
  }
  return nullptr;
}

std::string LatencyJson(const LatencyStats& s) {
  return absl::StrCat("{\"p50_us\": ", JsonNumber(s.p50_us), ", \"p99_us\": ", JsonNumber(s.p99_us),
                      ", \"min_us\": ", JsonNumber(s.min_us), ", \"calls\": ", s.us.size(), "}");
}

std::string ThroughputJson(const ThroughputRow& r) {
  std::vector<std::string> s;
  for (double x : r.seconds) s.push_back(JsonNumber(x));
  return absl::StrCat(
      "{\"id\": ", JsonString(r.id), ", \"label\": ", JsonString(r.label),
      ", \"fp16_bytes\": ", r.fp16_bytes,
      ", \"wire_bytes\": ", r.wire_bytes > 0 ? r.wire_bytes : r.fp16_bytes,
      ", \"tokens\": ", r.tokens, ", \"median_s\": ", JsonNumber(r.median_s),
      ", \"min_s\": ", JsonNumber(r.min_s), ", \"fp16_gbps\": ", JsonNumber(r.fp16_gbps()),
      ", \"tokens_per_s\": ", JsonNumber(r.tokens_per_s()),
      ", \"client_cpu_s\": ", JsonNumber(r.client_cpu_s),
      ", \"server_cpu_s\": ", r.server_cpu_s >= 0 ? JsonNumber(r.server_cpu_s) : "null",
      ", \"store_s\": ", r.store_s >= 0 ? JsonNumber(r.store_s) : "null", ", \"seconds\": [",
      absl::StrJoin(s, ", "), "]}");
}

}  // namespace

const ThroughputRow* RpcBenchResult::FindBulk(const std::string& id) const {
  for (const ThroughputRow& r : bulk) {
    if (r.id == id) return &r;
  }
  return nullptr;
}

const ThroughputRow* RpcBenchResult::FindRoundTrip(const std::string& id) const {
  for (const ThroughputRow& r : roundtrip) {
    if (r.id == id) return &r;
  }
  return nullptr;
}

absl::StatusOr<RpcBenchResult> RunRpcBench(const RpcBenchOptions& options, std::ostream* progress) {
  RpcBench bench(options, progress);
  return bench.Run();
}

std::vector<CheckResult> CheckRpcBench(const RpcBenchResult& result) {
  std::vector<CheckResult> checks;
  auto pass_fail = [](bool ok) { return ok ? CheckOutcome::kPass : CheckOutcome::kFail; };

  auto ratio_check = [&](const std::string& name, const std::string& kvq_id,
                         const std::string& raw_id) {
    CheckResult c;
    c.name = absl::StrFormat("%s >= %.2f", name, kMinRpcRatioVsRaw);
    const ThroughputRow* kvq = result.FindBulk(kvq_id);
    const ThroughputRow* raw = result.FindBulk(raw_id);
    if (kvq == nullptr || raw == nullptr || raw->fp16_gbps() <= 0) {
      c.detail = "rows not run";
    } else {
      const double ratio = kvq->fp16_gbps() / raw->fp16_gbps();
      c.outcome = pass_fail(ratio >= kMinRpcRatioVsRaw);
      c.detail =
          absl::StrFormat("%.2f (%.2f vs %.2f GB/s), %s vs the target", ratio, kvq->fp16_gbps(),
                          raw->fp16_gbps(), Margin(ratio, kMinRpcRatioVsRaw));
    }
    checks.push_back(c);
  };
  ratio_check("kvq fp16 append / raw client stream", "kvq_append_fp16", "raw_sink_stream");
  ratio_check("kvq fp16 fetch / raw server stream", "kvq_fetch_fp16", "raw_source_stream");
  ratio_check("kvq fp16 fetch into reused k/v / raw server stream", "kvq_fetch_into_fp16",
              "raw_source_stream");

  const ThroughputRow* redis =
      result.redis_best_id.empty() ? nullptr : result.FindRoundTrip(result.redis_best_id);
  for (const auto& [scheme, target] :
       {std::pair<std::string, double>{"kivi4", kMinKivi4VsRedis}, {"kivi2", kMinKivi2VsRedis}}) {
    CheckResult c;
    c.name = absl::StrFormat("%s round trip >= %.1fx Redis fp16 (tokens/s)", scheme, target);
    const ThroughputRow* kvq = result.FindRoundTrip("kvq_roundtrip_" + scheme);
    if (redis == nullptr) {
      c.detail = result.redis_note.empty() ? "Redis not run" : result.redis_note;
    } else if (kvq == nullptr) {
      c.detail = "row not run";
    } else {
      const double x = kvq->tokens_per_s() / redis->tokens_per_s();
      c.outcome = pass_fail(x >= target);
      c.detail =
          absl::StrFormat("%.2fx (%.0f vs %.0f tokens/s, Redis: %s), %s vs the target", x,
                          kvq->tokens_per_s(), redis->tokens_per_s(), redis->id, Margin(x, target));
    }
    checks.push_back(c);
  }

  for (const LayerFetchFigures& fetch : result.layer_fetch) {
    CheckResult c;
    c.name = absl::StrFormat("%s Attend of %d sequences faster than fetching their layer",
                             fetch.scheme, fetch.sequences);
    const AttendFigures* a = FindAttend(result, fetch.scheme, fetch.sequences);
    if (a == nullptr || fetch.median_s <= 0) {
      c.detail = "rows not run";
    } else {
      const double fetch_us = 1e6 * fetch.median_s;
      c.outcome = pass_fail(a->rpc.p50_us < fetch_us);
      c.detail = absl::StrFormat("Attend p50 %.0f us vs FetchDequant %.0f us (%.1fx faster)",
                                 a->rpc.p50_us, fetch_us, fetch_us / a->rpc.p50_us);
    }
    checks.push_back(c);
  }

  if (!result.latency_ran) {
    CheckResult c;
    c.name = "Attend checks";
    c.detail = "section latency not run (--sections)";
    checks.push_back(c);
  }
  std::vector<int> batches;
  for (const AttendFigures& f : result.attend) {
    if (std::find(batches.begin(), batches.end(), f.batch) == batches.end()) {
      batches.push_back(f.batch);
    }
  }
  for (int batch : batches) {
    CheckResult c;
    c.name =
        absl::StrFormat("Attend p50 overhead over the kernel <= %.0fx raw round trip, batch %d",
                        kMaxAttendOverheadVsRtt, batch);
    // Judged on the packed form (AttendBatch), the call for a batch of one
    // query per sequence; the per-item form's figures follow for reference.
    std::vector<std::string> parts, reference;
    bool ok = true;
    bool any = false;
    for (const AttendFigures& f : result.attend) {
      if (f.batch != batch || f.context != result.tokens) continue;  // The target's context.
      if (!f.packed) {
        reference.push_back(absl::StrFormat(
            "%s %.2fx", f.scheme, f.echo.p50_us > 0 ? f.overhead_us() / f.echo.p50_us : 0.0));
        continue;
      }
      any = true;
      const double x = f.echo.p50_us > 0 ? f.overhead_us() / f.echo.p50_us : 0.0;
      if (f.overhead_us() < 0) {
        // The kernel alone took longer than the whole RPC: other work on the
        // machine hit the in-process timing, and nothing can be concluded.
        ok = false;
        parts.push_back(absl::StrFormat(
            "%s inconclusive: in-process kernel %.0f us > RPC %.0f us (busy machine; rerun)",
            f.scheme, f.kernel.p50_us, f.rpc.p50_us));
        continue;
      }
      ok = ok && x <= kMaxAttendOverheadVsRtt;
      parts.push_back(absl::StrFormat("%s %.0f us = %.2fx raw %.0f us (%s)", f.scheme,
                                      f.overhead_us(), x, f.echo.p50_us,
                                      Margin(x, kMaxAttendOverheadVsRtt)));
    }
    if (!any) continue;
    c.outcome = pass_fail(ok);
    c.detail = absl::StrCat("packed: ", absl::StrJoin(parts, "; "));
    if (!reference.empty()) {
      absl::StrAppend(&c.detail, " (per item: ", absl::StrJoin(reference, ", "), ")");
    }
    checks.push_back(c);
  }
  return checks;
}

std::string DecodeVerdict(const RpcBenchResult& result) {
  std::vector<std::string> parts;
  for (const DecodeFigures& f : result.decode) {
    const bool stream = f.decode_stream.p50_us < f.append_attend.p50_us;
    const double a = f.append_attend.p50_us, b = f.decode_stream.p50_us;
    parts.push_back(absl::StrFormat("%s batch %d: %s by %.0f us (%.0f%%)", f.scheme, f.batch,
                                    stream ? "DecodeStream" : "AppendAttend", std::fabs(a - b),
                                    100.0 * std::fabs(a - b) / std::max(a, b)));
  }
  return absl::StrJoin(parts, "; ");
}

std::string FormatRpcTable(const RpcBenchResult& r, const std::string& command) {
  std::string out;
  absl::StrAppendFormat(&out, "# %s\n", command);
  absl::StrAppendFormat(
      &out,
      "# kvq-server %s (backend %s) %s; RawEcho (bench/raw_echo.proto) in a child process; %s\n",
      r.kvq_version, r.kvq_backend,
      r.kvq_started ? "started by the bench on a loopback port" : "at " + r.kvq_target,
      r.redis_note);
  absl::StrAppendFormat(
      &out,
      "# SmolLM2-135M layout: %d layers, %d KV / %d query heads, head_dim %d; prompt %d tokens = "
      "%.1f MiB of fp16 K+V (%d B/token)\n",
      r.layers, r.kv_heads, r.q_heads, r.head_dim, r.tokens, r.prompt_fp16_bytes / 1048576.0,
      static_cast<int>(r.prompt_fp16_bytes / std::max(r.tokens, 1)));
  absl::StrAppendFormat(
      &out,
      "# %d CPUs (load average %.2f at the start, %.2f at the end), one client thread unless "
      "noted; transfers: median of %d reps after %d warm-ups%s%s; latencies: %d calls after %d "
      "warm-ups\n",
      r.cpus, r.load_start, r.load_end, r.bulk_reps, r.bulk_warmup,
      r.warm_cores_ms > 0
          ? absl::StrFormat(", each after %d ms with every core busy", r.warm_cores_ms)
          : std::string(),
      r.roundtrip_warm_pass ? ", each timed round trip right after an untimed one of its path"
                            : "",
      r.latency_reps, r.latency_warmup);

  if (!r.bulk.empty()) {
    absl::StrAppendFormat(&out, "\n## Bulk fp16 KV of the prompt (%.1f MiB each way)\n",
                          r.prompt_fp16_bytes / 1048576.0);
    absl::StrAppendFormat(&out, "%-52s %9s %7s %10s %8s %10s %10s\n", "path", "median ms", "GB/s",
                          "tokens/s", "kvq/raw", "client CPU", "server CPU");
    for (const ThroughputRow& row : r.bulk) {
      std::string ratio;
      const ThroughputRow* raw = row.id == "kvq_append_fp16"  ? r.FindBulk("raw_sink_stream")
                                 : row.id == "kvq_fetch_fp16" || row.id == "kvq_fetch_into_fp16"
                                     ? r.FindBulk("raw_source_stream")
                                                              : nullptr;
      if (raw != nullptr && raw->fp16_gbps() > 0) {
        ratio = absl::StrFormat("%.2f", row.fp16_gbps() / raw->fp16_gbps());
      }
      absl::StrAppendFormat(&out, "%-52s %9.1f %7.2f %10.0f %8s %10s %10s\n", row.label,
                            1e3 * row.median_s, row.fp16_gbps(), row.tokens_per_s(), ratio,
                            CpuMs(row.client_cpu_s), CpuMs(row.server_cpu_s));
    }
  }

  if (!r.roundtrip.empty()) {
    absl::StrAppendFormat(
        &out, "\n## Prompt KV round trip: append, then fetch back to fp16 in the client\n");
    absl::StrAppendFormat(&out, "%-60s %9s %9s %9s %10s %8s %10s %10s\n", "path", "wire MiB",
                          "median ms", "store ms", "tokens/s", "x Redis", "client CPU",
                          "server CPU");
    const ThroughputRow* best =
        r.redis_best_id.empty() ? nullptr : r.FindRoundTrip(r.redis_best_id);
    for (const ThroughputRow& row : r.roundtrip) {
      const std::string x =
          best ? absl::StrFormat("%.2f", row.tokens_per_s() / best->tokens_per_s()) : "";
      absl::StrAppendFormat(&out, "%-60s %9.1f %9.1f %9s %10.0f %8s %10s %10s%s\n", row.label,
                            (row.wire_bytes > 0 ? row.wire_bytes : row.fp16_bytes) / 1048576.0,
                            1e3 * row.median_s,
                            row.store_s >= 0 ? absl::StrFormat("%.1f", 1e3 * row.store_s) : "-",
                            row.tokens_per_s(), x, CpuMs(row.client_cpu_s),
                            CpuMs(row.server_cpu_s),
                            &row == best ? "  <- Redis baseline (fastest)" : "");
    }
    if (!r.redis_ran) absl::StrAppendFormat(&out, "(%s)\n", r.redis_note);
  }

  if (!r.attend.empty()) {
    absl::StrAppendFormat(&out, "\n## Attend: one layer, one query per sequence, context %d\n",
                          r.attend.front().context);
    absl::StrAppendFormat(&out, "%-15s %5s %5s %-6s %7s %7s %8s %8s %10s %9s %11s %7s %12s\n",
                          "scheme", "batch", "keys", "form", "req B", "resp B", "p50 us", "p99 us",
                          "kernel us", "overhead", "raw RTT us", "ovh/RTT", "layer-tok/s");
    for (const AttendFigures& f : r.attend) {
      absl::StrAppendFormat(
          &out, "%-15s %5d %5d %-6s %7d %7d %8.0f %8.0f %10.0f %9.0f %11.0f %7.2f %12.3g\n",
          f.scheme, f.batch, f.context, f.packed ? "packed" : "items", f.request_bytes,
          f.response_bytes, f.rpc.p50_us, f.rpc.p99_us, f.kernel.p50_us, f.overhead_us(),
          f.echo.p50_us, f.echo.p50_us > 0 ? f.overhead_us() / f.echo.p50_us : 0.0,
          f.layer_tokens_per_s());
    }
    absl::StrAppendFormat(&out,
                          "kernel = CpuBackend().Attend on local streams in this process; raw RTT "
                          "= RawEcho.Echo with the same request and reply sizes; form items = "
                          "Attend (a q tensor and a result per sequence), packed = AttendBatch "
                          "(one q, out and lse tensor for the batch); keys %d: the same calls "
                          "over the first %d keys (the RPC path without a long kernel; not a "
                          "target); raw Echo 64 B: p50 %.0f us, p99 %.0f us\n",
                          std::min(r.tokens, kShortContext), std::min(r.tokens, kShortContext),
                          r.echo_small.p50_us, r.echo_small.p99_us);
    for (const LayerFetchFigures& fetch : r.layer_fetch) {
      const AttendFigures* a = FindAttend(r, fetch.scheme, fetch.sequences);
      absl::StrAppendFormat(
          &out,
          "FetchDequant of that layer of the %d %s sequences (%.1f MiB fp16, one after the "
          "other): %.1f ms = %.3g layer-tok/s%s\n",
          fetch.sequences, fetch.scheme, fetch.fp16_bytes / 1048576.0, 1e3 * fetch.median_s,
          fetch.median_s > 0 ? fetch.sequences * static_cast<double>(fetch.context) / fetch.median_s
                             : 0.0,
          a ? absl::StrFormat("; Attend batch %d p50 %.2f ms is %.1fx faster", fetch.sequences,
                              a->rpc.p50_us / 1e3, 1e6 * fetch.median_s / a->rpc.p50_us)
            : std::string());
    }
  }

  if (!r.decode.empty()) {
    absl::StrAppendFormat(&out,
                          "\n## Decode step: append one token + attend, one layer (context %d+)\n",
                          r.decode.front().context);
    absl::StrAppendFormat(&out, "%-15s %5s %16s %16s %16s %16s %13s %11s %11s\n", "scheme",
                          "batch", "AppendAttend p50", "AppendAttend p99", "DecodeStream p50",
                          "DecodeStream p99", "winner", "packed p50", "packed p99");
    for (const DecodeFigures& f : r.decode) {
      absl::StrAppendFormat(
          &out, "%-15s %5d %16.0f %16.0f %16.0f %16.0f %13s %11.0f %11.0f\n", f.scheme, f.batch,
          f.append_attend.p50_us, f.append_attend.p99_us, f.decode_stream.p50_us,
          f.decode_stream.p99_us,
          f.decode_stream.p50_us < f.append_attend.p50_us ? "DecodeStream" : "AppendAttend",
          f.decode_stream_packed.p50_us, f.decode_stream_packed.p99_us);
    }
    absl::StrAppendFormat(&out,
                          "(microseconds; winner by p50: %s; packed = a DecodeStream step with "
                          "the batch's k, v and q as one tensor each, DecodeSession::StepBatch)\n",
                          DecodeVerdict(r));
  }
  absl::StrAppendFormat(&out, "\n# total %.1f s\n", r.total_seconds);
  return out;
}

std::string FormatRpcJson(const RpcBenchResult& r, const std::string& command,
                          const std::vector<CheckResult>* checks) {
  std::string out = "{\n";
  absl::StrAppend(&out, "  \"command\": ", JsonString(command), ",\n");
  absl::StrAppend(&out, "  \"kvq_server\": {\"target\": ", JsonString(r.kvq_target),
                  ", \"started\": ", r.kvq_started ? "true" : "false",
                  ", \"version\": ", JsonString(r.kvq_version),
                  ", \"backend\": ", JsonString(r.kvq_backend), "},\n");
  absl::StrAppend(&out, "  \"redis\": {\"ran\": ", r.redis_ran ? "true" : "false",
                  ", \"version\": ", JsonString(r.redis_version),
                  ", \"note\": ", JsonString(r.redis_note),
                  ", \"best\": ", JsonString(r.redis_best_id), "},\n");
  absl::StrAppend(&out, "  \"cpus\": ", r.cpus, ",\n");
  absl::StrAppend(&out, "  \"load_average\": {\"start\": ", JsonNumber(r.load_start),
                  ", \"end\": ", JsonNumber(r.load_end), "},\n");
  absl::StrAppend(&out, "  \"layout\": {\"layers\": ", r.layers, ", \"kv_heads\": ", r.kv_heads,
                  ", \"q_heads\": ", r.q_heads, ", \"head_dim\": ", r.head_dim, "},\n");
  absl::StrAppend(&out, "  \"tokens\": ", r.tokens, ",\n");
  absl::StrAppend(&out, "  \"prompt_fp16_bytes\": ", r.prompt_fp16_bytes, ",\n");
  absl::StrAppend(&out, "  \"chunk_bytes\": ", r.chunk_bytes, ",\n");
  absl::StrAppend(&out, "  \"bulk_reps\": ", r.bulk_reps, ", \"bulk_warmup\": ", r.bulk_warmup,
                  ", \"latency_reps\": ", r.latency_reps,
                  ", \"latency_warmup\": ", r.latency_warmup,
                  ", \"warm_cores_ms\": ", r.warm_cores_ms,
                  ", \"roundtrip_warm_pass\": ", r.roundtrip_warm_pass ? "true" : "false", ",\n");
  absl::StrAppend(&out, "  \"total_seconds\": ", JsonNumber(r.total_seconds), ",\n");
  auto rows = [&](const char* name, const std::vector<ThroughputRow>& list) {
    absl::StrAppend(&out, "  \"", name, "\": [\n");
    for (size_t i = 0; i < list.size(); ++i) {
      absl::StrAppend(&out, "    ", ThroughputJson(list[i]), i + 1 < list.size() ? ",\n" : "\n");
    }
    absl::StrAppend(&out, "  ],\n");
  };
  rows("bulk", r.bulk);
  rows("roundtrip", r.roundtrip);
  absl::StrAppend(&out, "  \"echo_64b\": ", LatencyJson(r.echo_small), ",\n");
  absl::StrAppend(&out, "  \"attend\": [\n");
  for (size_t i = 0; i < r.attend.size(); ++i) {
    const AttendFigures& f = r.attend[i];
    absl::StrAppend(&out, "    {\"scheme\": ", JsonString(f.scheme), ", \"batch\": ", f.batch,
                    ", \"context\": ", f.context, ", \"packed\": ", f.packed ? "true" : "false",
                    ", \"request_bytes\": ", f.request_bytes,
                    ", \"response_bytes\": ", f.response_bytes, ", \"rpc\": ", LatencyJson(f.rpc),
                    ", \"kernel\": ", LatencyJson(f.kernel),
                    ", \"raw_echo\": ", LatencyJson(f.echo),
                    ", \"overhead_us\": ", JsonNumber(f.overhead_us()),
                    ", \"layer_tokens_per_s\": ", JsonNumber(f.layer_tokens_per_s()), "}",
                    i + 1 < r.attend.size() ? ",\n" : "\n");
  }
  absl::StrAppend(&out, "  ],\n  \"layer_fetch\": [\n");
  for (size_t i = 0; i < r.layer_fetch.size(); ++i) {
    const LayerFetchFigures& f = r.layer_fetch[i];
    std::vector<std::string> s;
    for (double x : f.seconds) s.push_back(JsonNumber(x));
    absl::StrAppend(&out, "    {\"scheme\": ", JsonString(f.scheme),
                    ", \"sequences\": ", f.sequences, ", \"context\": ", f.context,
                    ", \"fp16_bytes\": ", f.fp16_bytes, ", \"median_s\": ", JsonNumber(f.median_s),
                    ", \"seconds\": [", absl::StrJoin(s, ", "), "]}",
                    i + 1 < r.layer_fetch.size() ? ",\n" : "\n");
  }
  absl::StrAppend(&out, "  ],\n  \"decode\": [\n");
  for (size_t i = 0; i < r.decode.size(); ++i) {
    const DecodeFigures& f = r.decode[i];
    absl::StrAppend(&out, "    {\"scheme\": ", JsonString(f.scheme), ", \"batch\": ", f.batch,
                    ", \"context\": ", f.context,
                    ", \"append_attend\": ", LatencyJson(f.append_attend),
                    ", \"decode_stream\": ", LatencyJson(f.decode_stream),
                    ", \"decode_stream_packed\": ", LatencyJson(f.decode_stream_packed),
                    ", \"winner\": ",
                    JsonString(f.decode_stream.p50_us < f.append_attend.p50_us ? "DecodeStream"
                                                                               : "AppendAttend"),
                    "}", i + 1 < r.decode.size() ? ",\n" : "\n");
  }
  absl::StrAppend(&out, "  ]");
  AppendChecksJson(checks, &out);
  absl::StrAppend(&out, "\n}\n");
  return out;
}

}  // namespace kvq
