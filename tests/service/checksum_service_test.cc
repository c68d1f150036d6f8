// Page checksums through the service: a bit flipped in a sealed page of the
// pool makes every read of it (FetchDequant dense and raw, Attend,
// AppendAttend, DecodeStream) answer DATA_LOSS, never a wrong answer; the
// sequence is removed and counted, and other sequences are untouched. With
// --verify_fraction=0 the same flip goes out undetected.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "service/kvq_service.h"
#include "service/metrics.h"
#include "service/server_config.h"
#include "tests/service/loopback_service.h"
#include "tests/service/store_test_data.h"
#include "tests/service/wire_test_data.h"

ABSL_DECLARE_FLAG(double, verify_fraction);

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64, kTokens = 300;

// One kvq-server's service on a loopback port, verifying this fraction of
// page reads.
struct Server : LoopbackService {
  Server(SequenceStore* store, Metrics* metrics, double verify_fraction)
      : LoopbackService(store, metrics, Options(verify_fraction)) {}
  static ServiceOptions Options(double verify_fraction) {
    ServiceOptions o;
    o.verify_fraction = verify_fraction;
    return o;
  }
};

// A read's status and every byte of its answer.
struct Answer {
  grpc::Status status;
  std::string bytes;
};

class ChecksumServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = NewTestStore(16 << 20);
    metrics_ = std::move(*Metrics::Create("", store_.get(), "host"));
    Metrics* m = metrics_.get();
    store_->set_events({[m](GoneReason r) { m->RecordGone(r); }, [m](int t) { m->RecordPrefixHit(t); }});
    strict_ = std::make_unique<Server>(store_.get(), m, 1.0);
    lax_ = std::make_unique<Server>(store_.get(), m, 0.0);
    ASSERT_GT(strict_->port, 0);
    ASSERT_GT(lax_->port, 0);
  }

  void TearDown() override {
    strict_.reset();
    lax_.reset();
  }

  v1::KvCache::Stub& stub() { return *strict_->stub; }

  void Create(const std::string& id, uint32_t seed) {
    const v1::CreateSequenceRequest req =
        MakeCreateSequenceRequest(id, kLayers, kHeads, kQHeads, kDim, "kivi2:g32:r128");
    v1::CreateSequenceResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub().CreateSequence(&ctx, req, &resp).ok());
    const v1::AppendRequest append =
        RandomAppendRequest(id, {kLayers, kHeads, kTokens, kDim}, seed);
    grpc::ClientContext actx;
    v1::AppendResponse aresp;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w = stub().Append(&actx, &aresp);
    ASSERT_TRUE(w->Write(append));
    ASSERT_TRUE(w->WritesDone());
    const grpc::Status st = w->Finish();
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(aresp.num_tokens(), kTokens);
  }

  // Flips one bit of key code byte 0 in page `page` of (layer, kv_head),
  // in the pool's memory.
  void FlipBit(const std::string& id, int layer, int head, int page) {
    absl::StatusOr<SequenceStore::Handle> seq = store_->Get("", id);
    ASSERT_TRUE(seq.ok()) << seq.status();
    absl::MutexLock lock(&(*seq)->mu());
    const KvStream& s = (*seq)->stream(layer, head);
    ASSERT_LT((page + 1) * s.layout().page_tokens, s.quantized_tokens() + 1) << "page not full";
    const_cast<uint8_t*>(s.page(page))[s.layout().key.codes_offset] ^= 0x04;
  }

  int QuantizedTokens(const std::string& id) {
    absl::StatusOr<SequenceStore::Handle> seq = store_->Get("", id);
    absl::ReaderMutexLock lock(&(*seq)->mu());
    return (*seq)->stream(1, 0).quantized_tokens();
  }

  static Answer Fetch(v1::KvCache::Stub& stub, const std::string& id, bool raw, int token_end) {
    v1::FetchRequest req;
    req.mutable_sequence()->set_sequence_id(id);
    req.set_layer_begin(1);
    req.set_raw(raw);
    req.set_token_end(token_end);
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> r = stub.FetchDequant(&ctx, req);
    Answer a;
    v1::FetchResponse msg;
    while (r->Read(&msg)) {
      a.bytes += msg.k().data() + msg.v().data() + msg.pages().page_data();
    }
    a.status = r->Finish();
    return a;
  }

  static Answer Attend(v1::KvCache::Stub& stub, const std::string& id) {
    v1::AttendRequest req;
    req.set_layer(1);
    v1::AttendItem* item = req.add_items();
    item->mutable_sequence()->set_sequence_id(id);
    *item->mutable_q() = RandomTensor({1, kQHeads, kDim}, 77);
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    Answer a;
    a.status = stub.Attend(&ctx, req, &resp);
    for (const v1::AttendResult& r : resp.results()) a.bytes += r.out().data() + r.lse().data();
    return a;
  }

  static v1::AppendAttendRequest Step(const std::string& id) {
    v1::AppendAttendRequest req;
    req.set_layer(1);
    v1::AppendAttendItem* item = req.add_items();
    item->mutable_sequence()->set_sequence_id(id);
    *item->mutable_k() = RandomTensor({kHeads, 1, kDim}, 5);
    *item->mutable_v() = RandomTensor({kHeads, 1, kDim}, 6);
    *item->mutable_q() = RandomTensor({1, kQHeads, kDim}, 7);
    return req;
  }

  static Answer AppendAttend(v1::KvCache::Stub& stub, const std::string& id) {
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    Answer a;
    a.status = stub.AppendAttend(&ctx, Step(id), &resp);
    for (const v1::AttendResult& r : resp.results()) a.bytes += r.out().data() + r.lse().data();
    return a;
  }

  static Answer Decode(v1::KvCache::Stub& stub, const std::string& id) {
    grpc::ClientContext ctx;
    auto rw = stub.DecodeStream(&ctx);
    v1::DecodeRequest req;
    *req.mutable_step() = Step(id);
    Answer a;
    v1::DecodeResponse resp;
    if (rw->Write(req) && rw->Read(&resp)) {
      for (const v1::AttendResult& r : resp.result().results()) {
        a.bytes += r.out().data() + r.lse().data();
      }
    }
    rw->WritesDone();
    a.status = rw->Finish();
    return a;
  }

  grpc::Status SequenceStats(const std::string& id) {
    v1::StatsRequest req;
    req.mutable_sequence()->set_sequence_id(id);
    grpc::ClientContext ctx;
    v1::StatsResponse resp;
    return stub().Stats(&ctx, req, &resp);
  }

  // The value of the metric line starting with `series` + " ", or -1.
  double MetricValue(const std::string& series) const {
    for (absl::string_view line : absl::StrSplit(metrics_->Scrape(), '\n')) {
      if (absl::StartsWith(line, series + " ")) {
        double v = 0;
        if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
      }
    }
    return -1;
  }

  size_t UsedBytes() const { return store_->pool().Stats().used_bytes; }

  // Polls until the pool holds `bytes` again (a reactor drops its
  // sequence handle just after the client sees its status); bounded.
  bool PoolReturnsTo(size_t bytes) const {
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (UsedBytes() != bytes) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Server> strict_, lax_;
};

