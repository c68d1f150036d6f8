// Flags and entry points of `kvq-bench rpc` and `kvq-bench rpc-echo-server`
// (the shared --json, --quick, --check and --warmup live in kvq_bench.cc).
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "bench/raw_echo_server.h"
#include "bench/rpc_bench.h"

ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(bool, quick);
ABSL_DECLARE_FLAG(bool, check);
ABSL_DECLARE_FLAG(int, warmup);

ABSL_FLAG(std::string, server, "",
          "rpc: host:port of a running kvq-server to measure; empty starts one on a free "
          "loopback port.");
ABSL_FLAG(std::string, kvq_server, "",
          "rpc: the kvq-server binary to start (default: next to kvq-bench, i.e. "
          "<build>/service/kvq-server from <build>/bench).");
ABSL_FLAG(std::string, redis_server, "redis-server",
          "rpc: redis-server binary (path, or a name on PATH); empty skips the Redis baseline. "
          "Not found: Redis is skipped with a note.");
ABSL_FLAG(int, tokens, 0, "rpc: prompt and Attend context in tokens (0: 4096; --quick: 1024).");
ABSL_FLAG(int, bulk_reps, 0, "rpc: timed repetitions of each transfer (0: 7; --quick: 2).");
ABSL_FLAG(int, latency_reps, 0, "rpc: timed calls per latency figure (0: 300; --quick: 30).");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{1} << 20,
          "rpc: append chunk and raw stream message size in bytes.");
ABSL_FLAG(int64_t, capacity_bytes, int64_t{2} << 30,
          "rpc: page pool of the kvq-server the bench starts.");
ABSL_FLAG(std::vector<std::string>, attend_batches, (std::vector<std::string>{"1", "8", "32"}),
          "rpc: Attend batch sizes (sequences per call); the largest is also fetched.");
ABSL_FLAG(std::vector<std::string>, decode_batches, (std::vector<std::string>{"1", "8"}),
          "rpc: decode-step batch sizes (AppendAttend vs DecodeStream).");
ABSL_FLAG(std::vector<std::string>, sections,
          (std::vector<std::string>{"bulk", "roundtrip", "latency"}),
          "rpc: parts to run: bulk (fp16 append/fetch, raw streams), roundtrip (quantized round "
          "trips, Redis), latency (Attend, layer fetch, decode steps).");
ABSL_FLAG(int, redis_connections, 4, "rpc: connections of the multi-connection Redis variants.");
ABSL_FLAG(int, warm_cores_ms, 0,
          "rpc: before every bulk or round-trip transfer, keep every core busy this long (ms; 0: "
          "off). A diagnostic: an idle core of a virtual machine resumes slowly.");
ABSL_FLAG(bool, roundtrip_warm_pass, true,
          "rpc: time each round trip right after an untimed one of the same path (kvq scheme or "
          "Redis variant), so every path runs back to back with itself.");
ABSL_FLAG(std::string, echo_port_file, "",
          "rpc-echo-server (internal): where to write the port it listens on.");

namespace kvq {
namespace {

bool ParseInts(const std::vector<std::string>& words, const char* flag, std::vector<int>* out) {
  out->clear();
  for (const std::string& w : words) {
    int n = 0;
    if (!absl::SimpleAtoi(w, &n)) {
      std::cerr << "--" << flag << ": \"" << w << "\" is not an integer\n";
      return false;
    }
    out->push_back(n);
  }
  return true;
}

}  // namespace

int RpcMain(const std::string& command) {
  RpcBenchOptions options;
  options.server = absl::GetFlag(FLAGS_server);
  options.kvq_server_path = absl::GetFlag(FLAGS_kvq_server);
  options.redis_server = absl::GetFlag(FLAGS_redis_server);
  options.quick = absl::GetFlag(FLAGS_quick);
  options.tokens = absl::GetFlag(FLAGS_tokens);
  options.bulk_reps = absl::GetFlag(FLAGS_bulk_reps);
  options.latency_reps = absl::GetFlag(FLAGS_latency_reps);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.warm_cores_ms = absl::GetFlag(FLAGS_warm_cores_ms);
  options.roundtrip_warm_pass = absl::GetFlag(FLAGS_roundtrip_warm_pass);
  options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.capacity_bytes = absl::GetFlag(FLAGS_capacity_bytes);
  options.redis_connections = absl::GetFlag(FLAGS_redis_connections);
  if (!ParseInts(absl::GetFlag(FLAGS_attend_batches), "attend_batches", &options.attend_batches) ||
      !ParseInts(absl::GetFlag(FLAGS_decode_batches), "decode_batches", &options.decode_batches)) {
    return 2;
  }
  options.run_bulk = options.run_roundtrip = options.run_latency = false;
  for (const std::string& section : absl::GetFlag(FLAGS_sections)) {
    if (section == "bulk") {
      options.run_bulk = true;
    } else if (section == "roundtrip") {
      options.run_roundtrip = true;
    } else if (section == "latency") {
      options.run_latency = true;
    } else {
      std::cerr << "--sections: \"" << section << "\" is not bulk, roundtrip or latency\n";
      return 2;
    }
  }
  if (options.tokens < 0 || options.bulk_reps < 0 || options.latency_reps < 0 ||
      options.redis_connections < 1 || options.redis_connections > 64) {
    std::cerr << "--tokens, --bulk_reps and --latency_reps must be >= 0, --redis_connections in "
                 "[1, 64]\n";
    return 2;
  }
  if (options.warm_cores_ms < 0 || options.warm_cores_ms > 10000) {
    std::cerr << "--warm_cores_ms must be in [0, 10000], got " << options.warm_cores_ms << "\n";
    return 2;
  }

  absl::StatusOr<RpcBenchResult> result = RunRpcBench(options, &std::cerr);
  if (!result.ok()) {
    std::cerr << "kvq-bench rpc: " << result.status() << "\n";
    return 2;
  }
  const bool check = absl::GetFlag(FLAGS_check);
  std::vector<CheckResult> checks;
  if (check) checks = CheckRpcBench(*result);
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << FormatRpcJson(*result, command, check ? &checks : nullptr);
    if (check) std::cerr << FormatChecks(checks);
  } else {
    std::cout << FormatRpcTable(*result, command);
    if (check) std::cout << "\n" << FormatChecks(checks);
  }
  std::cout.flush();
  for (const CheckResult& c : checks) {
    if (c.outcome == CheckOutcome::kFail) return 1;
  }
  return 0;
}

int RpcEchoServerMain() { return RunRawEchoServer(absl::GetFlag(FLAGS_echo_port_file)); }

}  // namespace kvq
