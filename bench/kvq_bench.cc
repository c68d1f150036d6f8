// kvq-bench: kvq's benchmark tool.
//
//   kvq-bench kernels [--json] [--quick] [--check] [--schemes=fp16,kivi2,...]
//                     [--contexts=2048,8192,32768] [--layouts=llama,smollm]
//                     [--backend=cpu] [--reps=N]
//
// `kernels` stores a synthetic KV set in every scheme and reports bits per
// element, attention error and decode-attention speed (bench/kernels_bench.h).
// --quick is the short demo (2k context, both layouts, 5 reps).
//
//   kvq-bench rpc [--json] [--quick] [--check] [--server=HOST:PORT]
//
// `rpc` measures kvq over gRPC against raw gRPC and Redis on this machine
// (bench/rpc_bench.h).
//
//   kvq-bench convert [--json] [--schemes=kivi4,kivi2] [--tokens=N] [--bulk_reps=N]
//
// `convert` times the client's side of rpc's quantized round trip in this
// process alone: quantizing the prompt, dequantizing raw pages
// (bench/convert_bench.h).
//
//   kvq-bench soak [--json] [--duration=10m] [--target=HOST:PORT]
//                  [--prefill_clients=2] [--decode_clients=2]
//
// `soak` drives prefill and decode clients against one kvq-server for the
// duration and checks for failed calls, growth and leaked pages
// (bench/soak_bench.h).
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "bench/checksum_bench.h"
#include "bench/convert_bench.h"
#include "bench/device_bench.h"
#include "bench/kernels_bench.h"
#include "bench/rpc_bench.h"
#include "bench/soak_bench.h"
#include "kernels/build_info.h"

ABSL_FLAG(bool, json, false, "Print one JSON document instead of the table.");
ABSL_FLAG(bool, quick, false,
          "Demo mode: context 2048 and 5 reps unless --contexts / --reps say otherwise.");
ABSL_FLAG(bool, check, false,
          "Print PASS/FAIL lines for the kernel figures; exit 1 if any fails.");
ABSL_FLAG(std::vector<std::string>, schemes, std::vector<std::string>{},
          "Comma-separated QuantSpec strings (default: the full list; fp16 always runs as the "
          "speed baseline).");
ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>{},
          "Comma-separated context lengths (default 2048,8192,32768; --quick: 2048).");
ABSL_FLAG(std::vector<std::string>, layouts, (std::vector<std::string>{"llama", "smollm"}),
          "Comma-separated attention layouts: llama (128d, 8 KV / 32 query heads), smollm "
          "(64d, 3 KV / 9 query heads).");
ABSL_FLAG(std::string, backend, "cpu", "Kernel backend: cpu or ref.");
ABSL_FLAG(int, reps, 0, "Timed decode calls per row (median reported); 0: 21, --quick: 5.");
ABSL_FLAG(int, warmup, 2, "Untimed decode calls before timing.");
ABSL_FLAG(int, bandwidth_mib, 1024, "Buffer of the read-bandwidth measurement, MiB.");
ABSL_FLAG(int, bandwidth_passes, 7, "Passes of the read-bandwidth measurement (median).");
ABSL_FLAG(int, evict_mib, 128,
          "Buffer read before every timed call so it starts with a cold cache, MiB (0: warm).");
ABSL_FLAG(int, threads, 0, "OpenMP threads (0: omp_get_max_threads()).");
ABSL_FLAG(int, page_tokens, 0,
          "kernels: tokens per page, a multiple of the scheme's block (0: max(32, G)).");

// Defined with `rpc`'s flags (rpc_main.cc); `convert` reads them too.
ABSL_DECLARE_FLAG(int, tokens);
ABSL_DECLARE_FLAG(int, bulk_reps);
ABSL_DECLARE_FLAG(int64_t, chunk_bytes);

