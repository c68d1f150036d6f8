// `kvq-bench rpc`: kvq over gRPC against the ceilings it should be read
// against, all measured in one run on this machine:
//   - a real kvq-server (started from the build tree, or --server),
//   - RawEcho (bench/raw_echo.proto), gRPC with nothing behind it, in a
//     child process built like kvq-server,
//   - redis-server without persistence, through a minimal RESP client.
// For the SmolLM2-135M KV layout (30 layers, 3 KV / 9 query heads,
// head_dim 64) it measures bulk append/fetch of a prompt's fp16 KV against
// raw gRPC streams, a prompt's KV round trip (kivi4/kivi2 with quantized
// bytes on the wire against Redis SET+GET of the fp16 bytes), Attend
// latency against the in-process kernel, the raw round trip and a fetch of
// the same KV, and AppendAttend against DecodeStream for a decode step.
#ifndef KVQ_BENCH_RPC_BENCH_H_
#define KVQ_BENCH_RPC_BENCH_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/kernels_bench.h"

namespace kvq {

struct RpcBenchOptions {
  std::string server;           // host:port of a running kvq-server; "": start one.
  std::string kvq_server_path;  // "": kvq-server next to kvq-bench (build tree or install).
  std::string redis_server = "redis-server";  // Path or name on PATH; "": skip Redis.
  bool quick = false;
  int tokens = 0;                          // Prompt and Attend context; 0: 4096 (quick: 1024).
  int bulk_reps = 0;                       // Timed repetitions of bulk transfers; 0: 7 (quick: 2).
  int latency_reps = 0;                    // Timed calls per latency figure; 0: 300 (quick: 30).
  int warmup = 2;                          // Untimed bulk repetitions; latency figures get 10x.
  int64_t chunk_bytes = int64_t{1} << 20;  // Append chunks, raw stream messages.
  int64_t capacity_bytes = int64_t{2} << 30;  // Page pool of the kvq-server started.
  std::vector<int> attend_batches = {1, 8, 32};
  std::vector<int> decode_batches = {1, 8};
  int redis_connections = 4;  // Of the multi-connection Redis variants.
  // Before every transfer (bulk and round trip, timed or not) every core is
  // kept busy this long (0: off, the default). A diagnostic: an idle core of
  // a virtual machine resumes slowly, and the transfer after an idle
  // stretch pays for it; the busy spell is not neutral either (BENCHMARKS.md
  // section 5).
  int warm_cores_ms = 0;
  // Each timed round trip right after an untimed one of the same path (kvq
  // scheme or Redis variant), so that every path is timed back to back
  // with itself, as a stream of round trips runs (BENCHMARKS.md section 5).
  bool roundtrip_warm_pass = true;
  // Which parts run (a profile of one part needs only that part).
  bool run_bulk = true;       // Bulk fp16 append / fetch and the raw streams.
  bool run_roundtrip = true;  // Quantized round trips and Redis.
  bool run_latency = true;    // Attend, the layer fetch, decode steps.
};

// One path moving a prompt's worth of KV, timed over repetitions.
struct ThroughputRow {
  std::string id;               // Stable name for JSON and checks, e.g. "kvq_append_fp16".
  std::string label;            // What ran, for the table.
  int64_t fp16_bytes = 0;       // fp16-equivalent KV bytes moved (both ways for a round trip).
  int64_t wire_bytes = 0;       // Payload on the wire (0 when it is fp16_bytes).
  int64_t tokens = 0;           // Prompt tokens (all layers) moved.
  std::vector<double> seconds;  // One per timed repetition.
  double median_s = 0.0;
  double min_s = 0.0;
  // CPU seconds per repetition (medians) of the bench process (client) and
  // of the server process that served it (-1: not known, e.g. --server).
  std::vector<double> client_cpu, server_cpu;
  double client_cpu_s = 0.0;
  double server_cpu_s = -1.0;
  // Round trips: the seconds of the first half (append, or SET), median
  // (-1: not split).
  std::vector<double> store_seconds;
  double store_s = -1.0;
  double fp16_gbps() const { return median_s > 0 ? fp16_bytes / median_s / 1e9 : 0.0; }
  double tokens_per_s() const { return median_s > 0 ? tokens / median_s : 0.0; }
};

struct LatencyStats {
  std::vector<double> us;  // One per timed call.
  double p50_us = 0.0;
  double p99_us = 0.0;
  double min_us = 0.0;
};

// Attend of `batch` sequences (one layer, one query each) at `context`.
struct AttendFigures {
  std::string scheme;
  int batch = 0;
  int context = 0;
  bool packed = false;         // KvqClient::AttendBatch (one q tensor) instead of Attend.
  int64_t request_bytes = 0;   // Serialized AttendRequest.
  int64_t response_bytes = 0;  // Serialized AttendResponse.
  LatencyStats rpc;            // KvqClient::Attend or AttendBatch.
  LatencyStats kernel;         // CpuBackend().Attend on local KvStreams, same tasks.
  LatencyStats echo;           // RawEcho.Echo with the same request and reply sizes.
  double overhead_us() const { return rpc.p50_us - kernel.p50_us; }
  double layer_tokens_per_s() const {
    return rpc.p50_us > 0 ? 1e6 * batch * static_cast<double>(context) / rpc.p50_us : 0.0;
  }
};

// FetchDequant (fp16 out) of one layer of `sequences` sequences, one after
// the other: what a client would pull to attend locally.
struct LayerFetchFigures {
  std::string scheme;
  int sequences = 0;
  int context = 0;
  int64_t fp16_bytes = 0;
  std::vector<double> seconds;
  double median_s = 0.0;
};

// One decode step (append one token + attend, one layer) of `batch`
// sequences: unary AppendAttend against a DecodeStream step.
struct DecodeFigures {
  std::string scheme;
  int batch = 0;
  int context = 0;  // At the first step.
  LatencyStats append_attend;
  LatencyStats decode_stream;
  LatencyStats decode_stream_packed;  // DecodeSession::StepBatch, one tensor each for k, v, q.
};

struct RpcBenchResult {
  std::string kvq_target;    // host:port measured.
  bool kvq_started = false;  // Started by the bench (else --server).
  std::string kvq_version;
  std::string kvq_backend;
  bool redis_ran = false;
  std::string redis_version;
  std::string redis_note;  // Why Redis was skipped, or how it ran.
  int cpus = 0;
  // 1-minute load average of the machine when the run started and ended:
  // other work on the machine shows up in every figure.
  double load_start = 0.0, load_end = 0.0;
  int layers = 0, kv_heads = 0, q_heads = 0, head_dim = 0;
  int tokens = 0;
  int bulk_reps = 0, latency_reps = 0, bulk_warmup = 0, latency_warmup = 0;
  int warm_cores_ms = 0;  // Every core busy this long before each transfer.
  bool roundtrip_warm_pass = false;  // RpcBenchOptions::roundtrip_warm_pass.
  int64_t chunk_bytes = 0;
  int64_t prompt_fp16_bytes = 0;         // K + V of the prompt, all layers.
  std::vector<ThroughputRow> bulk;       // kvq fp16 append/fetch and the raw streams.
  std::vector<ThroughputRow> roundtrip;  // kvq kivi4/kivi2/fp16 and the Redis variants.
  std::string redis_best_id;             // The fastest Redis variant ("" without Redis).
  LatencyStats echo_small;               // RawEcho.Echo, 64 B each way.
  std::vector<AttendFigures> attend;
  std::vector<LayerFetchFigures> layer_fetch;
  std::vector<DecodeFigures> decode;
  bool latency_ran = false;
  double total_seconds = 0.0;

