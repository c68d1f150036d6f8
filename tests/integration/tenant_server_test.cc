// Tenants on the real kvq-server (--tokens_file): bearer tokens, quotas,
// rate limits, reloads, per-tenant metrics, and the cross-tenant probe:
// tenant B calls every RPC with tenant A's ids and gets exactly the answer
// of an id never used, while A's data stays byte-identical.
#include <cstdio>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_helpers.h"
#include "tests/service/temp_tokens_file.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64;
constexpr char kTokenA[] = "tenant-a-token-0123456789";
constexpr char kTokenB[] = "tenant-b-token-9876543210";
constexpr char kTokenSmall[] = "tenant-small-token-000000";
constexpr char kTokenSlow[] = "tenant-slow-token-0000000";
constexpr char kTokenC[] = "tenant-c-token-5555555555";

SequenceConfig Config(const std::string& scheme = "kivi2:g32:r128") {
  SequenceConfig c;
  c.layout = {kLayers, kHeads, kQHeads, kDim, {}};
  c.scheme = scheme;
  return c;
}

// Creates `id` through `client` with a prompt of `tokens` random tokens (K
// drawn from `seed`, V from seed + 1).
void CreateWithPrompt(KvqClient* client, const std::string& id, int tokens, uint32_t seed) {
  CreateOptions create;
  create.sequence_id = id;
  create.config = Config();
  ASSERT_TRUE(client->CreateSequence(create).ok());
  ASSERT_TRUE(client
                  ->AppendPrompt(id, Random({kLayers, kHeads, tokens, kDim}, seed),
                                 Random({kLayers, kHeads, tokens, kDim}, seed + 1))
                  .ok());
}

std::string TokensText(const std::string& extra = "") {
  return absl::StrCat("# the tenants of this test\n", "tenant=a token=", kTokenA, "\n",
                      "tenant=b token=", kTokenB, "\n", "tenant=small token=", kTokenSmall,
                      " quota_bytes=1048576\n", "tenant=slow token=", kTokenSlow,
                      " rate_rps=0.001 burst=3\n", extra);
}

class TenantServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(file_.Create("kvq-tenants-it-"));
    tokens_ = file_.path();
    Write(TokensText());
    server_ = std::make_unique<ServerProcess>(KVQ_SERVER_BIN);
    ASSERT_TRUE(server_->Start({"--tokens_file=" + tokens_, "--tokens_reload_ms=50"}).ok());
  }
  void TearDown() override { server_.reset(); }
  void Write(const std::string& text) {
    // Write then rename: the server never reads a half-written file.
    const std::string tmp = tokens_ + ".tmp";
    std::ofstream(tmp, std::ios::trunc) << text;
    ASSERT_EQ(std::rename(tmp.c_str(), tokens_.c_str()), 0);
  }
  std::unique_ptr<KvqClient> Client(const std::string& token, const std::string& ns = "ns") {
    ClientOptions o;
    o.target = server_->address();
    o.ns = ns;
    o.token = token;
    o.retry.max_attempts = 1;
    absl::StatusOr<std::unique_ptr<KvqClient>> c = KvqClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }

  TempTokensFile file_;  // The server's --tokens_file; removed after the server stops.
  std::string tokens_;
  std::unique_ptr<ServerProcess> server_;
};