void ExpectDataLoss(const Answer& a, const std::string& id) {
  EXPECT_EQ(a.status.error_code(), grpc::StatusCode::DATA_LOSS) << a.status.error_message();
  // Page 1 of layer 1, kv_head 1: tokens [32, 64) (no sink).
  EXPECT_EQ(a.status.error_message(),
            absl::StrCat("page checksum mismatch in sequence \"", id,
                         "\" layer 1 kv_head 1 page 1 (tokens [32, 64)): the sequence is "
                         "removed; append it again"));
  EXPECT_TRUE(a.bytes.empty()) << "no byte of the answer may go out";
}

TEST_F(ChecksumServiceTest, EveryReadOfAFlippedPageIsDataLossAndRemovesTheSequence) {
  Create("other", 100);
  const int other_quantized = QuantizedTokens("other");
  const Answer other_dense = Fetch(stub(), "other", false, 0);
  const Answer other_raw = Fetch(stub(), "other", true, other_quantized);
  const Answer other_attend = Attend(stub(), "other");
  ASSERT_TRUE(other_dense.status.ok() && other_raw.status.ok() && other_attend.status.ok());
  ASSERT_FALSE(other_dense.bytes.empty() || other_raw.bytes.empty() || other_attend.bytes.empty());

  const std::vector<std::string> reads = {"fetch_dense", "fetch_raw", "attend", "append_attend",
                                          "decode_stream"};
  for (size_t i = 0; i < reads.size(); ++i) {
    SCOPED_TRACE(reads[i]);
    const std::string id = "victim_" + reads[i];
    const size_t used_before = UsedBytes();
    Create(id, 1);
    ASSERT_EQ(QuantizedTokens(id), 256);  // Pages 0..7 are full and sealed.
    ASSERT_TRUE(Fetch(stub(), id, false, 0).status.ok());
    FlipBit(id, 1, 1, 1);
    Answer a;
    if (reads[i] == "fetch_dense") a = Fetch(stub(), id, false, 0);
    if (reads[i] == "fetch_raw") a = Fetch(stub(), id, true, 256);
    if (reads[i] == "attend") a = Attend(stub(), id);
    if (reads[i] == "append_attend") a = AppendAttend(stub(), id);
    if (reads[i] == "decode_stream") a = Decode(stub(), id);
    ExpectDataLoss(a, id);

    const grpc::Status gone = SequenceStats(id);
    EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(gone.error_message(),
              absl::StrCat("sequence \"", id,
                           "\" was removed: a page failed its checksum; append it again"));
    EXPECT_TRUE(PoolReturnsTo(used_before)) << UsedBytes() << " != " << used_before;
    EXPECT_EQ(MetricValue("kvq_page_checksum_failures_total"), i + 1.0);
    EXPECT_EQ(MetricValue("kvq_sequences_removed_total{reason=\"corrupted\"}"), i + 1.0);
  }

  // The other sequence answers exactly as before.
  EXPECT_EQ(Fetch(stub(), "other", false, 0).bytes, other_dense.bytes);
  EXPECT_EQ(Fetch(stub(), "other", true, other_quantized).bytes, other_raw.bytes);
  EXPECT_EQ(Attend(stub(), "other").bytes, other_attend.bytes);
}

