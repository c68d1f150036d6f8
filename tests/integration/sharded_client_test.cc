// ShardedKvqClient against three real kvq-server processes on loopback:
// spread, prefix placement, one replica killed (SIGKILL) while the others
// keep serving, a replica dropped from the list, and one added.
#include <signal.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "client/replica_set.h"
#include "client/sharded_client.h"
#include "client/sharded_decode_session.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 1, kQHeads = 2, kDim = 32, kTokens = 40;

class ShardedClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 3; ++i) {
      servers_.push_back(std::make_unique<ServerProcess>(KVQ_SERVER_BIN));
      ASSERT_TRUE(servers_.back()->Start({"--capacity_bytes=67108864"}).ok());
      addresses_.push_back(servers_.back()->address());
    }
    config_.layout = {kLayers, kHeads, kQHeads, kDim, {}};
    config_.scheme = "fp16";  // Exact round trips: values are checked bit for bit.
  }

  std::unique_ptr<ShardedKvqClient> Connect(const std::vector<std::string>& replicas) {
    ShardOptions options;
    options.client.ns = "shard";
    options.client.deadline = absl::Seconds(5);
    options.client.retry.max_attempts = 2;
    options.id_seed = 20261206;  // Reproducible ids, hence reproducible counts.
    auto set = ReplicaSet::FromTargets(replicas);
    EXPECT_TRUE(set.ok()) << set.status();
    auto client = ShardedKvqClient::Connect(std::shared_ptr<ReplicaSet>(*std::move(set)), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(*client);
  }

  std::string Create(ShardedKvqClient& c, std::vector<int32_t> prompt = {}) {
    CreateOptions create;
    create.config = config_;
    create.prompt_token_ids = std::move(prompt);
    absl::StatusOr<SequenceInfo> info = c.CreateSequence(create);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->sequence_id : "";
  }

  // Server-wide sequence count per address.
  std::map<std::string, int64_t> Counts(ShardedKvqClient& c) {
    std::map<std::string, int64_t> out;
    for (const ReplicaStats& r : c.StatsAll()) {
      if (r.stats.ok()) out[r.replica] = r.stats->sequences();
    }
    return out;
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<std::string> addresses_;
  SequenceConfig config_;
};

TEST_F(ShardedClientTest, SequencesSpreadEvenlyAndPrefixesMeet) {
  auto c = Connect(addresses_);
  // The servers' ports, hence their names and the placements, differ from
  // run to run: 1800 sequences put a 15 % band at 4.5 standard deviations
  // of a replica's count, so the check does not fail by chance.
  constexpr int kSequences = 1800;
  std::map<std::string, int> placed;
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = Create(*c);
    ++placed[c->ReplicaOf(id).value()];
  }
  // Every server holds what the client placed on it, within 15 % of even.
  const std::map<std::string, int64_t> counts = Counts(*c);
  ASSERT_EQ(counts.size(), 3u);
  for (const std::string& a : addresses_) {
    EXPECT_EQ(counts.at(a), placed[a]) << a;
    EXPECT_GE(counts.at(a), kSequences / 3 * 0.85) << a;
    EXPECT_LE(counts.at(a), kSequences / 3 * 1.15) << a;
  }

  // Prompts that share their first 32 tokens meet on one replica, where the
  // second and later ones reuse the first one's stored prefix. fp16 pages
  // hold 32 tokens: a 64-token prompt registers two blocks.
  std::vector<int32_t> prompt(64);
  for (int t = 0; t < 64; ++t) prompt[t] = 1000 + t;
  const std::string first = Create(*c, prompt);
  HostTensor k = Random({kLayers, kHeads, 64, kDim}, 1), v = Random({kLayers, kHeads, 64, kDim}, 2);
  absl::StatusOr<AppendResult> appended = c->AppendPrompt(first, k, v);  // The ids came with the create.
  ASSERT_TRUE(appended.ok()) << appended.status();
  for (int i = 0; i < 8; ++i) {
    std::vector<int32_t> p = prompt;
    p.push_back(i);  // Each continues the shared prompt differently.
    CreateOptions create;
    create.config = config_;
    create.prompt_token_ids = p;
    absl::StatusOr<SequenceInfo> info = c->CreateSequence(create);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(c->ReplicaOf(info->sequence_id).value(), c->ReplicaOf(first).value());
    EXPECT_EQ(info->num_tokens, 64) << "the shared prefix was not reused";
  }
  // The read-only probe asks the prefix's replica: it sees the prefix.
  std::vector<int32_t> longer = prompt;
  longer.push_back(99);
  absl::StatusOr<PrefixMatch> match = c->MatchPrefix(config_, longer);
  ASSERT_TRUE(match.ok()) << match.status();
  EXPECT_EQ(match->matched_tokens, 64);
}

