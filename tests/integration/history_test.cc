// The randomized history checker against the real kvq-server: client
// threads make random calls on a small shared pool of sequences (streamed
// Appends, some cancelled or stalled past their deadline; AppendAttend;
// DecodeStream steps; Fork; Release; FetchDequant; Attend; Stats), every
// call is recorded, and the checker (history/checker.h) must find no
// anomaly. Rounds alternate the server's faults: none, a pool small enough
// to fill, one-second leases with clients that pause past them.
//
// Seeded and bounded: by default 3 rounds of 5 s (the CI entry). A longer
// run: KVQ_HISTORY_ROUNDS=30 KVQ_HISTORY_SECONDS=20 KVQ_HISTORY_SEED=7
// build/tests/integration/history_test (docs/RELIABILITY.md).
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/history/checker.h"
#include "tests/integration/history/workload.h"
#include "tests/integration/server_process.h"

namespace kvq::history {
namespace {

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  int64_t out;
  return v != nullptr && absl::SimpleAtoi(v, &out) ? out : fallback;
}

const char* CodeName(int code) {
  // grpc::StatusCode values 0..16, in order.
  static const char* const kNames[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
      "UNAUTHENTICATED"};
  return code >= 0 && code < 17 ? kNames[code] : "?";
}

struct Fault {
  const char* name;
  std::vector<std::string> flags;
  int sequences;
  int pause_percent;
  absl::Duration max_pause;
};

// The pool of the second holds 2 slabs; the third's clients pause often
// and long enough for idle sequences to expire.
const std::vector<Fault>& Faults() {
  static const auto* faults = new std::vector<Fault>{
      {"no fault", {}, 4, 3, absl::Milliseconds(20)},
      {"small pool", {"--capacity_bytes=65536", "--slab_bytes=32768"}, 4, 3,
       absl::Milliseconds(20)},
      {"1 s leases", {"--default_ttl_seconds=1"}, 8, 25, absl::Milliseconds(2500)},
  };
  return *faults;
}

TEST(HistoryTest, RandomConcurrentCallsShowNoAnomaly) {
  const int64_t rounds = EnvInt("KVQ_HISTORY_ROUNDS", 3);
  const int64_t seconds = EnvInt("KVQ_HISTORY_SECONDS", 5);
  const int64_t seed = EnvInt("KVQ_HISTORY_SEED", 1);
  const int64_t threads = EnvInt("KVQ_HISTORY_THREADS", 6);
  int64_t histories = 0, total_ops = 0, total_anomalies = 0, reads = 0, attention = 0;
  std::map<std::string, int64_t> by_outcome;
  const absl::Time start = absl::Now();
  for (int64_t round = 0; round < rounds; ++round) {
    const Fault& fault = Faults()[round % Faults().size()];
    ServerProcess server(KVQ_SERVER_BIN);
    absl::Status st = server.Start(fault.flags);
    ASSERT_TRUE(st.ok()) << st;
    WorkloadOptions o;
    o.target = server.address();
    o.seed = static_cast<uint64_t>(seed) * 1000 + round;
    o.threads = static_cast<int>(threads);
    o.duration = absl::Seconds(seconds);
    o.sequences = fault.sequences;
    o.pause_percent = fault.pause_percent;
    o.max_pause = fault.max_pause;
    History history;
    st = RunWorkload(o, &history);
    ASSERT_TRUE(st.ok()) << st;
    const CheckReport report = Check(history);
    total_ops += static_cast<int64_t>(history.ops().size());
    total_anomalies += static_cast<int64_t>(report.anomalies.size());
    reads += report.reads_checked;
    attention += report.attention_checked;
    for (const Op& op : history.ops()) {
      const char* what = op.outcome == Outcome::kOk       ? "ok"
                         : op.outcome == Outcome::kFailed ? "failed"
                                                          : "indeterminate";
      ++by_outcome[absl::StrCat(KindName(op.kind), " ", what)];
      if (op.code > 0) ++by_outcome[absl::StrCat("code ", CodeName(op.code))];
      if (op.message.find("expired") != std::string::npos) ++by_outcome["expired lease seen"];
    }
    ++histories;
    std::printf("round %lld (%s, seed %llu): %zu calls, %lld reads and %lld attention answers "
                "checked, %zu anomalies, %.1f s since the start\n",
                static_cast<long long>(round), fault.name, static_cast<unsigned long long>(o.seed),
                history.ops().size(), static_cast<long long>(report.reads_checked),
                static_cast<long long>(report.attention_checked), report.anomalies.size(),
                absl::ToDoubleSeconds(absl::Now() - start));
    if (!report.anomalies.empty()) {
      // How soon the history showed it: the first call that did, from the
      // round's first call.
      const int64_t t0 = history.ops().front().invoked_ns;
      int64_t first = std::numeric_limits<int64_t>::max();
      std::map<std::string, int64_t> kinds;
      for (const Anomaly& a : report.anomalies) {
        ++kinds[AnomalyName(a.kind)];
        if (a.op >= 0) first = std::min(first, history.ops()[a.op].answered_ns);
      }
      std::printf("  first anomalous call answered %.3f s into the round\n",
                  static_cast<double>(first - t0) / 1e9);
      for (const auto& [kind, n] : kinds) {
        std::printf("  %s: %lld\n", kind.c_str(), static_cast<long long>(n));
      }
    }
    for (size_t i = 0; i < report.anomalies.size() && i < 10; ++i) {
      ADD_FAILURE() << AnomalyName(report.anomalies[i].kind) << ": "
                    << report.anomalies[i].detail;
    }
    if (!report.anomalies.empty()) break;  // The first failing round is the finding.
  }
  std::printf("histories %lld, calls %lld, reads checked %lld, attention checked %lld, "
              "anomalies %lld\n",
              static_cast<long long>(histories), static_cast<long long>(total_ops),
              static_cast<long long>(reads), static_cast<long long>(attention),
              static_cast<long long>(total_anomalies));
  for (const auto& [what, n] : by_outcome) {
    std::printf("  %s: %lld\n", what.c_str(), static_cast<long long>(n));
  }
  EXPECT_EQ(total_anomalies, 0);
}

}  // namespace
}  // namespace kvq::history
