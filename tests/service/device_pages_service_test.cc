// The service over pages the host cannot address: a store whose pages come
// from the hidden-page test allocator (tests/unit/hidden_page_allocator.h)
// with the cuda_host backend standing in for a device. Every page byte the
// service touches itself (raw fetches, dense reads' copies, checksums at
// seal and on read) must go through the allocator: a direct access faults.
// Answers must be the bytes a host-pool store gives, and a flipped bit in a
// sealed page must still be caught.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/host_program_backend.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "service/kvq_service.h"
#include "service/metrics.h"
#include "service/page_checksum.h"
#include "tests/service/loopback_service.h"
#include "tests/service/wire_test_data.h"
#include "tests/unit/hidden_page_allocator.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64, kTokens = 300;

// A store (host pages, or hidden ones) and its service on a loopback port.
struct Node {
  explicit Node(std::shared_ptr<testutil::HiddenPageAllocator> hidden) : hidden(hidden) {
    StoreOptions o;
    o.pool.capacity_bytes = 16 << 20;
    o.pool.slab_bytes = 64 << 10;
    if (hidden != nullptr) {
      o.make_pages = [hidden](PagePool*) -> absl::StatusOr<std::shared_ptr<PageAllocator>> {
        return hidden;
      };
    }
    store = std::move(*SequenceStore::Create(o, &CudaHostBackend()));
    metrics = std::move(*Metrics::Create("", store.get(), "host"));
    ServiceOptions so;
    so.verify_fraction = 1.0;
    server = std::make_unique<LoopbackService>(store.get(), metrics.get(), so);
    stub = server->stub.get();
  }

  std::shared_ptr<testutil::HiddenPageAllocator> hidden;
  std::unique_ptr<SequenceStore> store;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<LoopbackService> server;
  v1::KvCache::Stub* stub = nullptr;
};

struct Answer {
  grpc::Status status;
  std::string bytes;
};

class DevicePagesServiceTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    hidden_ = std::make_unique<Node>(std::make_shared<testutil::HiddenPageAllocator>(64 << 20));
    host_ = std::make_unique<Node>(nullptr);
  }

  static void Create(Node& n, const std::string& id, uint32_t seed) {
    const v1::CreateSequenceRequest req =
        MakeCreateSequenceRequest(id, kLayers, kHeads, kQHeads, kDim, GetParam());
    v1::CreateSequenceResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(n.stub->CreateSequence(&ctx, req, &resp).ok());
    const v1::AppendRequest append =
        RandomAppendRequest(id, {kLayers, kHeads, kTokens, kDim}, seed);
    grpc::ClientContext actx;
    v1::AppendResponse aresp;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w = n.stub->Append(&actx, &aresp);
    ASSERT_TRUE(w->Write(append));
    ASSERT_TRUE(w->WritesDone());
    const grpc::Status st = w->Finish();
    ASSERT_TRUE(st.ok()) << st.error_message();
  }

  static Answer Fetch(Node& n, const std::string& id, bool raw) {
    v1::FetchRequest req;
    req.mutable_sequence()->set_sequence_id(id);
    req.set_raw(raw);
    if (raw) {
      absl::StatusOr<SequenceStore::Handle> seq = n.store->Get("", id);
      if (seq.ok()) {
        absl::ReaderMutexLock lock(&(*seq)->mu());
        const KvStream& s = (*seq)->stream(0, 0);
        req.set_token_end(s.page_base() + s.quantized_tokens());
      }
    }
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> r = n.stub->FetchDequant(&ctx, req);
    Answer a;
    v1::FetchResponse msg;
    while (r->Read(&msg)) a.bytes += msg.k().data() + msg.v().data() + msg.pages().page_data();
    a.status = r->Finish();
    return a;
  }

  std::unique_ptr<Node> hidden_, host_;
};

TEST_P(DevicePagesServiceTest, FetchesAnswerTheHostPoolsBytes) {
  Create(*hidden_, "s", 1);
  Create(*host_, "s", 1);
  for (bool raw : {false, true}) {
    const Answer got = Fetch(*hidden_, "s", raw), want = Fetch(*host_, "s", raw);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    EXPECT_FALSE(want.bytes.empty());
    EXPECT_EQ(got.bytes, want.bytes) << (raw ? "raw" : "dense");
  }
  // Every page and host block is the hidden allocator's (which keeps host
  // blocks itself, where the device pool draws them from the host pool).
  absl::StatusOr<SequenceStore::Handle> seq = hidden_->store->Get("", "s");
  ASSERT_TRUE(seq.ok());
  absl::ReaderMutexLock lock(&(*seq)->mu());
  const KvStream& s = (*seq)->stream(1, 1);
  EXPECT_EQ(s.allocator(), hidden_->hidden.get());
  EXPECT_EQ(hidden_->store->pool().Stats().used_bytes, 0u);
  EXPECT_EQ(hidden_->hidden->live_bytes(),
            static_cast<size_t>(kLayers) * kHeads * s.AllocatedBytes().total());
  EXPECT_EQ(hidden_->hidden->bad_calls(), 0);
}

TEST_P(DevicePagesServiceTest, SealedPagesCarryTheChecksumsOfTheirBytes) {
  Create(*hidden_, "s", 2);
  absl::StatusOr<SequenceStore::Handle> seq = hidden_->store->Get("", "s");
  ASSERT_TRUE(seq.ok());
  absl::ReaderMutexLock lock(&(*seq)->mu());
  int sealed = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (int h = 0; h < kHeads; ++h) {
      const KvStream& s = (*seq)->stream(l, h);
      const int full = s.quantized_tokens() / s.layout().page_tokens;
      for (int i = 0; i < s.num_pages(); ++i) {
        const uint8_t* page = s.page(i);
        uint64_t sum = 0;
        hidden_->hidden->GetChecksums({&page, 1}, {&sum, 1});
        const std::vector<uint8_t> bytes = testutil::PageBytes(s, i);
        EXPECT_EQ(sum, i < full ? PageChecksum(bytes.data(), bytes.size()) : 0) << l << h << i;
        sealed += i < full;
      }
    }
  }
  EXPECT_GT(sealed, 0);
}

TEST_P(DevicePagesServiceTest, AFlippedBitInAHiddenSealedPageIsDataLoss) {
  for (bool raw : {false, true}) {
    const std::string id = raw ? "raw" : "dense";
    Create(*hidden_, id, 3);
    {
      absl::StatusOr<SequenceStore::Handle> seq = hidden_->store->Get("", id);
      ASSERT_TRUE(seq.ok());
      absl::MutexLock lock(&(*seq)->mu());
      // Layer 0: the first message of the fetch covers it, so nothing goes out.
      const KvStream& s = (*seq)->stream(0, 1);
      ASSERT_GE(s.quantized_tokens(), 2 * s.layout().page_tokens);
      // Through the test's back door: the alias of the hidden page.
      s.allocator()->HostAlias(s.page(1))[s.layout().key.codes_offset] ^= 0x04;
    }
    const Answer a = Fetch(*hidden_, id, raw);
    EXPECT_EQ(a.status.error_code(), grpc::StatusCode::DATA_LOSS) << a.status.error_message();
    EXPECT_TRUE(a.bytes.empty()) << "no byte of the answer may go out";
  }
}

INSTANTIATE_TEST_SUITE_P(Schemes, DevicePagesServiceTest,
                         ::testing::Values("kivi2:g32:r128", "int8", "fp16"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) {
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return n;
                         });

}  // namespace
}  // namespace kvq
