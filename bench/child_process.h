// Helpers of `kvq-bench rpc` for the servers it runs as child processes:
// start, wait until ready, stop (also when the bench dies: the child gets
// SIGTERM when its parent exits), and a scratch directory for their files.
#ifndef KVQ_BENCH_CHILD_PROCESS_H_
#define KVQ_BENCH_CHILD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvq {

class ChildProcess {
 public:
  // Runs argv (argv[0] is a path, or a name searched on PATH) with stdin
  // from /dev/null and stdout + stderr appended to `log_path`. INTERNAL
  // when fork fails; a failed exec shows up as an early exit (Running()
  // false, the reason in the log).
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(std::string name,
                                                             std::vector<std::string> argv,
                                                             std::string log_path);
  // Stop() with a short grace.
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Whether the process has not exited yet (reaps it when it has).
  bool Running();
  // SIGTERM, then SIGKILL after `grace`; reaps the process. OK when it
  // exited with status 0 or by our signal; INTERNAL otherwise.
  absl::Status Stop(absl::Duration grace = absl::Seconds(3));
  // CPU time (user + system) its threads have used so far, in seconds;
  // -1 once it exited. Precise to the scheduler's nanoseconds.
  double CpuSeconds() const;
  // The last `bytes` of the log, for error messages.
  std::string LogTail(size_t bytes = 2000) const;
  const std::string& name() const { return name_; }
  // -1 before the start; the id stays valid until Stop() or Running() reaped it.
  pid_t pid() const { return pid_; }

 private:
  ChildProcess() = default;
  std::string name_;
  std::string log_path_;
  pid_t pid_ = -1;
  int wait_status_ = 0;
  bool exited_ = false;
};

// Waits until `path` holds a port number and a newline (what kvq-server's
// --port_file and rpc-echo-server write). DEADLINE_EXCEEDED after
// `timeout`; UNAVAILABLE with the log tail when the child exits first.
absl::StatusOr<int> WaitForPortFile(const std::string& path, ChildProcess* child,
                                    absl::Duration timeout);

// CPU time of this process (all threads), in seconds.
double SelfCpuSeconds();

// A loopback TCP port nobody listens on right now (bound and released).
absl::StatusOr<int> FreeLoopbackPort();

// The executable `name` on PATH (or `name` itself when it holds a '/' and
// is executable); NOT_FOUND otherwise.
absl::StatusOr<std::string> FindExecutable(absl::string_view name);

// This process's executable, and the directory holding it.
absl::StatusOr<std::string> SelfExecutable();
absl::StatusOr<std::string> SelfExecutableDir();

// A fresh directory under $TMPDIR (or /tmp), removed with its files by the
// destructor.
class ScratchDir {
 public:
  static absl::StatusOr<std::unique_ptr<ScratchDir>> Create(absl::string_view prefix);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(absl::string_view name) const;

 private:
  explicit ScratchDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace kvq

#endif  // KVQ_BENCH_CHILD_PROCESS_H_
