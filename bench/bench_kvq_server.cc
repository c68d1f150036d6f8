#include "bench/bench_kvq_server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace kvq {
namespace {

// The binary StartKvqServer starts.
absl::StatusOr<std::string> FindKvqServer(const std::string& given,
                                          absl::string_view remote_flag) {
  std::string path = given;
  if (path.empty()) {
    absl::StatusOr<std::string> self_dir = SelfExecutableDir();
    if (!self_dir.ok()) return self_dir.status();
    // Build tree: <build>/bench/kvq-bench and <build>/service/kvq-server;
    // installed: both in bin/.
    for (const std::string& candidate :
         {*self_dir + "/../service/kvq-server", *self_dir + "/kvq-server"}) {
      if (FindExecutable(candidate).ok()) {
        path = candidate;
        break;
      }
    }
    if (path.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "no kvq-server next to kvq-bench (looked in ", *self_dir, "/../service and ", *self_dir,
          "); build the kvq_server target, or pass --kvq_server=PATH or ", remote_flag,
          "=HOST:PORT"));
    }
  }
  if (absl::StatusOr<std::string> found = FindExecutable(path); !found.ok()) {
    return found.status();
  }
  return path;
}

}  // namespace

absl::StatusOr<StartedKvqServer> StartKvqServer(const std::string& kvq_server_path,
                                                absl::string_view remote_flag,
                                                int64_t capacity_bytes, const ScratchDir& dir) {
  absl::StatusOr<std::string> path = FindKvqServer(kvq_server_path, remote_flag);
  if (!path.ok()) return path.status();
  const std::string port_file = dir.File("kvq-server.port");
  StartedKvqServer started;
  absl::StatusOr<std::unique_ptr<ChildProcess>> process = ChildProcess::Start(
      "kvq-server",
      {*path, "--address=127.0.0.1:0", "--metrics_address=", "--port_file=" + port_file,
       absl::StrCat("--capacity_bytes=", capacity_bytes), "--backend=cpu",
       "--shutdown_grace_seconds=1"},
      dir.File("kvq-server.log"));
  if (!process.ok()) return process.status();
  started.process = std::move(*process);
  absl::StatusOr<int> port = WaitForPortFile(port_file, started.process.get(), absl::Seconds(60));
  if (!port.ok()) return port.status();
  started.port = *port;
  return started;
}

}  // namespace kvq
