#include "tests/integration/history/tcp_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvq::history {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpRelay>> TcpRelay::Start(const std::string& target) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  sockaddr_in a = Loopback(0);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 16) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return absl::InternalError("bind/listen failed");
  }
  return std::unique_ptr<TcpRelay>(new TcpRelay(fd, ntohs(a.sin_port), target));
}

TcpRelay::TcpRelay(int listener, int port, std::string target)
    : listener_(listener),
      address_(absl::StrCat("127.0.0.1:", port)),
      target_(std::move(target)),
      acceptor_([this] { Accept(); }) {}

TcpRelay::~TcpRelay() {
  stop_ = true;
  Cut();
  acceptor_.join();
  std::vector<std::thread> pumps;
  {
    absl::MutexLock lock(&mu_);
    pumps.swap(pumps_);
  }
  for (std::thread& t : pumps) t.join();
  absl::MutexLock lock(&mu_);
  for (int fd : fds_) close(fd);
  close(listener_);
}

void TcpRelay::Cut() {
  absl::MutexLock lock(&mu_);
  for (int fd : fds_) shutdown(fd, SHUT_RDWR);
}

void TcpRelay::Accept() {
  int port = 0;
  const size_t colon = target_.rfind(':');
  if (colon == std::string::npos || !absl::SimpleAtoi(target_.substr(colon + 1), &port)) return;
  while (!stop_) {
    pollfd p{listener_, POLLIN, 0};
    if (poll(&p, 1, 20) <= 0) continue;
    const int in = accept(listener_, nullptr, nullptr);
    if (in < 0) continue;
    const int out = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = Loopback(port);
    if (out < 0 || connect(out, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      close(in);
      if (out >= 0) close(out);
      continue;
    }
    const int one = 1;
    setsockopt(in, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(out, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    absl::MutexLock lock(&mu_);
    fds_.push_back(in);
    fds_.push_back(out);
    pumps_.emplace_back([this, in, out] { Pump(in, out); });
  }
}

void TcpRelay::Pump(int a, int b) {
  char buf[1 << 16];
  pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
  while (!stop_) {
    if (poll(p, 2, 20) < 0) return;
    for (int i = 0; i < 2; ++i) {
      if ((p[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n = read(p[i].fd, buf, sizeof(buf));
      if (n <= 0) {  // Closed or cut: cut the other side too.
        shutdown(a, SHUT_RDWR);
        shutdown(b, SHUT_RDWR);
        return;
      }
      for (ssize_t sent = 0; sent < n;) {
        const ssize_t w = send(p[1 - i].fd, buf + sent, n - sent, MSG_NOSIGNAL);
        if (w <= 0) return;
        sent += w;
      }
    }
  }
}

}  // namespace kvq::history
