// Flags and entry point of `kvq-bench soak` (bench/soak_bench.h); --json
// lives in kvq_bench.cc and --kvq_server in rpc_main.cc.
#include <iostream>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "bench/soak_bench.h"

ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(std::string, kvq_server);

ABSL_FLAG(std::string, target, "",
          "soak: host:port of a running, otherwise idle kvq-server (loopback); empty starts one "
          "on a free loopback port.");
ABSL_FLAG(absl::Duration, duration, absl::Minutes(10),
          "soak: how long the clients run, e.g. 10m, 2m, 90s.");
ABSL_FLAG(int, prefill_clients, 2, "soak: prefill client threads.");
ABSL_FLAG(int, decode_clients, 2, "soak: decode client threads.");
ABSL_FLAG(int, pool_mib, 256, "soak: page pool of the kvq-server the soak starts, MiB.");
ABSL_FLAG(int, seed, 1, "soak: seed of the prompts, lengths and decode tensors.");
ABSL_FLAG(int64_t, max_calls, 20'000'000, "soak: stop after this many calls in all.");
ABSL_FLAG(int, max_errors, 100, "soak: stop once more calls than this failed.");

namespace kvq {

int SoakMain(const std::string& command) {
  SoakOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.kvq_server_path = absl::GetFlag(FLAGS_kvq_server);
  options.duration = absl::GetFlag(FLAGS_duration);
  options.prefill_clients = absl::GetFlag(FLAGS_prefill_clients);
  options.decode_clients = absl::GetFlag(FLAGS_decode_clients);
  options.seed = static_cast<uint32_t>(absl::GetFlag(FLAGS_seed));
  options.max_calls = absl::GetFlag(FLAGS_max_calls);
  options.max_errors = absl::GetFlag(FLAGS_max_errors);
  const int pool_mib = absl::GetFlag(FLAGS_pool_mib);
  if (pool_mib < 16 || pool_mib > 65536 || options.prefill_clients > 64 ||
      options.decode_clients > 64 || options.max_calls < 1 || options.max_errors < 0) {
    std::cerr << "--pool_mib must be in [16, 65536], --prefill_clients and --decode_clients at "
                 "most 64, --max_calls >= 1, --max_errors >= 0\n";
    return 2;
  }
  options.capacity_bytes = int64_t{pool_mib} << 20;
  absl::StatusOr<SoakResult> result = RunSoak(options, &std::cerr);
  if (!result.ok()) {
    std::cerr << "kvq-bench soak: " << result.status() << "\n";
    return 2;
  }
  std::cout << (absl::GetFlag(FLAGS_json) ? FormatSoakJson(*result, command)
                                          : FormatSoakTable(*result, command));
  std::cout.flush();
  return result->ok() ? 0 : 1;
}

}  // namespace kvq