TEST_F(ShardedClientTest, AKilledReplicaCostsOnlyItsOwnSequences) {
  auto c = Connect(addresses_);
  constexpr int kSequences = 30;
  std::vector<std::string> ids;
  std::map<std::string, HostTensor> keys;
  for (int i = 0; i < kSequences; ++i) {
    ids.push_back(Create(*c));
    HostTensor k = Random({kLayers, kHeads, kTokens, kDim}, 10 + i);
    HostTensor v = Random({kLayers, kHeads, kTokens, kDim}, 100 + i);
    ASSERT_TRUE(c->AppendPrompt(ids.back(), k, v).ok());
    keys[ids.back()] = k.Cast(DType::kFloat16);
  }
  // One query per sequence, attended across all three replicas at once.
  const HostTensor q_all = Random({kSequences, kQHeads, kDim}, 1000);
  const size_t q_row = q_all.byte_size() / kSequences;
  std::vector<AttendQuery> queries;
  for (int i = 0; i < kSequences; ++i) {
    HostTensor q = HostTensor::Zeros(DType::kFloat32, {1, kQHeads, kDim});
    q.data = q_all.data.substr(i * q_row, q_row);
    queries.push_back({ids[i], q, {}, 0, 0});
  }
  absl::StatusOr<std::vector<AttendOutput>> before = c->Attend(1, queries);
  ASSERT_TRUE(before.ok()) << before.status();
  // The packed form, split per replica and merged back: the same rows.
  absl::StatusOr<AttendOutput> packed = c->AttendBatch(1, ids, q_all);
  ASSERT_TRUE(packed.ok()) << packed.status();
  ASSERT_EQ(packed->out.shape, (std::vector<int64_t>{kSequences, kQHeads, kDim}));
  const size_t out_row = packed->out.byte_size() / kSequences;
  const size_t lse_row = packed->lse.byte_size() / kSequences;
  for (int i = 0; i < kSequences; ++i) {
    EXPECT_EQ(packed->out.data.substr(i * out_row, out_row), (*before)[i].out.data) << i;
    EXPECT_EQ(packed->lse.data.substr(i * lse_row, lse_row), (*before)[i].lse.data) << i;
  }

  // A decode step on one session over all three replicas, items in
  // reverse order: each result is its own sequence's attention over its
  // tokens and the new one (as Attend computes it).
  std::unique_ptr<ShardedDecodeSession> session = c->OpenDecodeSession(absl::Seconds(60));
  std::vector<AppendAttendItem> step;
  for (int i = kSequences - 1; i >= 0; --i) {
    step.push_back({ids[i], Random({kHeads, 1, kDim}, 2000 + i), Random({kHeads, 1, kDim}, 3000 + i),
                    Random({1, kQHeads, kDim}, 4000 + i)});
  }
  absl::StatusOr<std::vector<AttendOutput>> stepped = session->Step(0, step);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  for (size_t j = 0; j < step.size(); ++j) {
    absl::StatusOr<std::vector<AttendOutput>> ref =
        c->Attend(0, {{step[j].sequence_id, step[j].q, {kTokens}, 0, 0}});
    ASSERT_TRUE(ref.ok()) << ref.status();
    const std::vector<float> got = (*stepped)[j].out.ToFloats(), want = (*ref)[0].out.ToFloats();
    ASSERT_EQ(got.size(), want.size());
    for (size_t e = 0; e < got.size(); ++e) ASSERT_NEAR(got[e], want[e], 1e-4) << j;
  }

  const std::string victim = addresses_[1];
  std::vector<std::string> lost, kept;
  for (const std::string& id : ids) (c->ReplicaOf(id).value() == victim ? lost : kept).push_back(id);
  ASSERT_FALSE(lost.empty());
  ASSERT_FALSE(kept.empty());
  ASSERT_EQ(kill(servers_[1]->pid(), SIGKILL), 0);

  // Its sequences: UNAVAILABLE (retried once, each attempt within the 5 s
  // deadline), naming the replica.
  for (const std::string& id : lost) {
    absl::StatusOr<FetchedKv> f = c->FetchDequant(id);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kUnavailable) << f.status();
    EXPECT_TRUE(absl::StrContains(f.status().message(), absl::StrCat("(replica ", victim, ")")))
        << f.status();
  }
  // The others' keep their exact values.
  for (const std::string& id : kept) {
    absl::StatusOr<FetchedKv> f = c->FetchDequant(id);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE(f->k == keys[id]) << id;
  }
  // A batch over all replicas: the survivors' items answer as before, the
  // victim's items say UNAVAILABLE; the plain form returns that failure.
  std::vector<absl::StatusOr<AttendOutput>> each = c->AttendEach(1, queries);
  ASSERT_EQ(each.size(), queries.size());
  for (int i = 0; i < kSequences; ++i) {
    if (c->ReplicaOf(ids[i]).value() == victim) {
      EXPECT_EQ(each[i].status().code(), absl::StatusCode::kUnavailable) << i;
    } else {
      ASSERT_TRUE(each[i].ok()) << each[i].status();
      EXPECT_TRUE(each[i]->out == (*before)[i].out) << i;
      EXPECT_TRUE(each[i]->lse == (*before)[i].lse) << i;
    }
  }
  EXPECT_EQ(c->Attend(1, queries).status().code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<PartialBatchOutput> partial = c->AttendBatchEach(1, ids, q_all);
  ASSERT_TRUE(partial.ok()) << partial.status();
  for (int i = 0; i < kSequences; ++i) {
    const bool on_victim = c->ReplicaOf(ids[i]).value() == victim;
    EXPECT_EQ(partial->status[i].code(),
              on_victim ? absl::StatusCode::kUnavailable : absl::StatusCode::kOk) << i;
    EXPECT_EQ(partial->output.out.data.substr(i * out_row, out_row),
              on_victim ? std::string(out_row, '\0') : (*before)[i].out.data) << i;
  }

  // The session: the victim's items fail, the survivors' streams go on,
  // step after step.
  for (int round = 0; round < 2; ++round) {
    std::vector<absl::StatusOr<AttendOutput>> r = session->StepEach(0, step);
    ASSERT_EQ(r.size(), step.size());
    for (size_t j = 0; j < step.size(); ++j) {
      const bool on_victim = c->ReplicaOf(step[j].sequence_id).value() == victim;
      EXPECT_EQ(r[j].status().code(),
                on_victim ? absl::StatusCode::kUnavailable : absl::StatusCode::kOk)
          << round << " " << j << " " << r[j].status();
    }
  }
  EXPECT_EQ(session->Close().code(), absl::StatusCode::kOk);

  // New sequences go to the survivors, though the victim is still listed.
  const std::map<std::string, int64_t> counts_before = Counts(*c);
  for (int i = 0; i < 60; ++i) {
    const std::string id = Create(*c);
    EXPECT_NE(c->ReplicaOf(id).value(), victim);
  }
  const std::map<std::string, int64_t> counts_after = Counts(*c);
  EXPECT_EQ(counts_after.at(addresses_[0]) + counts_after.at(addresses_[2]),
            counts_before.at(addresses_[0]) + counts_before.at(addresses_[2]) + 60);

  // DNS drops the victim: the survivors' sequences stay where they are; the
  // victim's now route to a survivor that never had them: NOT_FOUND.
  ASSERT_TRUE(c->replica_set().Set({addresses_[0], addresses_[2]}).ok());
  for (const std::string& id : kept) {
    EXPECT_TRUE(c->FetchDequant(id).ok()) << id;
  }
  for (const std::string& id : lost) {
    EXPECT_EQ(c->Stats(id).status().code(), absl::StatusCode::kNotFound) << id;
  }
}

