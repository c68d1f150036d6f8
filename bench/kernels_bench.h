// `kvq-bench kernels`: stores a synthetic KV set (synthetic/synthetic_kv.h) in
// every scheme and measures, per (layout, context, scheme), the bits per
// element as allocated, the fused decode-attention error against fp32
// attention over the original keys and values, and the decode-attention time
// of one layer against fp16 and against this machine's read bandwidth.
#ifndef KVQ_BENCH_KERNELS_BENCH_H_
#define KVQ_BENCH_KERNELS_BENCH_H_

#include <cstddef>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/rope.h"

namespace kvq {

// The attention shape of one model: one layer's KV heads and query heads.
struct KvLayout {
  std::string name;
  int head_dim = 0;
  int kv_heads = 0;
  int q_heads = 0;
  RopeConfig rope;
  int group_size() const { return q_heads / kv_heads; }
};

// "llama" (Llama-3-8B: 128d, 8 KV / 32 query heads, theta 500000) and
// "smollm" (SmolLM2-135M: 64d, 3 KV / 9 query heads, theta 100000).
const std::vector<KvLayout>& KvLayouts();
absl::StatusOr<KvLayout> KvLayoutByName(absl::string_view name);

// The default scheme list (fp16 first: it is the speed baseline).
const std::vector<std::string>& DefaultKernelSchemes();

struct KernelsBenchOptions {
  std::vector<std::string> schemes;  // Empty: DefaultKernelSchemes().
  std::vector<int> contexts;         // Empty: 2048, 8192, 32768 (quick: 2048).
  std::vector<std::string> layouts = {"llama", "smollm"};
  std::string backend = "cpu";
  int reps = 0;  // Timed calls per row; 0: 21 (quick: 5).
  int warmup = 2;
  bool quick = false;
  size_t bandwidth_bytes = size_t{1} << 30;
  // Read before every timed call so it starts with a cold cache (0: warm).
  size_t evict_bytes = size_t{128} << 20;
  int bandwidth_passes = 7;
  int threads = 0;  // 0: omp_get_max_threads().
  int page_tokens = 0;  // Tokens per page (StreamConfig); 0: the layout's default.
};

// Statistics of the fp32 reference attention of one (layout, context):
// shows the data is neither uniform nor one-hot. Means over query heads.
struct AttentionProfile {
  std::string layout;
  int context = 0;
  double sink_share = 0.0;        // Weight on the sink tokens.
  double effective_tokens = 0.0;  // 1 / sum(p^2).
  double top_weight = 0.0;        // Largest single weight.
  double generate_seconds = 0.0;
};

struct KernelsBenchRow {
  std::string layout;
  int context = 0;
  std::string scheme;     // As given.
  std::string canonical;  // QuantSpec::ToString().
  size_t kv_bytes = 0;    // Allocated by the layer's streams (counted).
  size_t analytic_bytes = 0;
  double bits_per_element = 0.0;
  double bits_analytic = 0.0;
  double bits_gap = 0.0;            // |measured - analytic| / analytic.
  double attn_rel_error = 0.0;      // Mean over query heads.
  double attn_rel_error_max = 0.0;  // Worst query head.
  double decode_us = 0.0;           // Median.
  double decode_us_min = 0.0;
  double speedup_vs_fp16 = 0.0;
  double bw_fraction = 0.0;
  double append_seconds = 0.0;     // Storing the context, every KV head, one thread.
};

struct KernelsBenchResult {
  std::string backend;       // As requested.
  std::string backend_impl;  // KernelBackend::name() of what ran.
  std::string simd_target;   // The cpu kernels' Highway target (KVQ_SIMD_TARGET pins one).
  int threads = 0;
  int reps = 0;
  double read_bandwidth = 0.0;  // Bytes/s, median.
  std::vector<double> read_bandwidth_passes;
  size_t bandwidth_bytes = 0;
  // Seconds per 512-bit vpdpbusd per thread with every thread issuing them
  // (median; 0 without AVX-512 VNNI): what the kivi checks' floor uses.
  double dot_seconds = 0.0;
  std::vector<double> dot_passes;
  size_t evict_bytes = 0;  // 0: timed calls ran with a warm cache.
  std::vector<AttentionProfile> profiles;
  std::vector<KernelsBenchRow> rows;
  double total_seconds = 0.0;
  // 1-minute load average at the start and the end (-1 where unknown): on a
  // shared machine, other work slows the timed calls and the bandwidth pass.
  double load_start = -1.0;
  double load_end = -1.0;
};

// Runs the benchmark; progress lines go to `progress` (may be null).
absl::StatusOr<KernelsBenchResult> RunKernelsBench(const KernelsBenchOptions& options,
                                                   std::ostream* progress);

enum class CheckOutcome { kPass, kFail, kSkip };
struct CheckResult {
  std::string name;
  CheckOutcome outcome = CheckOutcome::kSkip;
  std::string detail;
};

// Peer figures recorded in docs (docs/KERNELS.md, section 3: ggml CPU
// flash-attention decode on the development machine, 2 threads, llama layout
// 128d 32q/8kv, 32768 tokens, cold cache, lower end of the measured range),
// not measured by this tool. Used by the "<= 1/10 of ggml" check.
inline constexpr double kPeerGgmlQ8_0DecodeMs = 160.0;  // 8.5 bits/element.
inline constexpr double kPeerGgmlQ4_0DecodeMs = 153.0;  // 4.5 bits/element.

// The figures the issue demands, from one run's rows.
std::vector<CheckResult> CheckKernelsBench(const KernelsBenchResult& result);

std::string FormatKernelsTable(const KernelsBenchResult& result, const std::string& command);
std::string FormatKernelsJson(const KernelsBenchResult& result, const std::string& command,
                              const std::vector<CheckResult>* checks);
std::string FormatChecks(const std::vector<CheckResult>& checks);

// Report helpers shared by the bench subcommands.
const char* OutcomeName(CheckOutcome o);
// A JSON string literal (quotes and escapes included).
std::string JsonString(absl::string_view s);
// A JSON number, or null when not finite.
std::string JsonNumber(double x);
// Appends `,\n  "checks": [...]` to a JSON document being built (nothing
// when `checks` is null).
void AppendChecksJson(const std::vector<CheckResult>* checks, std::string* out);

}  // namespace kvq

#endif  // KVQ_BENCH_KERNELS_BENCH_H_
