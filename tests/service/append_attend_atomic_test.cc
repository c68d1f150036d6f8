// AppendAttend with several items is all or nothing: when a later item's
// append fails (the pool full), the items appended before it are taken back,
// so the call changes nothing it was not acknowledged for.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "kernels/tensor.h"
#include "service/metrics.h"
#include "tests/service/loopback_service.h"
#include "tests/service/store_test_data.h"
#include "tests/service/wire_test_data.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64;

class AppendAttendAtomicTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = NewTestStore(1 << 20);
    metrics_ = std::move(*Metrics::Create("", store_.get(), "host"));
    server_ = std::make_unique<LoopbackService>(store_.get(), metrics_.get(), ServiceOptions{});
    ASSERT_GT(server_->port, 0);
  }

  v1::KvCache::Stub& stub() { return *server_->stub; }

  void Create(const std::string& id, int layers, int heads, int q_heads) {
    const v1::CreateSequenceRequest req =
        MakeCreateSequenceRequest(id, layers, heads, q_heads, kDim, "fp16");
    v1::CreateSequenceResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = stub().CreateSequence(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }

  grpc::Status Append(const std::string& id, int layers, int heads, int tokens, uint32_t seed) {
    const v1::AppendRequest append = RandomAppendRequest(id, {layers, heads, tokens, kDim}, seed);
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w = stub().Append(&ctx, &resp);
    w->Write(append);
    w->WritesDone();
    return w->Finish();
  }

  // Layer 0 of `id`: its token count and every stored K/V value.
  std::pair<int, std::vector<float>> Layer0(const std::string& id) {
    absl::StatusOr<SequenceStore::Handle> seq = store_->Get("", id);
    EXPECT_TRUE(seq.ok()) << seq.status();
    absl::ReaderMutexLock lock(&(*seq)->mu());
    const int n = (*seq)->layer_tokens(0);
    std::vector<float> all;
    for (int h = 0; h < kHeads; ++h) {
      std::vector<float> k(static_cast<size_t>(n) * kDim), v(k.size());
      EXPECT_TRUE((*seq)->stream(0, h).Read(0, n, {}, Floats(k.data(), n, kDim),
                                           Floats(v.data(), n, kDim)).ok());
      all.insert(all.end(), k.begin(), k.end());
      all.insert(all.end(), v.begin(), v.end());
    }
    return {n, all};
  }

  int PageTokens(const std::string& id) {
    absl::StatusOr<SequenceStore::Handle> seq = store_->Get("", id);
    EXPECT_TRUE(seq.ok()) << seq.status();
    absl::ReaderMutexLock lock(&(*seq)->mu());
    return (*seq)->stream(0, 0).layout().page_tokens;
  }

  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<LoopbackService> server_;
};

TEST_F(AppendAttendAtomicTest, ALaterItemOutOfPoolTakesBackTheItemsBeforeIt) {
  // A ends inside a page (its next token needs no page), B on a page
  // boundary (its next token needs one), then a filler takes every page left.
  Create("a", kLayers, kHeads, kQHeads);
  Create("b", kLayers, kHeads, kQHeads);
  const int pt = PageTokens("b");
  ASSERT_GT(pt, 1);
  ASSERT_TRUE(Append("a", kLayers, kHeads, 1, 1).ok());
  ASSERT_TRUE(Append("b", kLayers, kHeads, pt, 3).ok());
  Create("filler", 1, 1, 1);
  uint32_t seed = 10;
  for (int chunk : {pt, 1}) {
    grpc::Status st;
    while ((st = Append("filler", 1, 1, chunk, seed++)).ok()) {
    }
    ASSERT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  }
  const auto [a_tokens, a_kv] = Layer0("a");
  const auto [b_tokens, b_kv] = Layer0("b");
  const size_t used = store_->pool().Stats().used_bytes;
  ASSERT_EQ(a_tokens, 1);

  v1::AppendAttendRequest req;
  req.set_layer(0);
  uint32_t s = 100;
  for (const char* id : {"a", "b"}) {
    v1::AppendAttendItem* it = req.add_items();
    it->mutable_sequence()->set_sequence_id(id);
    *it->mutable_k() = RandomTensor({kHeads, 1, kDim}, s++);
    *it->mutable_v() = RandomTensor({kHeads, 1, kDim}, s++);
    *it->mutable_q() = RandomTensor({1, kQHeads, kDim}, s++);
  }
  v1::AttendResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status st = stub().AppendAttend(&ctx, req, &resp);
  ASSERT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_TRUE(absl::StartsWith(st.error_message(), "items[1]: ")) << st.error_message();

  const auto [a_after, a_kv_after] = Layer0("a");
  const auto [b_after, b_kv_after] = Layer0("b");
  EXPECT_EQ(a_after, a_tokens) << "item 0 was appended although the call failed";
  EXPECT_EQ(a_kv_after, a_kv);
  EXPECT_EQ(b_after, b_tokens);
  EXPECT_EQ(b_kv_after, b_kv);
  EXPECT_EQ(store_->pool().Stats().used_bytes, used);

  // Room made, the same call goes through and appends both items.
  ASSERT_TRUE(store_->Release("", "filler").ok());
  grpc::ClientContext again;
  const grpc::Status ok = stub().AppendAttend(&again, req, &resp);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(Layer0("a").first, a_tokens + 1);
  EXPECT_EQ(Layer0("b").first, b_tokens + 1);
}

}  // namespace
}  // namespace kvq