TEST_F(ShardedClientTest, AReplicaAddedLaterStillFindsEarlierSequences) {
  // Two replicas listed; the third joins after the sequences were created,
  // winning about a third of their ids. Calls find them where they are.
  auto c = Connect({addresses_[0], addresses_[1]});
  std::vector<std::string> ids;
  std::vector<AppendAttendItem> step;
  for (int i = 0; i < 36; ++i) {  // (2/3)^36: the new replica wins one of them.
    ids.push_back(Create(*c));
    ASSERT_TRUE(c->AppendPrompt(ids.back(), Random({kLayers, kHeads, kTokens, kDim}, i),
                                Random({kLayers, kHeads, kTokens, kDim}, 50 + i))
                    .ok());
    step.push_back({ids.back(), Random({kHeads, 1, kDim}, 200 + i),
                    Random({kHeads, 1, kDim}, 300 + i), Random({1, kQHeads, kDim}, 400 + i)});
  }
  ASSERT_TRUE(c->replica_set().Set(addresses_).ok());
  int now_elsewhere = 0;
  for (const std::string& id : ids) {
    const std::string winner = c->ReplicaOf(id).value();
    now_elsewhere += winner == addresses_[2];
  }
  ASSERT_GT(now_elsewhere, 0);
  // A batched decode step over all of them: one token appended to each.
  absl::StatusOr<std::vector<AttendOutput>> out = c->AppendAttend(0, step);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const std::string& id : ids) {
    absl::StatusOr<v1::StatsResponse> s = c->Stats(id);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_NE(c->ReplicaOf(id).value(), addresses_[2]);
  }
  EXPECT_EQ(Counts(*c).at(addresses_[2]), 0);
}

