// A loopback TCP relay in front of a server whose connections the test can
// cut: how a client whose network drops mid-call looks to the server.
#ifndef KVQ_TESTS_INTEGRATION_HISTORY_TCP_RELAY_H_
#define KVQ_TESTS_INTEGRATION_HISTORY_TCP_RELAY_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvq::history {

class TcpRelay {
 public:
  // Listens on 127.0.0.1 (a free port) and relays every connection to
  // `target` ("127.0.0.1:PORT").
  static absl::StatusOr<std::unique_ptr<TcpRelay>> Start(const std::string& target);
  ~TcpRelay();  // Cuts every connection and stops.
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  const std::string& address() const { return address_; }
  // Shuts every relayed connection down in both directions, at once.
  void Cut();

 private:
  TcpRelay(int listener, int port, std::string target);
  void Accept();
  void Pump(int a, int b);

  const int listener_;
  const std::string address_;
  const std::string target_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
  std::thread acceptor_;
};

}  // namespace kvq::history

#endif  // KVQ_TESTS_INTEGRATION_HISTORY_TCP_RELAY_H_
