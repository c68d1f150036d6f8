// Concurrent writers on one sequence through the real kvq-server: the rule
// of proto/kvq/v1/kvq.proto's "Concurrent calls on one sequence". While an
// Append stream holds a sequence, a second writer is refused ABORTED and
// the open stream commits exactly what it sent; reads and forks see the
// committed tokens only; a Release wins over the open stream.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "tests/integration/history/payload.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_helpers.h"

namespace kvq {
namespace {

using history::TokenRef;

constexpr char kNs[] = "writers";

class ConcurrentWritersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<ServerProcess>(KVQ_SERVER_BIN);
    absl::Status st = server_->Start({});
    ASSERT_TRUE(st.ok()) << st;
    stub_ = v1::KvCache::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }

  v1::SequenceRef Ref(const std::string& id) {
    v1::SequenceRef r;
    r.set_namespace_(kNs);
    r.set_sequence_id(id);
    return r;
  }

  void Create(const std::string& id) {
    grpc::ClientContext ctx;
    v1::CreateSequenceRequest req;
    req.set_namespace_(kNs);
    req.set_sequence_id(id);
    *req.mutable_layout() = history::Layout();
    req.set_scheme("fp16");
    v1::CreateSequenceResponse resp;
    grpc::Status st = stub_->CreateSequence(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }

  // Message `i` of an append stream: tokens [20 i, 20 i + 20) of `op`.
  v1::AppendRequest Chunk(const std::string& id, int64_t op, int i) {
    v1::AppendRequest req;
    if (i == 0) *req.mutable_sequence() = Ref(id);
    history::FillChunk(op, 20 * i, 20, req.mutable_chunk());
    return req;
  }

  // Every token of `id` attributed to its writer; an empty optional for a
  // token whose bytes are not exactly an append's.
  std::vector<std::optional<TokenRef>> Fetch(const std::string& id, grpc::Status* status) {
    grpc::ClientContext ctx;
    v1::FetchRequest req;
    *req.mutable_sequence() = Ref(id);
    req.set_dtype(v1::DTYPE_FP16);
    std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> r = stub_->FetchDequant(&ctx, req);
    std::vector<std::optional<TokenRef>> tokens;
    v1::FetchResponse msg;
    while (r->Read(&msg)) {
      std::vector<std::optional<TokenRef>> part = history::Attribute(msg.k(), msg.v());
      EXPECT_EQ(static_cast<int64_t>(part.size()), msg.k().shape(1));
      tokens.insert(tokens.end(), part.begin(), part.end());
    }
    *status = r->Finish();
    return tokens;
  }

  // The tokens of `op`, [0, n).
  static std::vector<std::optional<TokenRef>> Tokens(int64_t op, int n) {
    std::vector<std::optional<TokenRef>> out;
    for (int i = 0; i < n; ++i) out.push_back(TokenRef{op, i});
    return out;
  }

  int64_t UsedBytes() {
    grpc::ClientContext ctx;
    v1::StatsRequest req;
    v1::StatsResponse resp;
    EXPECT_TRUE(stub_->Stats(&ctx, req, &resp).ok());
    return resp.used_bytes();
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

// The data loss of issue 42: stream A sends two chunks (40 tokens); stream B
// on the same sequence is refused ABORTED; A then half-closes and must be
// answered OK with all 40 tokens, which a fetch returns bit for bit.
TEST_F(ConcurrentWritersTest, ARefusedSecondStreamLeavesTheFirstWhole) {
  ASSERT_NO_FATAL_FAILURE(Create("s"));
  const int64_t baseline = UsedBytes();
  constexpr int64_t kA = 1, kB = 2;

  grpc::ClientContext a_ctx;
  v1::AppendResponse a_resp;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> a = stub_->Append(&a_ctx, &a_resp);
  ASSERT_TRUE(a->Write(Chunk("s", kA, 0)));
  // A's first chunk has reached the store (its transaction is open).
  ASSERT_TRUE(PollUntil([&] { return UsedBytes() > baseline; })) << "A's chunk never arrived";
  ASSERT_TRUE(a->Write(Chunk("s", kA, 1)));

  {
    grpc::ClientContext b_ctx;
    v1::AppendResponse b_resp;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> b = stub_->Append(&b_ctx, &b_resp);
    b->Write(Chunk("s", kB, 0));
    b->WritesDone();
    const grpc::Status b_st = b->Finish();
    EXPECT_EQ(b_st.error_code(), grpc::StatusCode::ABORTED) << b_st.error_message();
    EXPECT_EQ(b_st.error_message(), "another append stream is in progress");
  }

  ASSERT_TRUE(a->WritesDone());
  const grpc::Status a_st = a->Finish();
  ASSERT_TRUE(a_st.ok()) << a_st.error_message();
  EXPECT_EQ(a_resp.num_tokens(), 40);

  grpc::Status fetch_st;
  EXPECT_EQ(Fetch("s", &fetch_st), Tokens(kA, 40));
  EXPECT_TRUE(fetch_st.ok()) << fetch_st.error_message();
}

// While A is open: an AppendAttend on the sequence is refused ABORTED and
// changes nothing; a fetch and a fork see the committed tokens only; after
// A's acknowledgement every read sees all of them, the fork keeps its own.
TEST_F(ConcurrentWritersTest, ReadsAndForksSeeCommittedTokensOnly) {
  ASSERT_NO_FATAL_FAILURE(Create("s"));
  {
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w = stub_->Append(&ctx, &resp);
    ASSERT_TRUE(w->Write(Chunk("s", 7, 0)));
    w->WritesDone();
    ASSERT_TRUE(w->Finish().ok());
    ASSERT_EQ(resp.num_tokens(), 20);
  }
  const int64_t before_a = UsedBytes();
  grpc::ClientContext a_ctx;
  v1::AppendResponse a_resp;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> a = stub_->Append(&a_ctx, &a_resp);
  ASSERT_TRUE(a->Write(Chunk("s", 8, 0)));
  ASSERT_TRUE(PollUntil([&] { return UsedBytes() > before_a; })) << "A's chunk never arrived";

  v1::AppendAttendRequest aa;
  v1::AppendAttendItem* item = aa.add_items();
  *item->mutable_sequence() = Ref("s");
  history::FillStep(9, item->mutable_k(), item->mutable_v());
  const std::vector<float> q = history::Query(1);
  item->mutable_q()->set_dtype(v1::DTYPE_FP32);
  for (int64_t d : {1, history::kQHeads, history::kHeadDim}) item->mutable_q()->add_shape(d);
  item->mutable_q()->set_data(q.data(), q.size() * sizeof(float));
  {
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    const grpc::Status st = stub_->AppendAttend(&ctx, aa, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "an append stream is in progress"))
        << st.error_message();
  }
  grpc::Status st;
  EXPECT_EQ(Fetch("s", &st), Tokens(7, 20));
  {
    grpc::ClientContext ctx;
    v1::StatsRequest req;
    *req.mutable_sequence() = Ref("s");
    v1::StatsResponse resp;
    ASSERT_TRUE(stub_->Stats(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.num_tokens(), 20);
  }
  {
    grpc::ClientContext ctx;
    v1::ForkRequest req;
    *req.mutable_source() = Ref("s");
    req.set_new_sequence_id("f");
    v1::ForkResponse resp;
    const grpc::Status fst = stub_->Fork(&ctx, req, &resp);
    ASSERT_TRUE(fst.ok()) << fst.error_message();
    EXPECT_EQ(resp.num_tokens(), 20);
  }

  ASSERT_TRUE(a->Write(Chunk("s", 8, 1)));
  ASSERT_TRUE(a->WritesDone());
  ASSERT_TRUE(a->Finish().ok());
  EXPECT_EQ(a_resp.num_tokens(), 60);
  std::vector<std::optional<TokenRef>> want = Tokens(7, 20);
  for (const auto& t : Tokens(8, 40)) want.push_back(t);
  EXPECT_EQ(Fetch("s", &st), want);
  EXPECT_EQ(Fetch("f", &st), Tokens(7, 20));
}

// A Release while a stream is open wins: the sequence is gone at once, the
// stream ends NOT_FOUND instead of committing, and the pool gets every byte
// back.
TEST_F(ConcurrentWritersTest, ReleaseWinsOverAnOpenStream) {
  const int64_t baseline = UsedBytes();
  ASSERT_NO_FATAL_FAILURE(Create("s"));
  grpc::ClientContext a_ctx;
  v1::AppendResponse a_resp;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> a = stub_->Append(&a_ctx, &a_resp);
  ASSERT_TRUE(a->Write(Chunk("s", 3, 0)));
  ASSERT_TRUE(PollUntil([&] { return UsedBytes() > baseline; })) << "A's chunk never arrived";
  {
    grpc::ClientContext ctx;
    v1::ReleaseRequest req;
    *req.mutable_sequence() = Ref("s");
    v1::ReleaseResponse resp;
    const grpc::Status st = stub_->Release(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  a->Write(Chunk("s", 3, 1));
  a->WritesDone();
  const grpc::Status a_st = a->Finish();
  EXPECT_EQ(a_st.error_code(), grpc::StatusCode::NOT_FOUND) << a_st.error_message();
  EXPECT_EQ(a_st.error_message(), "sequence \"s\" in namespace \"writers\" was released");
  int64_t used = -1;
  EXPECT_TRUE(PollUntil([&] { return (used = UsedBytes()) == baseline; }))
      << "used_bytes " << used << ", baseline " << baseline;
}

}  // namespace
}  // namespace kvq