TEST_F(ShardedClientTest, CliRoutesIdsLikeTheLibrary) {
  auto c = Connect(addresses_);
  const std::string cli = absl::StrCat(KVQ_CLI_BIN, " --namespace=shard --dns=localhost:1 ",
                                       "--targets=", addresses_[0], ",", addresses_[1], ",",
                                       addresses_[2]);
  std::string out;
  // Both list sources at once is a usage error.
  EXPECT_EQ(RunCommand(cli + " info", &out), 2) << out;
  EXPECT_TRUE(absl::StrContains(out, "give --targets or --dns, not both")) << out;
  const std::string targets = absl::StrCat(KVQ_CLI_BIN, " --namespace=shard --targets=",
                                           addresses_[0], ",", addresses_[1], ",", addresses_[2]);
  std::map<std::string, int> where;
  for (int i = 0; i < 6; ++i) {
    ASSERT_EQ(RunCommand(targets + " create --layers=2 --kv_heads=1 --head_dim=32 --scheme=fp16",
                         &out),
              0)
        << out;
    const size_t at = out.find("sequence_id: ");
    ASSERT_NE(at, std::string::npos) << out;
    const std::string id = out.substr(at + 13, out.find('\n', at) - at - 13);
    // The library finds it where the CLI put it, and the CLI finds it too.
    absl::StatusOr<v1::StatsResponse> s = c->Stats(id);
    ASSERT_TRUE(s.ok()) << s.status();
    ++where[c->ReplicaOf(id).value()];
    ASSERT_EQ(RunCommand(absl::StrCat(targets, " stats --id=", id), &out), 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "scheme: fp16")) << out;
  }
  // Server-wide stats: one block per replica, counting what was placed.
  ASSERT_EQ(RunCommand(targets + " stats", &out), 0) << out;
  for (const std::string& a : addresses_) {
    EXPECT_TRUE(absl::StrContains(out, absl::StrCat("replica: ", a, "\ncapacity_bytes: ")))
        << out;
  }
  EXPECT_EQ(Counts(*c).at(addresses_[0]), where[addresses_[0]]);
}

}  // namespace
}  // namespace kvq
