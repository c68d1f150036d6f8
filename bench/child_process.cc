#include "bench/child_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace kvq {

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(std::string name,
                                                                  std::vector<std::string> argv,
                                                                  std::string log_path) {
  if (argv.empty()) return absl::InvalidArgumentError("argv is empty");
  // Everything the child needs is prepared before fork: after it, only
  // async-signal-safe calls.
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  const bool search_path = argv[0].find('/') == std::string::npos;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    // Die with the bench, however it ends.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(126);
    const int in = open("/dev/null", O_RDONLY);
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (in >= 0) dup2(in, STDIN_FILENO);
    if (log >= 0) {
      dup2(log, STDOUT_FILENO);
      dup2(log, STDERR_FILENO);
    }
    if (search_path) {
      execvp(args[0], args.data());
    } else {
      execv(args[0], args.data());
    }
    static const char kMsg[] = "exec failed\n";
    (void)!write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
    _exit(127);
  }
  std::unique_ptr<ChildProcess> child(new ChildProcess());
  child->name_ = std::move(name);
  child->log_path_ = std::move(log_path);
  child->pid_ = pid;
  return child;
}

ChildProcess::~ChildProcess() { (void)Stop(absl::Seconds(3)); }

bool ChildProcess::Running() {
  if (exited_ || pid_ <= 0) return false;
  const pid_t r = waitpid(pid_, &wait_status_, WNOHANG);
  if (r == pid_) exited_ = true;
  return !exited_;
}

absl::Status ChildProcess::Stop(absl::Duration grace) {
  if (pid_ <= 0) return absl::OkStatus();
  bool signalled = false;
  if (Running()) {
    kill(pid_, SIGTERM);
    signalled = true;
    const absl::Time deadline = absl::Now() + grace;
    while (Running() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    if (Running()) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &wait_status_, 0);
      exited_ = true;
    }
  }
  pid_ = -1;
  if (WIFEXITED(wait_status_) && WEXITSTATUS(wait_status_) == 0) return absl::OkStatus();
  if (signalled && WIFSIGNALED(wait_status_)) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(name_, " exited with ",
                                          WIFEXITED(wait_status_)
                                              ? absl::StrCat("status ", WEXITSTATUS(wait_status_))
                                              : absl::StrCat("signal ", WTERMSIG(wait_status_))));
}

double ChildProcess::CpuSeconds() const {
  if (pid_ <= 0 || exited_) return -1.0;
  // The sum over live threads of /proc/<pid>/task/<tid>/schedstat (ns on
  // CPU first); threads that exited are not counted, which suits servers
  // whose threads live as long as they do.
  std::error_code ec;
  double ns = 0.0;
  for (const auto& task :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid_, "/task"), ec)) {
    std::ifstream in(task.path() / "schedstat");
    double on_cpu = 0.0;
    if (in >> on_cpu) ns += on_cpu;
  }
  return ec ? -1.0 : ns * 1e-9;
}

double SelfCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

std::string ChildProcess::LogTail(size_t bytes) const {
  std::ifstream in(log_path_, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  const std::string all = s.str();
  return all.size() <= bytes ? all : all.substr(all.size() - bytes);
}

absl::StatusOr<int> WaitForPortFile(const std::string& path, ChildProcess* child,
                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    int port = 0;
    if (!text.empty() && text.back() == '\n' &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) && port > 0) {
      return port;
    }
    if (!child->Running()) {
      return absl::UnavailableError(
          absl::StrCat(child->name(), " exited before it listened: ", child->LogTail()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(
      absl::StrCat(child->name(), " did not write its port in ", absl::FormatDuration(timeout)));
}

absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string err = std::strerror(errno);
    close(fd);
    return absl::InternalError(absl::StrCat("bind 127.0.0.1:0: ", err));
  }
  close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

absl::StatusOr<std::string> FindExecutable(absl::string_view name) {
  if (name.empty()) return absl::NotFoundError("empty executable name");
  if (name.find('/') != absl::string_view::npos) {
    const std::string path(name);
    if (access(path.c_str(), X_OK) == 0) return path;
    return absl::NotFoundError(absl::StrCat(name, " is not an executable file"));
  }
  const char* env = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(env ? env : "", ':', absl::SkipEmpty())) {
    const std::string path = absl::StrCat(dir, "/", name);
    struct stat st;
    if (stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0) {
      return path;
    }
  }
  return absl::NotFoundError(absl::StrCat(name, " is not on PATH"));
}

absl::StatusOr<std::string> SelfExecutable() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return absl::InternalError(absl::StrCat("/proc/self/exe: ", ec.message()));
  return self.string();
}

absl::StatusOr<std::string> SelfExecutableDir() {
  absl::StatusOr<std::string> self = SelfExecutable();
  if (!self.ok()) return self.status();
  return std::filesystem::path(*self).parent_path().string();
}

absl::StatusOr<std::unique_ptr<ScratchDir>> ScratchDir::Create(absl::string_view prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = absl::StrCat(tmp && *tmp ? tmp : "/tmp", "/", prefix, "XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<ScratchDir>(new ScratchDir(pattern));
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string ScratchDir::File(absl::string_view name) const {
  return absl::StrCat(path_, "/", name);
}

}  // namespace kvq
