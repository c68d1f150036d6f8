// ServerProcess: a real kvq-server child process on a free loopback port,
// for the integration tests.
#ifndef KVQ_TESTS_INTEGRATION_SERVER_PROCESS_H_
#define KVQ_TESTS_INTEGRATION_SERVER_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/host_tensor.h"

namespace kvq {

// fp32 N(0, 1) tensor of `shape`, deterministic in `seed`.
HostTensor Random(std::vector<int64_t> shape, uint32_t seed);

// Runs `command` through the shell with stderr joined to stdout; returns its
// exit code (-1 when it did not exit normally) and puts what it printed in
// `output`.
int RunCommand(const std::string& command, std::string* output);

// `built` (the build tree's path, compiled in), or the environment
// variable `env` where it is set: the GPU bundle runs these tests with the
// binaries moved (scripts/gpu_check.sh sets KVQ_SERVER_BIN and KVQ_CLI_BIN).
std::string BinaryPath(const char* env, const char* built);

// Starts `server_bin` on 127.0.0.1:0 (and its metrics endpoint on
// 127.0.0.1:0) with a 256 MiB CPU pool, learns the gRPC port from
// --port_file and captures stdout in dir()/stdout. The destructor sends
// SIGTERM and reaps the process.
class ServerProcess {
 public:
  explicit ServerProcess(std::string server_bin);
  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  // `extra_flags` come after the defaults (a repeated flag's last value
  // wins). Waits, with a generous bound, for the port file.
  absl::Status Start(const std::vector<std::string>& extra_flags = {});

  // "HOST:PORT" of the metrics endpoint, parsed from the server's
  // "metrics at http[s]://HOST:PORT/metrics" line (waits for it, bounded).
  absl::StatusOr<std::string> MetricsAddress() const;

  // Sends SIGTERM and waits; returns the waitpid status. FAILED_PRECONDITION
  // when the server is not running.
  absl::StatusOr<int> Terminate();

  // Sends `signal` (e.g. SIGKILL: no shutdown at all) and reaps the
  // process; returns the waitpid status. FAILED_PRECONDITION when the
  // server is not running. Start() may then run it again.
  absl::StatusOr<int> Kill(int signal);

  // What the server printed on stdout so far.
  std::string Stdout() const;
  // Call before Start: stderr goes to dir()/stderr instead of the test's
  // own stderr, for Stderr().
  void set_capture_stderr(bool capture) { capture_stderr_ = capture; }
  std::string Stderr() const;

  const std::string& address() const { return address_; }
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }

 private:
  std::string server_bin_;
  pid_t pid_ = -1;
  std::string address_;
  std::string dir_;
  bool capture_stderr_ = false;
};

}  // namespace kvq

#endif  // KVQ_TESTS_INTEGRATION_SERVER_PROCESS_H_