TEST_F(TenantServerTest, MissingOrBadTokenIsUnauthenticated) {
  std::unique_ptr<KvqClient> none = Client("");
  const absl::Status missing = absl::UnauthenticatedError(
      "this server needs \"authorization: Bearer <token>\" metadata on every call");
  EXPECT_EQ(none->GetServerInfo().status(), missing);
  CreateOptions create;
  create.config = Config();
  EXPECT_EQ(none->CreateSequence(create).status(), missing);
  EXPECT_EQ(none->FetchDequant("x").status(), missing);
  EXPECT_EQ(none->AppendPrompt("x", Random({kLayers, kHeads, 4, kDim}, 1),
                               Random({kLayers, kHeads, 4, kDim}, 2))
                .status(),
            missing);
  std::unique_ptr<DecodeSession> session = *none->OpenDecodeSession(absl::Seconds(30));
  EXPECT_EQ(session
                ->Step(0, {{"x", Random({kHeads, 1, kDim}, 3), Random({kHeads, 1, kDim}, 4),
                            Random({1, kQHeads, kDim}, 5)}})
                .status(),
            missing);

  const absl::Status invalid = absl::UnauthenticatedError("the bearer token is not valid");
  EXPECT_EQ(Client("tenant-a-token-0123456788")->GetServerInfo().status(), invalid);
  EXPECT_EQ(Client("x")->Stats().status(), invalid);
  EXPECT_TRUE(Client(kTokenA)->GetServerInfo().ok());
}

TEST_F(TenantServerTest, CliSendsItsTokenFromAFileOrAFlag) {
  const std::string token_file = file_.dir() + "/a.token";
  std::ofstream(token_file) << "  " << kTokenA << "\n";
  const std::string cli =
      absl::StrCat(KVQ_CLI_BIN, " --server=", server_->address(), " --retries=0");
  std::string out;
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " --token_file=", token_file, " stats"), &out), 0) << out;
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " --token=", kTokenA, " info"), &out), 0) << out;
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " stats"), &out), 1) << out;
  EXPECT_TRUE(absl::StrContains(
      out, "UNAUTHENTICATED: this server needs \"authorization: Bearer <token>\" metadata"))
      << out;
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " --token=x --token_file=", token_file, " stats"), &out),
            2)
      << out;
  EXPECT_TRUE(absl::StrContains(out, "give --token or --token_file, not both")) << out;
  std::remove(token_file.c_str());
}

TEST_F(TenantServerTest, QuotaRefusesAWholeAppendAndNamesTheTenantQuotaAndUse) {
  std::unique_ptr<KvqClient> small = Client(kTokenSmall);
  CreateOptions create;
  create.sequence_id = "s";
  create.config = Config("fp16");
  ASSERT_TRUE(small->CreateSequence(create).ok());
  // fp16: 1 KiB per token over 2 layers x 2 heads x 64 channels x K and V.
  const HostTensor k = Random({kLayers, kHeads, 256, kDim}, 10);
  const HostTensor v = Random({kLayers, kHeads, 256, kDim}, 11);
  ASSERT_TRUE(small->AppendPrompt("s", k, v).ok());
  absl::StatusOr<FetchedKv> before = small->FetchDequant("s");
  ASSERT_TRUE(before.ok()) << before.status();
  const int64_t used = small->Stats()->used_bytes();
  EXPECT_GE(used, 256 * 1024);
  EXPECT_EQ(small->Stats()->capacity_bytes(), 1048576);

  const absl::Status st = small
                              ->AppendPrompt("s", Random({kLayers, kHeads, 1024, kDim}, 12),
                                             Random({kLayers, kHeads, 1024, kDim}, 13))
                              .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(std::regex_match(
      std::string(st.message()),
      std::regex("tenant \"small\" is over its quota: quota_bytes = 1048576, used [0-9]+ bytes, "
                 "this needs [0-9]+ more")))
      << st;
  // Nothing of the refused append is stored.
  EXPECT_EQ(small->Stats("s")->num_tokens(), 256);
  EXPECT_EQ(small->Stats()->used_bytes(), used);
  absl::StatusOr<FetchedKv> after = small->FetchDequant("s");
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->k == before->k);
  EXPECT_TRUE(after->v == before->v);
  // Another tenant is not bound by it.
  std::unique_ptr<KvqClient> a = Client(kTokenA);
  ASSERT_TRUE(a->CreateSequence(create).ok());
  EXPECT_TRUE(a->AppendPrompt("s", Random({kLayers, kHeads, 1024, kDim}, 12),
                              Random({kLayers, kHeads, 1024, kDim}, 13))
                  .ok());
}

