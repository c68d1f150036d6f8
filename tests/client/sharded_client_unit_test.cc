// ShardedKvqClient without servers: routing by the golden rule, option
// checks, and the renumbering of a sub-batch's item indexes.
#include <memory>
#include <string>
#include <vector>

#include "client/rendezvous.h"
#include "client/sharded_client.h"
#include "gtest/gtest.h"

namespace kvq {
namespace {

TEST(ShardedClientUnitTest, RoutesEachIdToItsRendezvousWinner) {
  const std::vector<std::string> replicas = {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"};
  ShardOptions options;
  options.client.ns = "t";
  auto c = ShardedKvqClient::Connect("127.0.0.1:3,127.0.0.1:1,127.0.0.1:2", options).value();
  for (int i = 0; i < 100; ++i) {
    const std::string id = "seq-" + std::to_string(i);
    EXPECT_EQ(c->ReplicaOf(id).value(), replicas[RendezvousWinner(SequenceKey("t", id), replicas)]);
  }
  // One KvqClient per replica, reused.
  EXPECT_EQ(c->ClientForReplica("127.0.0.1:2").value(), c->ClientForReplica("127.0.0.1:2").value());
}

TEST(ShardedClientUnitTest, ForgetsTheClientsOfReplicasThatLeft) {
  auto c = ShardedKvqClient::Connect("127.0.0.1:1,127.0.0.1:2").value();
  const std::shared_ptr<KvqClient> before = c->ClientForReplica("127.0.0.1:2").value();
  ASSERT_TRUE(c->replica_set().Set({"127.0.0.1:1"}).ok());
  EXPECT_EQ(c->ReplicaOf("anything").value(), "127.0.0.1:1");
  ASSERT_TRUE(c->replica_set().Set({"127.0.0.1:1", "127.0.0.1:2"}).ok());
  EXPECT_NE(c->ClientForReplica("127.0.0.1:2").value(), before);  // A fresh channel.
}

TEST(ShardedClientUnitTest, BadOptionsAreNamed) {
  EXPECT_EQ(ShardedKvqClient::Connect("127.0.0.1:1,nope").status(),
            absl::InvalidArgumentError("replica target \"nope\" must be host:port"));
  ShardOptions options;
  options.prefix_tokens = -1;
  EXPECT_EQ(ShardedKvqClient::Connect("127.0.0.1:1", options).status(),
            absl::InvalidArgumentError("prefix_tokens must be >= 0, got -1"));
  options.prefix_tokens = 32;
  options.client.deadline = absl::ZeroDuration();
  EXPECT_EQ(ShardedKvqClient::Connect("127.0.0.1:1", options).status(),
            absl::InvalidArgumentError("deadline must be > 0"));
  auto c = ShardedKvqClient::Connect("127.0.0.1:1").value();
  EXPECT_EQ(c->Stats("").status(),
            absl::InvalidArgumentError(
                "sequence_id is empty: server-wide stats are per replica (StatsAll)"));
}

TEST(ShardedClientUnitTest, MalformedBatchesFailBeforeAnyCall) {
  auto c = ShardedKvqClient::Connect("127.0.0.1:1").value();
  DecodeBatch batch;
  batch.sequence_ids = {"a", "b"};
  batch.k = HostTensor::Zeros(DType::kFloat32, {2, 1, 16});
  batch.v = HostTensor::Zeros(DType::kFloat32, {2, 1, 16});
  batch.q = HostTensor::Zeros(DType::kFloat32, {3, 1, 16});
  EXPECT_EQ(c->AppendAttendBatch(0, batch).status(),
            absl::InvalidArgumentError("q is [3, 1, 16] fp32; it must be [2 sequences (one "
                                       "row each, at least one), heads, head_dim]"));
}

TEST(ShardedClientUnitTest, RenumbersItemsToTheCallersIndexes) {
  const std::vector<int> indexes = {4, 7, 9};
  EXPECT_EQ(RenumberItems(absl::NotFoundError("items[1].sequence: x does not exist"), indexes),
            absl::NotFoundError("items[7].sequence: x does not exist"));
  EXPECT_EQ(RenumberItems(absl::InvalidArgumentError("k does not fit items[2].sequence, not "
                                                     "items[0]"),
                          indexes),
            absl::InvalidArgumentError("k does not fit items[9].sequence, not items[4]"));
  // Out of range or not a number: left alone.
  EXPECT_EQ(RenumberItems(absl::NotFoundError("items[3] and items[x] and items["), indexes),
            absl::NotFoundError("items[3] and items[x] and items["));
  EXPECT_TRUE(RenumberItems(absl::OkStatus(), indexes).ok());
}

}  // namespace
}  // namespace kvq
