#include "bench/resp_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvq {
namespace {

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RespClient>> RespClient::Connect(const std::string& host, int port,
                                                                absl::Duration timeout) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("host \"", host, "\" is not an IPv4 address"));
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return Errno("socket");
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return std::unique_ptr<RespClient>(new RespClient(fd));
    }
    const int err = errno;
    close(fd);
    if (err != ECONNREFUSED || absl::Now() >= deadline) {
      errno = err;
      return Errno(absl::StrCat("connect ", host, ":", port));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

RespClient::~RespClient() {
  if (fd_ >= 0) close(fd_);
}

absl::Status RespClient::WriteAll(std::vector<struct iovec>& iov) {
  size_t first = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = writev(fd_, &iov[first], count);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("writev");
    }
    size_t left = static_cast<size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return absl::OkStatus();
}

absl::Status RespClient::Send(absl::Span<const absl::string_view> args) {
  std::vector<std::string> headers;
  headers.reserve(args.size() + 1);
  headers.push_back(absl::StrCat("*", args.size(), "\r\n"));
  std::vector<struct iovec> iov;
  for (absl::string_view a : args) headers.push_back(absl::StrCat("$", a.size(), "\r\n"));
  static const char kCrlf[] = "\r\n";
  iov.push_back({headers[0].data(), headers[0].size()});
  for (size_t i = 0; i < args.size(); ++i) {
    iov.push_back({headers[i + 1].data(), headers[i + 1].size()});
    iov.push_back({const_cast<char*>(args[i].data()), args[i].size()});
    iov.push_back({const_cast<char*>(kCrlf), 2});
  }
  return WriteAll(iov);
}

absl::Status RespClient::SendSet(absl::string_view key,
                                 absl::Span<const absl::string_view> value_parts) {
  size_t value_bytes = 0;
  for (absl::string_view p : value_parts) value_bytes += p.size();
  const std::string head =
      absl::StrCat("*3\r\n$3\r\nSET\r\n$", key.size(), "\r\n", key, "\r\n$", value_bytes, "\r\n");
  static const char kCrlf[] = "\r\n";
  std::vector<struct iovec> iov;
  iov.push_back({const_cast<char*>(head.data()), head.size()});
  for (absl::string_view p : value_parts) iov.push_back({const_cast<char*>(p.data()), p.size()});
  iov.push_back({const_cast<char*>(kCrlf), 2});
  return WriteAll(iov);
}

absl::Status RespClient::SendGet(absl::string_view key) {
  const absl::string_view args[] = {"GET", key};
  return Send(args);
}

absl::Status RespClient::Fill() {
  if (begin_ == end_) begin_ = end_ = 0;
  if (end_ == buffer_.size()) {
    if (begin_ == 0) buffer_.resize(buffer_.size() * 2);  // A very long line.
    std::memmove(buffer_.data(), buffer_.data() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
  while (true) {
    const ssize_t n = recv(fd_, buffer_.data() + end_, buffer_.size() - end_, 0);
    if (n > 0) {
      end_ += static_cast<size_t>(n);
      return absl::OkStatus();
    }
    if (n == 0) return absl::UnavailableError("redis closed the connection");
    if (errno != EINTR) return Errno("recv");
  }
}

absl::StatusOr<std::string> RespClient::ReadLine() {
  // Reply headers are short: rescanning the unread bytes is cheap.
  while (true) {
    for (size_t i = begin_; i + 1 < end_; ++i) {
      if (buffer_[i] == '\r' && buffer_[i + 1] == '\n') {
        std::string line(buffer_.data() + begin_, i - begin_);
        begin_ = i + 2;
        return line;
      }
    }
    if (absl::Status st = Fill(); !st.ok()) return st;
  }
}

absl::Status RespClient::ReadExact(char* out, size_t n) {
  const size_t buffered = std::min(n, end_ - begin_);
  std::memcpy(out, buffer_.data() + begin_, buffered);
  begin_ += buffered;
  size_t done = buffered;
  while (done < n) {
    const ssize_t r = recv(fd_, out + done, n - done, 0);
    if (r > 0) {
      done += static_cast<size_t>(r);
    } else if (r == 0) {
      return absl::UnavailableError("redis closed the connection");
    } else if (errno != EINTR) {
      return Errno("recv");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RespClient::ReadSimple() {
  absl::StatusOr<std::string> line = ReadLine();
  if (!line.ok()) return line.status();
  if (!line->empty() && (*line)[0] == '+') return line->substr(1);
  if (!line->empty() && (*line)[0] == '-') {
    return absl::FailedPreconditionError(absl::StrCat("redis: ", line->substr(1)));
  }
  return absl::InternalError(absl::StrCat("redis: expected a simple string, got \"", *line, "\""));
}

absl::StatusOr<long long> RespClient::ReadBulkHeader() {
  absl::StatusOr<std::string> line = ReadLine();
  if (!line.ok()) return line.status();
  if (!line->empty() && (*line)[0] == '-') {
    return absl::FailedPreconditionError(absl::StrCat("redis: ", line->substr(1)));
  }
  long long n = 0;
  if (line->empty() || (*line)[0] != '$' || !absl::SimpleAtoi(line->substr(1), &n)) {
    return absl::InternalError(absl::StrCat("redis: expected a bulk string, got \"", *line, "\""));
  }
  return n;
}

absl::StatusOr<size_t> RespClient::ReadBulkInto(char* out, size_t capacity) {
  absl::StatusOr<long long> n = ReadBulkHeader();
  if (!n.ok()) return n.status();
  if (*n < 0) return absl::NotFoundError("redis: nil reply");
  if (static_cast<unsigned long long>(*n) > capacity) {
    return absl::OutOfRangeError(
        absl::StrCat("redis: a ", *n, "-byte value does not fit in ", capacity, " bytes"));
  }
  if (absl::Status st = ReadExact(out, static_cast<size_t>(*n)); !st.ok()) return st;
  char crlf[2];
  if (absl::Status st = ReadExact(crlf, 2); !st.ok()) return st;
  return static_cast<size_t>(*n);
}

absl::StatusOr<std::string> RespClient::ReadBulk() {
  absl::StatusOr<long long> n = ReadBulkHeader();
  if (!n.ok()) return n.status();
  if (*n < 0) return absl::NotFoundError("redis: nil reply");
  std::string out(static_cast<size_t>(*n) + 2, '\0');
  if (absl::Status st = ReadExact(out.data(), out.size()); !st.ok()) return st;
  out.resize(static_cast<size_t>(*n));
  return out;
}

absl::StatusOr<std::string> RespClient::Call(absl::Span<const absl::string_view> args) {
  if (absl::Status st = Send(args); !st.ok()) return st;
  return ReadSimple();
}

}  // namespace kvq
