#include "client/replica_set.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvq {

absl::Status SplitHostPort(absl::string_view target, std::string* host, std::string* port) {
  const size_t colon = target.rfind(':');
  if (colon == absl::string_view::npos || colon == 0 || colon + 1 == target.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica target \"", target, "\" must be host:port"));
  }
  absl::string_view h = target.substr(0, colon);
  if (absl::ConsumePrefix(&h, "[") && !absl::ConsumeSuffix(&h, "]")) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica target \"", target, "\" opens [ without closing it"));
  }
  absl::string_view p = target.substr(colon + 1);
  if (!std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica target \"", target, "\" has a port that is not a number"));
  }
  *host = std::string(h);
  *port = std::string(p);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ResolveWithGetaddrinfo(absl::string_view host,
                                                                absl::string_view port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string h(host), p(port);
  if (int rc = getaddrinfo(h.c_str(), p.c_str(), &hints, &res); rc != 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot resolve ", h, ":", p, ": ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
      out.push_back(absl::StrCat(ip, ":", p));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip,
                sizeof(ip));
      out.push_back(absl::StrCat("[", ip, "]:", p));
    }
  }
  freeaddrinfo(res);
  if (out.empty()) return absl::NotFoundError(absl::StrCat(h, ":", p, " has no address"));
  return out;
}

absl::StatusOr<std::unique_ptr<ReplicaSet>> ReplicaSet::FromTargets(
    const std::vector<std::string>& targets) {
  std::unique_ptr<ReplicaSet> set(new ReplicaSet());
  if (absl::Status st = set->Set(targets); !st.ok()) return st;
  return set;
}

absl::StatusOr<std::unique_ptr<ReplicaSet>> ReplicaSet::FromDns(absl::string_view dns_target,
                                                                absl::Duration refresh,
                                                                Resolver resolver) {
  std::unique_ptr<ReplicaSet> set(new ReplicaSet());
  if (absl::Status st = SplitHostPort(dns_target, &set->host_, &set->port_); !st.ok()) return st;
  set->resolver_ = std::move(resolver);
  if (absl::Status st = set->Refresh(); !st.ok()) return st;
  if (refresh > absl::ZeroDuration()) {
    set->refresher_ = std::thread([s = set.get(), refresh] { s->RefreshLoop(refresh); });
  }
  return set;
}

ReplicaSet::~ReplicaSet() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (refresher_.joinable()) refresher_.join();
}

std::shared_ptr<const ReplicaSet::Snapshot> ReplicaSet::Get() const {
  absl::MutexLock lock(&mu_);
  return snapshot_;
}

absl::Status ReplicaSet::Set(std::vector<std::string> replicas) {
  for (std::string& r : replicas) r = std::string(absl::StripAsciiWhitespace(r));
  replicas.erase(std::remove(replicas.begin(), replicas.end(), ""), replicas.end());
  if (replicas.empty()) return absl::InvalidArgumentError("the replica list is empty");
  for (const std::string& r : replicas) {
    std::string h, p;
    if (absl::Status st = SplitHostPort(r, &h, &p); !st.ok()) return st;
  }
  std::sort(replicas.begin(), replicas.end());
  replicas.erase(std::unique(replicas.begin(), replicas.end()), replicas.end());
  absl::MutexLock lock(&mu_);
  if (snapshot_ != nullptr && snapshot_->replicas == replicas) return absl::OkStatus();
  auto next = std::make_shared<Snapshot>();
  next->replicas = std::move(replicas);
  next->version = snapshot_ == nullptr ? 1 : snapshot_->version + 1;
  snapshot_ = std::move(next);
  return absl::OkStatus();
}

absl::Status ReplicaSet::Refresh() {
  if (host_.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<std::string>> found = resolver_(host_, port_);
  if (!found.ok()) return found.status();
  if (found->empty()) {
    return absl::NotFoundError(absl::StrCat(host_, ":", port_, " resolved to no address"));
  }
  return Set(*std::move(found));
}

void ReplicaSet::RefreshLoop(absl::Duration every) {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), every)) return;
    }
    Refresh().IgnoreError();  // The previous list stays.
  }
}

}  // namespace kvq
