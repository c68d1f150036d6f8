// RespClient: the smallest Redis client `kvq-bench rpc` needs, over one TCP
// connection: RESP2 commands with binary-safe arguments, pipelined (send
// many, then read the replies in order). A SET value may be given as
// several pieces, written with writev straight from the caller's memory; a
// GET reply is read straight into the caller's buffer. Not thread-safe (one
// connection per thread).
#ifndef KVQ_BENCH_RESP_CLIENT_H_
#define KVQ_BENCH_RESP_CLIENT_H_

#include <sys/uio.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvq {

class RespClient {
 public:
  // Connects to host:port (an IPv4 address), retrying refused connections
  // until `timeout` (the server may still be starting). UNAVAILABLE after.
  static absl::StatusOr<std::unique_ptr<RespClient>> Connect(const std::string& host, int port,
                                                             absl::Duration timeout);
  ~RespClient();
  RespClient(const RespClient&) = delete;
  RespClient& operator=(const RespClient&) = delete;

  // Sends one command; its reply must be read later, in order.
  absl::Status Send(absl::Span<const absl::string_view> args);
  // SET key value, the value being the concatenation of `value_parts`.
  absl::Status SendSet(absl::string_view key, absl::Span<const absl::string_view> value_parts);
  absl::Status SendGet(absl::string_view key);

  // Reads a simple-string reply ("+OK" -> "OK"). An error reply becomes
  // FAILED_PRECONDITION with its text; any other type INTERNAL.
  absl::StatusOr<std::string> ReadSimple();
  // Reads a bulk-string reply into out[0, capacity) and returns its size:
  // NOT_FOUND for a nil reply, OUT_OF_RANGE when it does not fit (the
  // connection is then unusable).
  absl::StatusOr<size_t> ReadBulkInto(char* out, size_t capacity);
  // Reads any bulk-string reply into a string (INFO and the like).
  absl::StatusOr<std::string> ReadBulk();

  // One round trip of a command with a simple-string reply.
  absl::StatusOr<std::string> Call(absl::Span<const absl::string_view> args);

 private:
  explicit RespClient(int fd) : fd_(fd), buffer_(64 << 10) {}
  absl::Status WriteAll(std::vector<struct iovec>& iov);
  // The next line of the reply stream, without its "\r\n".
  absl::StatusOr<std::string> ReadLine();
  absl::Status Fill();  // Reads more bytes into the buffer (at least one).
  absl::Status ReadExact(char* out, size_t n);
  absl::StatusOr<long long> ReadBulkHeader();

  int fd_;
  std::vector<char> buffer_;
  size_t begin_ = 0;  // Unread bytes are buffer_[begin_, end_).
  size_t end_ = 0;
};

}  // namespace kvq

#endif  // KVQ_BENCH_RESP_CLIENT_H_