TEST_F(ChecksumServiceTest, WithVerifyFractionZeroTheFlipGoesOutUndetected) {
  Create("s", 3);
  const Answer clean = Fetch(*lax_->stub, "s", false, 0);
  const Answer clean_attend = Attend(*lax_->stub, "s");
  ASSERT_TRUE(clean.status.ok());
  FlipBit("s", 1, 1, 1);
  // What verification exists to stop: a wrong answer with status OK.
  const Answer wrong = Fetch(*lax_->stub, "s", false, 0);
  ASSERT_TRUE(wrong.status.ok()) << wrong.status.error_message();
  EXPECT_NE(wrong.bytes, clean.bytes);
  const Answer wrong_attend = Attend(*lax_->stub, "s");
  ASSERT_TRUE(wrong_attend.status.ok());
  EXPECT_NE(wrong_attend.bytes, clean_attend.bytes);
  EXPECT_EQ(MetricValue("kvq_page_checksum_failures_total"), 0.0);
  // The page was sealed all along: a verifying read sees it.
  ExpectDataLoss(Fetch(stub(), "s", false, 0), "s");
}

TEST_F(ChecksumServiceTest, PoolMetricsCountTheChecksumWords) {
  Create("s", 4);
  const PagePoolStats st = store_->pool().Stats();
  EXPECT_EQ(st.sealed_blocks, size_t{kLayers} * kHeads * (256 / 32));
  EXPECT_GT(st.checksum_bytes, 0u);
  EXPECT_EQ(MetricValue("kvq_page_checksum_bytes{tier=\"host\"}"), st.checksum_bytes);
  EXPECT_EQ(MetricValue("kvq_pool_pages{tier=\"host\",state=\"sealed\"}"), st.sealed_blocks);
}

TEST(VerifyFractionFlagTest, MustBeInZeroToOne) {
  for (double bad : {1.5, -0.1}) {
    absl::SetFlag(&FLAGS_verify_fraction, bad);
    const absl::StatusOr<ServerConfig> c = ConfigFromFlags();
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(c.status().message(), absl::StrCat("--verify_fraction=", bad, ": must be in [0, 1]"));
  }
  absl::SetFlag(&FLAGS_verify_fraction, 0.5);
  const absl::StatusOr<ServerConfig> c = ConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->service.verify_fraction, 0.5);
  absl::SetFlag(&FLAGS_verify_fraction, 1.0);
}

}  // namespace
}  // namespace kvq
