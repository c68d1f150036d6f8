// The random workload of the history checker: client threads, each on its
// own channel to a real kvq-server, making random calls on a small shared
// pool of sequence ids and recording every call in a History.
#ifndef KVQ_TESTS_INTEGRATION_HISTORY_WORKLOAD_H_
#define KVQ_TESTS_INTEGRATION_HISTORY_WORKLOAD_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "tests/integration/history/history.h"

namespace kvq::history {

struct WorkloadOptions {
  std::string target;  // host:port of the server.
  std::string ns = "history";
  uint64_t seed = 1;
  int threads = 6;
  int sequences = 4;  // Ids s0 .. s{sequences-1}, shared by every thread.
  absl::Duration duration = absl::Seconds(5);
  absl::Duration deadline = absl::Seconds(5);  // Of every call.
  // Of the calls a client makes, this percentage are pauses of up to
  // max_pause instead (past a short lease, they let sequences expire).
  int pause_percent = 3;
  absl::Duration max_pause = absl::Milliseconds(20);
};

// Random calls from every thread until `duration` has passed; then
// releases every id of the pool and records the pool's used bytes before
// the first call and once they settle after the releases.
absl::Status RunWorkload(const WorkloadOptions& options, History* history);

}  // namespace kvq::history

#endif  // KVQ_TESTS_INTEGRATION_HISTORY_WORKLOAD_H_
