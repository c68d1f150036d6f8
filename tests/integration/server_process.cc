#include "tests/integration/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/client/random_host_tensor.h"

namespace kvq {

HostTensor Random(std::vector<int64_t> shape, uint32_t seed) {
  return RandomHostTensor(std::move(shape), seed);
}

int RunCommand(const std::string& command, std::string* output) {
  FILE* p = popen(absl::StrCat(command, " 2>&1").c_str(), "r");
  output->clear();
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string BinaryPath(const char* env, const char* built) {
  const char* moved = std::getenv(env);
  return moved != nullptr && *moved != '\0' ? moved : built;
}

namespace {

std::atomic<int> g_next_instance{0};

}  // namespace

ServerProcess::ServerProcess(std::string server_bin) : server_bin_(std::move(server_bin)) {}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) (void)Terminate();
}

absl::Status ServerProcess::Start(const std::vector<std::string>& extra_flags) {
  if (pid_ > 0) return absl::FailedPreconditionError("the server is already running");
  dir_ = absl::StrCat(::testing::TempDir(), "/kvq_it_", getpid(), "_", g_next_instance++);
  mkdir(dir_.c_str(), 0755);
  const std::string port_file = dir_ + "/port";
  const std::string stdout_file = dir_ + "/stdout";
  std::remove(port_file.c_str());
  std::vector<std::string> args = {server_bin_, "--address=127.0.0.1:0",
                                   "--metrics_address=127.0.0.1:0", "--port_file=" + port_file,
                                   "--capacity_bytes=268435456", "--backend=cpu"};
  // KVQ_TEST_SERVER_BACKEND=cuda runs the same tests against the device
  // (scripts/gpu_check.sh); the last --backend wins.
  if (const char* backend = std::getenv("KVQ_TEST_SERVER_BACKEND"); backend != nullptr) {
    args.push_back(absl::StrCat("--backend=", backend));
  }
  args.insert(args.end(), extra_flags.begin(), extra_flags.end());
  pid_ = fork();
  if (pid_ < 0) return absl::InternalError("fork failed");
  if (pid_ == 0) {
    const int fd = open(stdout_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      close(fd);
    }
    if (capture_stderr_) {
      const int err = open((dir_ + "/stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (err >= 0) {
        dup2(err, STDERR_FILENO);
        close(err);
      }
    }
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  // Bounded wait for start-up (not a timing assertion: a slow machine only
  // waits longer).
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (absl::Now() < give_up) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) {
      address_ = absl::StrCat("127.0.0.1:", port);
      return absl::OkStatus();
    }
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("kvq-server exited during start-up (status ",
                                              status, ")"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError("kvq-server did not write its port");
}

absl::StatusOr<std::string> ServerProcess::MetricsAddress() const {
  const std::string prefix = "metrics at http";  // http:// or https://
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (absl::Now() < give_up) {
    const std::string out = Stdout();
    const size_t at = out.find(prefix);
    const size_t scheme_end = at == std::string::npos ? at : out.find("://", at);
    if (scheme_end != std::string::npos) {
      const size_t begin = scheme_end + 3;
      const size_t end = out.find("/metrics", begin);
      if (end != std::string::npos) return out.substr(begin, end - begin);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::NotFoundError(absl::StrCat("no metrics address in the server's stdout: ",
                                          Stdout()));
}

absl::StatusOr<int> ServerProcess::Terminate() { return Kill(SIGTERM); }

absl::StatusOr<int> ServerProcess::Kill(int signal) {
  if (pid_ <= 0) return absl::FailedPreconditionError("the server is not running");
  kill(pid_, signal);
  int status = 0;
  const pid_t reaped = waitpid(pid_, &status, 0);
  pid_ = -1;
  if (reaped < 0) return absl::InternalError("waitpid failed");
  return status;
}

std::string ServerProcess::Stdout() const {
  std::ifstream in(dir_ + "/stdout");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ServerProcess::Stderr() const {
  std::ifstream in(dir_ + "/stderr");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace kvq
