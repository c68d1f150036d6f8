// ReplicaSet: the kvq-server replicas a sharded client spreads sequences
// over, from a fixed list of targets or from a DNS name that resolves to one
// address per replica (a Kubernetes headless Service), re-resolved on an
// interval so that replicas that come and go are followed.
//
// A replica's name is the string rendezvous hashing scores: the target as
// given for a fixed list, "IP:PORT" ("[IPv6]:PORT") for a resolved one.
// Names are sorted and deduplicated. A failed or empty resolution keeps the
// previous list: a DNS hiccup must not move every sequence (when every
// replica is really gone the calls fail with UNAVAILABLE anyway).
#ifndef KVQ_CLIENT_REPLICA_SET_H_
#define KVQ_CLIENT_REPLICA_SET_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvq {

// Resolves host and port to "IP:PORT" names (any order, duplicates allowed).
using Resolver = std::function<absl::StatusOr<std::vector<std::string>>(
    absl::string_view host, absl::string_view port)>;

// getaddrinfo (TCP), IPv4 and IPv6; NOT_FOUND when the name has no address.
absl::StatusOr<std::vector<std::string>> ResolveWithGetaddrinfo(absl::string_view host,
                                                                absl::string_view port);

// Splits "host:port" or "[v6]:port"; INVALID_ARGUMENT names a bad one.
absl::Status SplitHostPort(absl::string_view target, std::string* host, std::string* port);

class ReplicaSet {
 public:
  struct Snapshot {
    std::vector<std::string> replicas;  // Sorted, unique.
    uint64_t version = 0;               // Bumped whenever the list changes.
  };

  // A fixed list ("host:port" each); INVALID_ARGUMENT when it is empty or
  // an entry is not host:port.
  static absl::StatusOr<std::unique_ptr<ReplicaSet>> FromTargets(
      const std::vector<std::string>& targets);
  // `dns_target` is "name:port"; resolved once now (an error or no address
  // fails here), then every `refresh` (<= 0: never again, Refresh() only)
  // on a background thread.
  static absl::StatusOr<std::unique_ptr<ReplicaSet>> FromDns(
      absl::string_view dns_target, absl::Duration refresh = absl::Seconds(5),
      Resolver resolver = ResolveWithGetaddrinfo);

  ~ReplicaSet();  // Stops the refresh thread.
  ReplicaSet(const ReplicaSet&) = delete;
  ReplicaSet& operator=(const ReplicaSet&) = delete;

  std::shared_ptr<const Snapshot> Get() const;

  // Resolves now (DNS sets; a fixed list is left alone). The list changes
  // only when the resolver answers with at least one address; its error is
  // returned otherwise.
  absl::Status Refresh();
  // Replaces the list by hand (tests, callers with their own discovery).
  absl::Status Set(std::vector<std::string> replicas);

 private:
  ReplicaSet() = default;
  void RefreshLoop(absl::Duration every);

  std::string host_, port_;  // Empty host: a fixed list.
  Resolver resolver_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const Snapshot> snapshot_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread refresher_;
};

}  // namespace kvq

#endif  // KVQ_CLIENT_REPLICA_SET_H_
