// ReplicaSet: fixed lists, DNS through an injected resolver, refresh on
// change, and what a failed or empty resolution leaves.
#include "client/replica_set.h"

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvq {
namespace {

using Names = std::vector<std::string>;

// A DNS stand-in whose answer the test changes.
class FakeDns {
 public:
  void Answer(absl::StatusOr<std::vector<std::string>> a) {
    absl::MutexLock lock(&mu_);
    answer_ = std::move(a);
  }
  int calls() const { return calls_.load(); }
  Resolver resolver() {
    return [this](absl::string_view host,
                  absl::string_view port) -> absl::StatusOr<std::vector<std::string>> {
      ++calls_;
      EXPECT_EQ(host, "kvq.ns.svc.cluster.local");
      EXPECT_EQ(port, "50051");
      absl::MutexLock lock(&mu_);
      return answer_;
    };
  }

 private:
  absl::Mutex mu_;
  absl::StatusOr<std::vector<std::string>> answer_;
  std::atomic<int> calls_{0};
};

TEST(ReplicaSetTest, FixedListIsSortedAndDeduplicated) {
  auto set = ReplicaSet::FromTargets({" b:2", "a:1", "b:2", "[::1]:3"}).value();
  auto snap = set->Get();
  EXPECT_EQ(snap->replicas, (Names{"[::1]:3", "a:1", "b:2"}));
  EXPECT_EQ(snap->version, 1u);
  EXPECT_TRUE(set->Refresh().ok());  // Nothing to resolve.
  EXPECT_EQ(set->Get()->version, 1u);
}

TEST(ReplicaSetTest, BadTargetsAreNamed) {
  EXPECT_EQ(ReplicaSet::FromTargets({}).status(),
            absl::InvalidArgumentError("the replica list is empty"));
  EXPECT_EQ(ReplicaSet::FromTargets({"a:1", "b"}).status(),
            absl::InvalidArgumentError("replica target \"b\" must be host:port"));
  EXPECT_EQ(ReplicaSet::FromTargets({"a:http"}).status(),
            absl::InvalidArgumentError("replica target \"a:http\" has a port that is not a number"));
  EXPECT_EQ(ReplicaSet::FromTargets({"[::1:5"}).status(),
            absl::InvalidArgumentError("replica target \"[::1:5\" opens [ without closing it"));
}

TEST(ReplicaSetTest, DnsFollowsChangesAndBumpsVersionOnlyOnChange) {
  FakeDns dns;
  dns.Answer(std::vector<std::string>{"127.0.1.2:50051", "127.0.1.1:50051", "127.0.1.2:50051"});
  auto set = ReplicaSet::FromDns("kvq.ns.svc.cluster.local:50051", absl::ZeroDuration(),
                                 dns.resolver())
                 .value();
  EXPECT_EQ(set->Get()->replicas, (Names{"127.0.1.1:50051", "127.0.1.2:50051"}));
  EXPECT_EQ(set->Get()->version, 1u);
  dns.Answer(std::vector<std::string>{"127.0.1.1:50051", "127.0.1.2:50051"});
  ASSERT_TRUE(set->Refresh().ok());
  EXPECT_EQ(set->Get()->version, 1u);  // Same list, other order: no change.
  dns.Answer(std::vector<std::string>{"127.0.1.1:50051", "127.0.1.3:50051"});
  ASSERT_TRUE(set->Refresh().ok());
  EXPECT_EQ(set->Get()->replicas, (Names{"127.0.1.1:50051", "127.0.1.3:50051"}));
  EXPECT_EQ(set->Get()->version, 2u);
}

TEST(ReplicaSetTest, FailedOrEmptyResolutionKeepsThePreviousList) {
  FakeDns dns;
  dns.Answer(std::vector<std::string>{"127.0.1.1:50051"});
  auto set = ReplicaSet::FromDns("kvq.ns.svc.cluster.local:50051", absl::ZeroDuration(),
                                 dns.resolver())
                 .value();
  dns.Answer(absl::NotFoundError("NXDOMAIN"));
  EXPECT_EQ(set->Refresh(), absl::NotFoundError("NXDOMAIN"));
  dns.Answer(std::vector<std::string>{});
  EXPECT_EQ(set->Refresh(),
            absl::NotFoundError("kvq.ns.svc.cluster.local:50051 resolved to no address"));
  EXPECT_EQ(set->Get()->replicas, (Names{"127.0.1.1:50051"}));
  EXPECT_EQ(set->Get()->version, 1u);
}

TEST(ReplicaSetTest, FirstResolutionMustSucceed) {
  FakeDns dns;
  dns.Answer(absl::NotFoundError("NXDOMAIN"));
  EXPECT_EQ(ReplicaSet::FromDns("kvq.ns.svc.cluster.local:50051", absl::ZeroDuration(),
                                dns.resolver())
                .status(),
            absl::NotFoundError("NXDOMAIN"));
  EXPECT_EQ(ReplicaSet::FromDns("no-port", absl::ZeroDuration(), dns.resolver()).status(),
            absl::InvalidArgumentError("replica target \"no-port\" must be host:port"));
}

TEST(ReplicaSetTest, BackgroundRefreshPicksUpAChange) {
  FakeDns dns;
  dns.Answer(std::vector<std::string>{"127.0.1.1:50051"});
  auto set = ReplicaSet::FromDns("kvq.ns.svc.cluster.local:50051", absl::Milliseconds(10),
                                 dns.resolver())
                 .value();
  dns.Answer(std::vector<std::string>{"127.0.1.1:50051", "127.0.1.2:50051"});
  // Bounded wait (not a timing assertion): 2000 x 5 ms.
  for (int i = 0; i < 2000 && set->Get()->replicas.size() < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(set->Get()->replicas, (Names{"127.0.1.1:50051", "127.0.1.2:50051"}));
  EXPECT_EQ(set->Get()->version, 2u);
  const int calls = dns.calls();
  set.reset();  // Stops and joins the refresher.
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(dns.calls(), calls);
}

TEST(ReplicaSetTest, GetaddrinfoResolvesLoopback) {
  absl::StatusOr<std::vector<std::string>> r = ResolveWithGetaddrinfo("127.0.0.1", "50051");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (Names{"127.0.0.1:50051"}));
  auto set = ReplicaSet::FromDns("127.0.0.1:7", absl::ZeroDuration()).value();
  EXPECT_EQ(set->Get()->replicas, (Names{"127.0.0.1:7"}));
}

}  // namespace
}  // namespace kvq
