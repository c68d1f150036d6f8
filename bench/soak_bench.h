// `kvq-bench soak`: a bounded load run against one kvq-server. Prefill
// clients create sequences in a mix of schemes, append prompts (quantized by
// the client library or dense, sometimes reusing a stored prefix), fetch a
// layer back, sometimes fork, and release; decode clients take the live
// sequences the prefill clients hand over and run decode steps
// (DecodeStream, unary and packed AppendAttend, Attend) before releasing
// them. Every client calls as fast as it can for the whole run. A sampler
// records the server's RSS and the pool's used bytes and slabs every
// interval.
//
// The run passes when no call failed (see the header of soak_bench.cc for
// why no error code is expected), RSS and the pool's use stayed flat after
// the warm-up (EvaluateFlat) and the pool came back to its starting figure
// once every client had released its sequences.
#ifndef KVQ_BENCH_SOAK_BENCH_H_
#define KVQ_BENCH_SOAK_BENCH_H_

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvq {

struct SoakOptions {
  std::string target;           // host:port of a running server; empty starts one.
  std::string kvq_server_path;  // Empty: next to kvq-bench.
  absl::Duration duration = absl::Minutes(10);
  int prefill_clients = 2;
  int decode_clients = 2;
  // Pool of the server the soak starts: about ten times the largest working
  // set the clients can hold at once (soak_bench.cc), so a full pool is a
  // failure, not load.
  int64_t capacity_bytes = int64_t{256} << 20;
  absl::Duration sample_interval = absl::Seconds(1);
  absl::Duration call_deadline = absl::Seconds(30);
  uint32_t seed = 1;
  // Bounds besides the duration: calls in all (the run stops early when
  // reached) and failed calls (it stops at the first one past this).
  int64_t max_calls = 20'000'000;
  int max_errors = 100;
  // Flat after warm-up: the last third's maximum may exceed the middle
  // third's by at most max(fraction * middle max, slack).
  double rss_tolerance_fraction = 0.10;
  int64_t rss_tolerance_bytes = int64_t{32} << 20;
  double pool_tolerance_fraction = 0.25;
  int64_t pool_tolerance_bytes = int64_t{8} << 20;
  int pool_tolerance_slabs = 8;
};

// One sampler reading. -1: not known (RSS of a server the soak did not
// start; a Stats call that failed).
struct SoakSample {
  double t_s = 0;
  int64_t server_rss_bytes = -1;
  int64_t client_rss_bytes = -1;
  int64_t used_bytes = -1;
  int64_t slabs_used = -1;  // StatsResponse.pages_used: slabs holding live pages.
  int64_t sequences = -1;
};

struct LatencySummary {
  std::string op;
  int64_t count = 0;
  double p50_ms = 0, p99_ms = 0, max_ms = 0;
};

// Latencies of one operation in milliseconds; sorts `ms`.
LatencySummary Summarize(std::string op, std::vector<float>* ms);

struct FlatCheck {
  std::string figure;  // "server_rss_bytes", "used_bytes", "slabs_used".
  double middle_max = 0;
  double last_max = 0;
  double limit = 0;  // last_max must be <= limit.
  bool pass = false;
};

// Samples split by time into thirds of `duration_s`: the first is warm-up;
// the maximum of the last third must stay within tolerance of the middle
// third's. Figures with no known value in either third are skipped.
std::vector<FlatCheck> EvaluateFlat(const std::vector<SoakSample>& samples, double duration_s,
                                    const SoakOptions& options);

struct SoakResult {
  std::string target;
  bool started_server = false;
  std::string server_version, server_backend;
  double duration_s = 0;  // As run.
  int prefill_clients = 0, decode_clients = 0;
  std::vector<std::string> schemes;
  int64_t capacity_bytes = 0;

  std::vector<LatencySummary> ops;
  std::map<std::string, int64_t> errors;    // Code name -> count (all unexpected).
  std::vector<std::string> error_examples;  // The first few, with the operation.
  int64_t sequences_created = 0, prefix_tokens_reused = 0, prefix_hits = 0, forks = 0,
          decode_tokens = 0, handed_over = 0;
  std::string stopped_early;  // Why the run ended before its duration, if it did.

  std::vector<SoakSample> samples;
  SoakSample start, end;  // Before the clients started; after all released.
  bool returned_to_start = false;
  std::vector<FlatCheck> flat;

  int64_t total_errors() const;
  bool ok() const;
};

absl::StatusOr<SoakResult> RunSoak(const SoakOptions& options, std::ostream* progress);

std::string FormatSoakTable(const SoakResult& result, const std::string& command);
std::string FormatSoakJson(const SoakResult& result, const std::string& command);

// `kvq-bench soak` with its flags (soak_main.cc): exit 0 when the run
// passed, 1 when it failed, 2 when it could not run.
int SoakMain(const std::string& command);

}  // namespace kvq

#endif  // KVQ_BENCH_SOAK_BENCH_H_