  const ThroughputRow* FindBulk(const std::string& id) const;
  const ThroughputRow* FindRoundTrip(const std::string& id) const;
};

// Targets of --check.
inline constexpr double kMinRpcRatioVsRaw = 0.85;  // kvq GB/s / raw GB/s.
inline constexpr double kMinKivi4VsRedis = 1.5;    // Round-trip tokens/s.
inline constexpr double kMinKivi2VsRedis = 2.5;
inline constexpr double kMaxAttendOverheadVsRtt = 2.0;  // (RPC - kernel) / raw round trip.

// Starts the servers, measures, stops them (also on error). Progress lines
// go to `progress` (may be null).
absl::StatusOr<RpcBenchResult> RunRpcBench(const RpcBenchOptions& options, std::ostream* progress);

std::vector<CheckResult> CheckRpcBench(const RpcBenchResult& result);
// Which decode path has the lower p50 at each batch, in words.
std::string DecodeVerdict(const RpcBenchResult& result);

std::string FormatRpcTable(const RpcBenchResult& result, const std::string& command);
std::string FormatRpcJson(const RpcBenchResult& result, const std::string& command,
                          const std::vector<CheckResult>* checks);

// The `rpc` and `rpc-echo-server` subcommands (flags in bench/rpc_main.cc).
int RpcMain(const std::string& command);
int RpcEchoServerMain();

}  // namespace kvq

#endif  // KVQ_BENCH_RPC_BENCH_H_