TEST_F(TenantServerTest, RateLimitNamesTheLimit) {
  std::unique_ptr<KvqClient> slow = Client(kTokenSlow);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(slow->GetServerInfo().ok()) << i;
  EXPECT_EQ(slow->Stats().status(),
            absl::ResourceExhaustedError(
                "tenant \"slow\" is over its rate limit: rate_rps = 0.001, burst = 3"));
  EXPECT_TRUE(Client(kTokenA)->Stats().ok()) << "one tenant's rate does not limit another";
}

TEST_F(TenantServerTest, ReloadAddsAndRemovesTenantsAndKeepsTheTableOnABadFile) {
  std::unique_ptr<KvqClient> a = Client(kTokenA);
  std::unique_ptr<KvqClient> b = Client(kTokenB);
  std::unique_ptr<KvqClient> c = Client(kTokenC);
  CreateOptions create;
  create.sequence_id = "kept";
  create.config = Config();
  ASSERT_TRUE(a->CreateSequence(create).ok());
  EXPECT_EQ(c->GetServerInfo().status().code(), absl::StatusCode::kUnauthenticated);

  // c added, b removed, while the server runs.
  Write(absl::StrCat("tenant=a token=", kTokenA, "\ntenant=c token=", kTokenC, "\n"));
  ASSERT_TRUE(PollUntil([&] { return c->GetServerInfo().ok(); })) << server_->Stdout();
  EXPECT_EQ(b->GetServerInfo().status(),
            absl::UnauthenticatedError("the bearer token is not valid"));
  EXPECT_EQ(a->Stats("kept")->sequences(), 1) << "a's sequences survive the reload";

  // A file that does not parse: logged, the table stays.
  Write(absl::StrCat("tenant=a token=", kTokenA, "\ntenant=d\n"));
  ASSERT_TRUE(PollUntil([&] {
    return absl::StrContains(server_->Stdout(),
                             "tokens file not reloaded, the previous table stays: tokens file "
                             "line 2: token is missing");
  })) << server_->Stdout();
  EXPECT_TRUE(c->GetServerInfo().ok());
  EXPECT_TRUE(a->GetServerInfo().ok());
}