namespace kvq {
namespace {

int ConvertMain(const std::string& command) {
  ConvertBenchOptions options;
  if (absl::GetFlag(FLAGS_tokens) > 0) options.tokens = absl::GetFlag(FLAGS_tokens);
  if (absl::GetFlag(FLAGS_bulk_reps) > 0) options.reps = absl::GetFlag(FLAGS_bulk_reps);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  if (!absl::GetFlag(FLAGS_schemes).empty()) options.schemes = absl::GetFlag(FLAGS_schemes);
  if (options.warmup < 0 || options.chunk_bytes < 1) {
    std::cerr << "--warmup must be >= 0 and --chunk_bytes >= 1\n";
    return 2;
  }
  absl::StatusOr<ConvertBenchResult> result = RunConvertBench(options, &std::cerr);
  if (!result.ok()) {
    std::cerr << "kvq-bench convert: " << result.status() << "\n";
    return 2;
  }
  std::cout << (absl::GetFlag(FLAGS_json) ? FormatConvertJson(*result, command)
                                          : FormatConvertTable(*result, command));
  return 0;
}

int KernelsMain(const std::string& command) {
  KernelsBenchOptions options;
  options.quick = absl::GetFlag(FLAGS_quick);
  options.schemes = absl::GetFlag(FLAGS_schemes);
  options.layouts = absl::GetFlag(FLAGS_layouts);
  for (const std::string& c : absl::GetFlag(FLAGS_contexts)) {
    int n = 0;
    if (!absl::SimpleAtoi(c, &n)) {
      std::cerr << "--contexts: \"" << c << "\" is not an integer\n";
      return 2;
    }
    options.contexts.push_back(n);
  }
  options.backend = absl::GetFlag(FLAGS_backend);
  options.reps = absl::GetFlag(FLAGS_reps);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  options.bandwidth_passes = absl::GetFlag(FLAGS_bandwidth_passes);
  const int mib = absl::GetFlag(FLAGS_bandwidth_mib);
  if (mib < 1 || mib > 65536 || options.reps < 0 || options.threads < 0 ||
      options.bandwidth_passes < 1) {
    std::cerr << "--bandwidth_mib must be in [1, 65536], --bandwidth_passes >= 1, --reps and "
                 "--threads >= 0\n";
    return 2;
  }
  options.bandwidth_bytes = static_cast<size_t>(mib) << 20;
  const int evict_mib = absl::GetFlag(FLAGS_evict_mib);
  if (evict_mib < 0 || evict_mib > 65536) {
    std::cerr << "--evict_mib must be in [0, 65536]\n";
    return 2;
  }
  options.evict_bytes = static_cast<size_t>(evict_mib) << 20;

  absl::StatusOr<KernelsBenchResult> result = RunKernelsBench(options, &std::cerr);
  if (!result.ok()) {
    std::cerr << "kvq-bench kernels: " << result.status() << "\n";
    return 2;
  }
  const bool check = absl::GetFlag(FLAGS_check);
  std::vector<CheckResult> checks;
  if (check) checks = CheckKernelsBench(*result);
  if (absl::GetFlag(FLAGS_json)) {
    std::cout << FormatKernelsJson(*result, command, check ? &checks : nullptr);
    if (check) std::cerr << FormatChecks(checks);
  } else {
    std::cout << FormatKernelsTable(*result, command);
    if (check) std::cout << "\n" << FormatChecks(checks);
  }
  std::cout.flush();
  for (const CheckResult& c : checks) {
    if (c.outcome == CheckOutcome::kFail) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace kvq

int main(int argc, char** argv) {
  if (kvq::PrintVersionIfAsked(argc, argv, "kvq-bench")) return 0;
  absl::SetProgramUsageMessage(
      "kvq-bench <subcommand> [flags]\n"
      "  kernels   bits/element, attention error and decode speed of every scheme\n"
      "            e.g. kvq-bench kernels --quick\n"
      "  rpc       kvq over gRPC vs raw gRPC and Redis: transfer, round trip, Attend, decode\n"
      "            e.g. kvq-bench rpc --quick\n"
      "  convert   the client's quantize / dequantize of rpc's round trip, alone\n"
      "            e.g. kvq-bench convert\n"
      "  checksums Attend and FetchDequant with page checksums verified vs not\n"
      "            e.g. kvq-bench checksums --tokens=32768\n"
      "  device    the CUDA kernels at 32k x 64 sequences vs the device's copy bandwidth\n"
      "            e.g. kvq-bench device --json_out=bench.json\n"
      "  soak      bounded load: prefill + decode clients, errors, p50/p99, RSS and pool growth\n"
      "            e.g. kvq-bench soak --duration=2m");
  std::vector<std::string> words = {"kvq-bench"};
  for (int i = 1; i < argc; ++i) words.push_back(argv[i]);
  const std::string command = absl::StrJoin(words, " ");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  // As in kvq-server: no lock-order graph in a measuring process (Debian's
  // Abseil keeps one; the client's page allocator locks once per page).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (args.size() != 2) {
    std::cerr << "usage: kvq-bench kernels|rpc|convert|checksums|device|soak [flags]   (see --help)\n";
    return 2;
  }
  const std::string sub = args[1];
  if (sub == "kernels") return kvq::KernelsMain(command);
  if (sub == "rpc") return kvq::RpcMain(command);
  if (sub == "convert") return kvq::ConvertMain(command);
  if (sub == "checksums") return kvq::ChecksumsMain(command);
  if (sub == "soak") return kvq::SoakMain(command);
  if (sub == "device") return kvq::DeviceMain(command);
  if (sub == "rpc-echo-server") return kvq::RpcEchoServerMain();  // Started by `rpc`.
  std::cerr << "kvq-bench: unknown subcommand \"" << sub
            << "\"; expected: kernels, rpc, convert, checksums, device, soak\n";
  return 2;
}
