#ifndef KVQ_BENCH_BENCH_KVQ_SERVER_H_
#define KVQ_BENCH_BENCH_KVQ_SERVER_H_

// The kvq-server that kvq-bench's rpc and soak commands start when they are
// not pointed at a running one.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "bench/child_process.h"

namespace kvq {

struct StartedKvqServer {
  std::unique_ptr<ChildProcess> process;
  int port = 0;  // On 127.0.0.1.
};

// Starts a kvq-server on a free loopback port: CPU backend,
// `capacity_bytes` of page pool, no metrics port, its port file and log in
// `dir`; returns once it listens (at most a minute). The binary is
// `kvq_server_path` (the command's --kvq_server) when set, else the one
// next to kvq-bench; NOT_FOUND, naming `remote_flag` (the command's flag for
// a server already running), when there is none.
absl::StatusOr<StartedKvqServer> StartKvqServer(const std::string& kvq_server_path,
                                                absl::string_view remote_flag,
                                                int64_t capacity_bytes, const ScratchDir& dir);

}  // namespace kvq

#endif  // KVQ_BENCH_BENCH_KVQ_SERVER_H_