TEST_F(TenantServerTest, MetricsCarryTheTenantButNeverTokensOrSequenceIds) {
  std::unique_ptr<KvqClient> a = Client(kTokenA);
  ASSERT_NO_FATAL_FAILURE(CreateWithPrompt(a.get(), "metrics-secret-id", 64, 1));
  EXPECT_EQ(a->FetchDequant("never").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::string> address = server_->MetricsAddress();
  ASSERT_TRUE(address.ok()) << address.status();
  std::string body;
  ASSERT_EQ(RunCommand(absl::StrCat("python3 -c \"import urllib.request,sys; "
                                    "sys.stdout.write(urllib.request.urlopen('http://",
                                    *address, "/metrics', timeout=30).read().decode())\""),
                       &body),
            0)
      << body;
  EXPECT_TRUE(absl::StrContains(body, "kvq_tenant_requests_total{code=\"OK\",tenant=\"a\"} 2"))
      << body;
  EXPECT_TRUE(
      absl::StrContains(body, "kvq_tenant_requests_total{code=\"NOT_FOUND\",tenant=\"a\"} 1"))
      << body;
  EXPECT_TRUE(std::regex_search(body, std::regex("kvq_tenant_used_bytes\\{tenant=\"a\"\\} [1-9]")))
      << body;
  EXPECT_TRUE(absl::StrContains(body, "kvq_tenant_quota_bytes{tenant=\"small\"} 1048576")) << body;
  EXPECT_TRUE(absl::StrContains(body, "kvq_tenant_rpc_duration_seconds_count{tenant=\"a\"} 3"))
      << body;
  EXPECT_FALSE(absl::StrContains(body, "metrics-secret-id"));
  for (const char* token : {kTokenA, kTokenB, kTokenSmall, kTokenSlow}) {
    EXPECT_FALSE(absl::StrContains(body, token));
  }
}

// ------------------------------------------------------- cross-tenant probe

// What one RPC answers for a sequence id.
using Probe = std::function<absl::Status(KvqClient&, const std::string& id)>;

TEST_F(TenantServerTest, AnotherTenantsIdsAnswerLikeIdsNeverUsed) {
  std::unique_ptr<KvqClient> a = Client(kTokenA);
  std::unique_ptr<KvqClient> b = Client(kTokenB);
  // A: a sequence with a prompt (and its token ids), a fork, a released one.
  CreateOptions create;
  create.sequence_id = "a-seq";
  create.config = Config();
  ASSERT_TRUE(a->CreateSequence(create).ok());
  AppendOptions append;
  for (int i = 0; i < 300; ++i) append.token_ids.push_back(100 + i);
  ASSERT_TRUE(a->AppendPrompt("a-seq", Random({kLayers, kHeads, 300, kDim}, 20),
                              Random({kLayers, kHeads, 300, kDim}, 21), append)
                  .ok());
  ForkOptions fork;
  fork.new_sequence_id = "a-fork";
  ASSERT_TRUE(a->Fork("a-seq", fork).ok());
  create.sequence_id = "a-released";
  ASSERT_TRUE(a->CreateSequence(create).ok());
  ASSERT_TRUE(a->Release("a-released").ok());
  absl::StatusOr<FetchedKv> a_before = a->FetchDequant("a-seq");
  ASSERT_TRUE(a_before.ok());
  absl::StatusOr<FetchedKv> fork_before = a->FetchDequant("a-fork");
  ASSERT_TRUE(fork_before.ok());
  const v1::StatsResponse a_stats = *a->Stats();

  // B sees an empty server.
  absl::StatusOr<v1::StatsResponse> b_stats = b->Stats();
  ASSERT_TRUE(b_stats.ok());
  EXPECT_EQ(b_stats->sequences(), 0);
  EXPECT_EQ(b_stats->used_bytes(), 0);
  EXPECT_EQ(b_stats->bytes().total(), 0);
  EXPECT_EQ(b_stats->pages_total(), 0);

  const HostTensor q = Random({1, kQHeads, kDim}, 30);
  const HostTensor k1 = Random({kHeads, 1, kDim}, 31);
  const HostTensor v1 = Random({kHeads, 1, kDim}, 32);
  const std::vector<std::pair<std::string, Probe>> probes = {
      {"FetchDequant",
       [](KvqClient& c, const std::string& id) { return c.FetchDequant(id).status(); }},
      {"FetchRaw", [](KvqClient& c, const std::string& id) { return c.FetchRaw(id).status(); }},
      {"Attend",
       [&](KvqClient& c, const std::string& id) {
         return c.Attend(0, {AttendQuery{id, q, {}, 0, 0}}).status();
       }},
      {"AppendAttend",
       [&](KvqClient& c, const std::string& id) {
         return c.AppendAttend(0, {AppendAttendItem{id, k1, v1, q}}).status();
       }},
      {"DecodeStream",
       [&](KvqClient& c, const std::string& id) {
         absl::StatusOr<std::unique_ptr<DecodeSession>> s = c.OpenDecodeSession(absl::Seconds(30));
         if (!s.ok()) return s.status();
         return (*s)->Step(0, {AppendAttendItem{id, k1, v1, q}}).status();
       }},
      {"Append",
       [](KvqClient& c, const std::string& id) {
         return c
             .AppendPrompt(id, Random({kLayers, kHeads, 8, kDim}, 40),
                           Random({kLayers, kHeads, 8, kDim}, 41))
             .status();
       }},
      {"Fork",
       [](KvqClient& c, const std::string& id) {
         ForkOptions f;
         f.new_sequence_id = "b-copy";
         return c.Fork(id, f).status();
       }},
      {"Stats", [](KvqClient& c, const std::string& id) { return c.Stats(id).status(); }},
      {"Release", [](KvqClient& c, const std::string& id) { return c.Release(id).status(); }},
  };
  int probed = 0;
  for (const std::string& id : {"a-seq", "a-fork", "a-released"}) {
    for (const auto& [rpc, probe] : probes) {
      SCOPED_TRACE(absl::StrCat(rpc, " of ", id));
      const absl::Status foreign = probe(*b, id);
      const std::string never_id = absl::StrCat("zz-", id);  // Same length class, never used.
      const absl::Status never = probe(*b, never_id);
      EXPECT_EQ(never.code(), absl::StatusCode::kNotFound) << never;
      EXPECT_EQ(foreign.code(), never.code()) << foreign;
      EXPECT_EQ(foreign.message(), absl::StrReplaceAll(never.message(), {{never_id, id}}));
      ++probed;
    }
  }
  EXPECT_EQ(probed, 27);

  // B may create its own sequence of A's id: it lives in B's namespace.
  create.sequence_id = "a-seq";
  absl::StatusOr<SequenceInfo> own = b->CreateSequence(create);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(b->Stats("a-seq")->num_tokens(), 0);
  EXPECT_EQ(b->Stats()->sequences(), 1);
  ASSERT_TRUE(b->Release("a-seq").ok());
  // And reusing A's prompt ids finds no prefix of A's.
  create.sequence_id = "b-prompt";
  create.prompt_token_ids = append.token_ids;
  absl::StatusOr<SequenceInfo> reused = b->CreateSequence(create);
  ASSERT_TRUE(reused.ok());
  EXPECT_EQ(reused->num_tokens, 0);

  // A's data is byte-identical, its figures unchanged.
  absl::StatusOr<FetchedKv> a_after = a->FetchDequant("a-seq");
  ASSERT_TRUE(a_after.ok()) << a_after.status();
  EXPECT_TRUE(a_after->k == a_before->k);
  EXPECT_TRUE(a_after->v == a_before->v);
  absl::StatusOr<FetchedKv> fork_after = a->FetchDequant("a-fork");
  ASSERT_TRUE(fork_after.ok());
  EXPECT_TRUE(fork_after->k == fork_before->k);
  EXPECT_TRUE(fork_after->v == fork_before->v);
  const v1::StatsResponse a_stats_after = *a->Stats();
  EXPECT_EQ(a_stats_after.sequences(), a_stats.sequences());
  EXPECT_EQ(a_stats_after.used_bytes(), a_stats.used_bytes());
  EXPECT_EQ(a_stats_after.bytes().total(), a_stats.bytes().total());
  EXPECT_EQ(a->Release("a-released").status().message(),
            "sequence \"a-released\" in namespace \"ns\" was already released");
}

TEST_F(TenantServerTest, RawFetchOfATenantsPagesGivesEveryByteBackOnRelease) {
  // Raw fetch messages reference the tenant's pages until gRPC has sent
  // them; the last reference, wherever it goes, uncharges the tenant.
  std::unique_ptr<KvqClient> a = Client(kTokenA);
  ASSERT_NO_FATAL_FAILURE(CreateWithPrompt(a.get(), "raw", 640, 50));
  ForkOptions fork;
  fork.new_sequence_id = "raw-fork";
  ASSERT_TRUE(a->Fork("raw", fork).ok());
  for (const char* id : {"raw", "raw-fork"}) {
    absl::StatusOr<RawFetch> raw = a->FetchRaw(id);
    ASSERT_TRUE(raw.ok()) << raw.status();
    EXPECT_GT(raw->wire_bytes, 0);
  }
  EXPECT_GT(a->Stats()->used_bytes(), 0);
  ASSERT_TRUE(a->Release("raw").ok());
  ASSERT_TRUE(a->Release("raw-fork").ok());
  int64_t used = -1;
  EXPECT_TRUE(PollUntil([&] {
    used = a->Stats()->used_bytes();
    return used == 0;
  })) << used;
}

// MatchPrefix, the read-only prefix probe: the count CreateSequence would
// reuse, for the caller's tenant only, nothing changed by it, and the codes
// of bad fields.
TEST_F(TenantServerTest, MatchPrefixAnswersOwnTenantsPrefixAndChangesNothing) {
  std::unique_ptr<KvqClient> a = Client(kTokenA), b = Client(kTokenB);
  std::vector<int32_t> prompt(600);
  for (int i = 0; i < 600; ++i) prompt[i] = 1000 + 7 * i;
  CreateOptions create;
  create.sequence_id = "src";
  create.config = Config();
  create.prompt_token_ids = prompt;
  ASSERT_TRUE(a->CreateSequence(create).ok());
  ASSERT_TRUE(a->AppendPrompt("src", Random({kLayers, kHeads, 600, kDim}, 1),
                              Random({kLayers, kHeads, 600, kDim}, 2))
                  .ok());

  // kivi2:g32:r128 (no sink): blocks of 128 tokens, 4 of them stored whole.
  absl::StatusOr<PrefixMatch> m = a->MatchPrefix(Config(), prompt);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->matched_tokens, 512);
  EXPECT_EQ(m->block_tokens, 128);
  std::vector<int32_t> head(prompt.begin(), prompt.begin() + 300);
  EXPECT_EQ(a->MatchPrefix(Config(), head)->matched_tokens, 256);
  EXPECT_EQ(a->MatchPrefix(Config("kivi4:g32:r128"), prompt)->matched_tokens, 0);
  EXPECT_EQ(Client(kTokenA, "other-ns")->MatchPrefix(Config(), prompt)->matched_tokens, 0);

  // Tenant B, same namespace and prompt: exactly the answer of a prompt
  // never stored.
  absl::StatusOr<PrefixMatch> foreign = b->MatchPrefix(Config(), prompt);
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  EXPECT_EQ(foreign->matched_tokens, 0);
  EXPECT_EQ(foreign->block_tokens, 128);

  // Probes change nothing: the server's figures and A's are as they were.
  const v1::StatsResponse before = *a->Stats();
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(a->MatchPrefix(Config(), prompt).ok());
  const v1::StatsResponse after = *a->Stats();
  EXPECT_EQ(after.sequences(), before.sequences());
  EXPECT_EQ(after.used_bytes(), before.used_bytes());
  EXPECT_EQ(after.pages_used(), before.pages_used());
  EXPECT_EQ(after.bytes().total(), before.bytes().total());
  // And CreateSequence reuses what the probe announced.
  create.sequence_id = "reuse";
  absl::StatusOr<SequenceInfo> reused = a->CreateSequence(create);
  ASSERT_TRUE(reused.ok()) << reused.status();
  EXPECT_EQ(reused->num_tokens, m->matched_tokens);

  // Bad fields, sent raw (the client checks its config first).
  auto stub = v1::KvCache::NewStub(
      grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  v1::MatchPrefixRequest req;
  req.set_namespace_("ns");
  req.mutable_layout()->set_num_layers(kLayers);
  req.mutable_layout()->set_num_kv_heads(kHeads);
  req.mutable_layout()->set_num_q_heads(kQHeads);
  req.mutable_layout()->set_head_dim(kDim);
  req.set_scheme("kivi2:g32:r128");
  v1::MatchPrefixResponse resp;
  {
    grpc::ClientContext ctx;  // No token.
    EXPECT_EQ(stub->MatchPrefix(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  const auto call = [&](const v1::MatchPrefixRequest& r) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kTokenA));
    return stub->MatchPrefix(&ctx, r, &resp);
  };
  EXPECT_TRUE(call(req).ok());
  v1::MatchPrefixRequest bad = req;
  bad.set_scheme("kivi2:" + std::string(10000, 'x'));
  grpc::Status st = call(bad);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message().substr(0, 300);
  EXPECT_LT(st.error_message().size(), 400u) << st.error_message().substr(0, 400);
  bad = req;
  bad.mutable_layout()->set_head_dim(0);
  st = call(bad);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "head_dim")) << st.error_message();
  bad = req;
  bad.set_namespace_(std::string(1000, 'n'));
  st = call(bad);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "namespace")) << st.error_message();
  EXPECT_LT(st.error_message().size(), 400u);
}

}  // namespace
}  // namespace kvq
