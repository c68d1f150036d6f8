// KvqClient against an in-process fake of the service: retries, deadlines,
// status mapping, chunked appends (dense and quantized), fetch assembly,
// raw fetch with local dequantization, attention marshalling, decode
// sessions.
#include <malloc.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/server_credentials.h"
#include "client/grpc_status.h"
#include "client/kvq_client.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "kernels/malloc_tuning.h"
#include "kernels/numeric.h"
#include "kernels/page_layout.h"
#include "tests/client/fake_kv_cache.h"
#include "tests/client/random_host_tensor.h"

namespace kvq {
namespace {

using testing_fake::FakeKvCache;

constexpr int kLayers = 3, kHeads = 2, kDim = 64;

// Whether a fresh 1 MiB block comes from mmap (glibc's default above its
// 128 KiB threshold) or from the heap. These two tests come first: malloc
// settings are process-wide (ctest runs every test in a process of its own).
bool MessageSizedBlockIsMmapped() {
  const size_t before = mallinfo2().hblks;
  void* volatile p = std::malloc(size_t{1} << 20);
  const bool mapped = mallinfo2().hblks > before;
  std::free(p);
  return mapped;
}

TEST(ClientMallocTest, ConnectWithoutRetainLeavesMallocAlone) {
  if (!kMallocIsGlibc) GTEST_SKIP() << "the sanitizer's allocator replaces glibc's malloc";
  ClientOptions options;
  options.retain_message_buffers = false;
  ASSERT_TRUE(KvqClient::Connect(options).ok());
  EXPECT_TRUE(MessageSizedBlockIsMmapped());
}

TEST(ClientMallocTest, ConnectRetainsMessageBuffersByDefault) {
  if (!kMallocIsGlibc) GTEST_SKIP() << "the sanitizer's allocator replaces glibc's malloc";
  ASSERT_TRUE(KvqClient::Connect(ClientOptions()).ok());
  EXPECT_FALSE(MessageSizedBlockIsMmapped());
}

class ClientRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Loopback TCP rather than an in-process channel: the in-process
    // transport hands a message over only when the peer reads it, so a
    // client with two decode steps in flight would deadlock against it.
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&fake_);
    builder.SetMaxReceiveMessageSize(64 << 20);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
    options_.ns = "tenant";
    options_.retry.initial_backoff = absl::Milliseconds(1);
    options_.retry.max_backoff = absl::Milliseconds(4);
    client_ = MakeClient(options_);
    config_.layout = {kLayers, kHeads, 2 * kHeads, kDim, {}};
    config_.scheme = "kivi2:g32:r128:sink=4";
  }
  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<KvqClient> MakeClient(const ClientOptions& options) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    return std::make_unique<KvqClient>(
        grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port_),
                                  grpc::InsecureChannelCredentials(), args),
        options);
  }

  std::string Create(const std::string& id = "s1") {
    CreateOptions create;
    create.sequence_id = id;
    create.config = config_;
    absl::StatusOr<SequenceInfo> info = client_->CreateSequence(create);
    EXPECT_TRUE(info.ok()) << info.status();
    config_.scheme = info->scheme;
    return info->sequence_id;
  }

  // A sequence holding a 600-token prompt of random K (seed) and V (seed +
  // 1), appended as pages the client quantized.
  std::string CreateWithQuantizedPrompt(uint32_t seed) {
    const std::string id = Create();
    const HostTensor k = RandomHostTensor({kLayers, kHeads, 600, kDim}, seed);
    const HostTensor v = RandomHostTensor({kLayers, kHeads, 600, kDim}, seed + 1);
    const absl::StatusOr<AppendResult> appended =
        client_->AppendPromptQuantized(id, config_, k, v, {});
    EXPECT_TRUE(appended.ok()) << appended.status();
    return id;
  }

  FakeKvCache fake_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  ClientOptions options_;
  std::unique_ptr<KvqClient> client_;
  SequenceConfig config_;
};

TEST_F(ClientRpcTest, IdempotentCallsAreRetriedOnUnavailable) {
  fake_.FailNext("GetServerInfo", 2, grpc::Status(grpc::StatusCode::UNAVAILABLE, "restarting"));
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version(), "fake");
  EXPECT_EQ(fake_.calls("GetServerInfo"), 3);
}

TEST_F(ClientRpcTest, RetriesStopAfterMaxAttempts) {
  fake_.FailNext("Stats", 100, grpc::Status(grpc::StatusCode::UNAVAILABLE, "down"));
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(stats.status().message(), "down");
  EXPECT_EQ(fake_.calls("Stats"), options_.retry.max_attempts);
}

TEST_F(ClientRpcTest, OtherErrorsAreNotRetriedAndKeepCodeAndMessage) {
  fake_.FailNext("Attend", 1,
                 grpc::Status(grpc::StatusCode::NOT_FOUND, "sequence tenant/x expired"));
  AttendQuery q{"x", RandomHostTensor({1, 4, kDim}, 1), {}, 0, 0};
  absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(0, {q});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(out.status().message(), "sequence tenant/x expired");
  EXPECT_EQ(fake_.calls("Attend"), 1);
}

TEST_F(ClientRpcTest, CallsThatChangeStateAreNeverRetried) {
  const grpc::Status unavailable(grpc::StatusCode::UNAVAILABLE, "blip");
  fake_.FailNext("CreateSequence", 1, unavailable);
  fake_.FailNext("AppendAttend", 1, unavailable);
  fake_.FailNext("Fork", 1, unavailable);
  fake_.FailNext("Append", 1, unavailable);
  CreateOptions create;
  create.config = config_;
  EXPECT_EQ(client_->CreateSequence(create).status().code(), absl::StatusCode::kUnavailable);
  AppendAttendItem item{"s", RandomHostTensor({kHeads, 1, kDim}, 1),
                        RandomHostTensor({kHeads, 1, kDim}, 2), RandomHostTensor({1, 4, kDim}, 3)};
  EXPECT_EQ(client_->AppendAttend(0, {item}).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client_->Fork("s").status().code(), absl::StatusCode::kUnavailable);
  const HostTensor k = RandomHostTensor({kLayers, kHeads, 8, kDim}, 4);
  EXPECT_EQ(client_->AppendPrompt("s", k, k).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(fake_.calls("CreateSequence"), 1);
  EXPECT_EQ(fake_.calls("AppendAttend"), 1);
  EXPECT_EQ(fake_.calls("Fork"), 1);
  EXPECT_EQ(fake_.calls("Append"), 1);
}

TEST_F(ClientRpcTest, DeadlineExceededIsRetriedForIdempotentCalls) {
  ClientOptions options = options_;
  options.deadline = absl::Milliseconds(50);
  options.retry.max_attempts = 2;
  std::unique_ptr<KvqClient> client = MakeClient(options);
  fake_.HangNext("Stats", 2);
  absl::StatusOr<v1::StatsResponse> stats = client->Stats();
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(fake_.calls("Stats"), 2);
  // A hang once, then an answer on the retry.
  fake_.HangNext("Stats", 1);
  EXPECT_TRUE(client->Stats().ok());
  EXPECT_EQ(fake_.calls("Stats"), 4);
}

TEST_F(ClientRpcTest, EveryCallCarriesTheClientsOrItsOwnDeadline) {
  ClientOptions options = options_;
  options.deadline = absl::Seconds(100);
  std::unique_ptr<KvqClient> client = MakeClient(options);
  ASSERT_TRUE(client->Stats().ok());
  EXPECT_GT(fake_.last_deadline_left("Stats"), absl::Seconds(50));
  // (gRPC rounds the timeout it sends up a little.)
  EXPECT_LT(fake_.last_deadline_left("Stats"), absl::Seconds(101));
  ASSERT_TRUE(client->Stats("", {absl::Seconds(5)}).ok());
  EXPECT_LT(fake_.last_deadline_left("Stats"), absl::Seconds(6));
  EXPECT_GT(fake_.last_deadline_left("Stats"), absl::ZeroDuration());
}

TEST_F(ClientRpcTest, ReleaseWhoseReplyWasLostSucceedsOnRetry) {
  Create("r1");
  fake_.LoseNextReleaseReply();
  absl::StatusOr<int64_t> freed = client_->Release("r1");
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(fake_.calls("Release"), 2);
  EXPECT_EQ(fake_.num_tokens("tenant", "r1"), -1);
  // Without a retry NOT_FOUND stays an error.
  absl::StatusOr<int64_t> again = client_->Release("r1");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientRpcTest, CreateChecksTheSchemeLocallyFirst) {
  CreateOptions create;
  create.config = config_;
  create.config.scheme = "kivi9";
  EXPECT_EQ(client_->CreateSequence(create).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fake_.calls("CreateSequence"), 0);
  create.config.scheme = "kivi2";
  absl::StatusOr<SequenceInfo> info = client_->CreateSequence(create);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->scheme, "kivi2:g32:r128");
  EXPECT_EQ(info->block_tokens, 128);
  EXPECT_FALSE(info->sequence_id.empty());
}

TEST_F(ClientRpcTest, AppendPromptStreamsChunksThatStoreThePrompt) {
  const std::string id = Create();
  const HostTensor k = RandomHostTensor({kLayers, kHeads, 500, kDim}, 5);
  const HostTensor v = RandomHostTensor({kLayers, kHeads, 500, kDim}, 6);
  AppendOptions options;
  options.max_chunk_bytes = 64 << 10;  // 2 x 2 heads x 64 x 4 B = 1 KiB/token: 64 tokens.
  std::vector<std::pair<int64_t, int64_t>> progress;
  options.progress = [&](int64_t done, int64_t total) { progress.emplace_back(done, total); };
  absl::StatusOr<AppendResult> r = client_->AppendPrompt(id, k, v, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_tokens, 500);
  EXPECT_EQ(r->chunks, kLayers * 8);  // ceil(500 / 64) chunks per layer.
  EXPECT_EQ(fake_.append_messages(), kLayers * 8);
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back().first, progress.back().second);
  EXPECT_EQ(progress.back().second, 2 * k.byte_size());
  for (size_t i = 1; i < progress.size(); ++i) EXPECT_GE(progress[i].first, progress[i - 1].first);

  // The stored sequence holds what a local one holding the floats holds.
  absl::StatusOr<std::unique_ptr<LocalSequence>> local = LocalSequence::Create(config_);
  ASSERT_TRUE(local.ok());
  v1::KvChunk all;
  ToProto(k, all.mutable_k());
  ToProto(v, all.mutable_v());
  ASSERT_TRUE((*local)->ApplyChunk(all).ok());
  absl::StatusOr<FetchedKv> want = (*local)->Read(0, -1, ReadOptions());
  absl::StatusOr<FetchedKv> got = fake_.Read("tenant", id);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_TRUE(got->k == want->k);
  EXPECT_TRUE(got->v == want->v);
}

TEST_F(ClientRpcTest, QuantizedAppendFetchesBackLikeADenseAppend) {
  const std::string q_id = Create("quantized");
  const std::string d_id = Create("dense");
  const HostTensor k = RandomHostTensor({kLayers, kHeads, 700, kDim}, 7);
  const HostTensor v = RandomHostTensor({kLayers, kHeads, 700, kDim}, 8);
  AppendOptions options;
  options.max_chunk_bytes = 16 << 10;
  absl::StatusOr<AppendResult> quantized = client_->AppendPromptQuantized(q_id, config_, k, v, options);
  ASSERT_TRUE(quantized.ok()) << quantized.status();
  absl::StatusOr<AppendResult> dense = client_->AppendPrompt(d_id, k, v, options);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(quantized->num_tokens, 700);
  // 2-bit pages for most tokens: far fewer bytes than fp32 rows.
  EXPECT_LT(quantized->wire_bytes * 4, dense->wire_bytes);

  FetchOptions fetch;
  fetch.dtype = DType::kFloat32;
  fetch.max_chunk_bytes = 8 << 10;  // Several messages per layer.
  absl::StatusOr<FetchedKv> a = client_->FetchDequant(q_id, fetch);
  absl::StatusOr<FetchedKv> b = client_->FetchDequant(d_id, fetch);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->k.shape, (std::vector<int64_t>{kLayers, kHeads, 700, kDim}));
  EXPECT_TRUE(a->k == b->k);
  EXPECT_TRUE(a->v == b->v);
}

TEST_F(ClientRpcTest, QuantizedAppendFailingLocallyStoresNothing) {
  const std::string id = Create();
  std::vector<float> kv = RandomHostTensor({kLayers, kHeads, 400, kDim}, 9).ToFloats();
  kv[kv.size() - 1000] = 1e6f;  // Beyond fp16, in the last layer's pages.
  const HostTensor k = *HostTensor::FromFloats(kv, {kLayers, kHeads, 400, kDim});
  absl::StatusOr<AppendResult> r = client_->AppendPromptQuantized(id, config_, k, k, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layer 2"), absl::string_view::npos) << r.status();
  EXPECT_EQ(fake_.num_tokens("tenant", id), 0);
}

TEST_F(ClientRpcTest, FetchAsksForTheRangeAndAssemblesIt) {
  const std::string id = Create();
  const HostTensor k = RandomHostTensor({kLayers, kHeads, 300, kDim}, 10, DType::kFloat16);
  ASSERT_TRUE(client_->AppendPrompt(id, k, k).ok());
  FetchOptions fetch;
  fetch.layer_begin = 1;
  fetch.layer_end = 3;
  fetch.token_begin = 10;
  fetch.token_end = 250;
  fetch.max_chunk_bytes = 4096;
  int64_t last = 0;
  // The first message states the range, so the total is known throughout.
  const int64_t total_bytes = 2 * int64_t{2} * kHeads * 240 * kDim * 2;
  fetch.progress = [&](int64_t done, int64_t total) {
    EXPECT_EQ(total, total_bytes);
    EXPECT_GT(done, last);
    last = done;
  };
  absl::StatusOr<FetchedKv> kv = client_->FetchDequant(id, fetch);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->layer_begin, 1);
  EXPECT_EQ(kv->token_begin, 10);
  EXPECT_EQ(kv->k.dtype, DType::kFloat16);
  EXPECT_EQ(kv->k.shape, (std::vector<int64_t>{2, kHeads, 240, kDim}));
  EXPECT_EQ(last, static_cast<int64_t>(2 * kv->k.byte_size()));
  // The fake's own fp32 read, rounded to fp16 as the fetch was.
  absl::StatusOr<FetchedKv> all = fake_.Read("tenant", id);
  ASSERT_TRUE(all.ok());
  const std::vector<float> got = kv->k.ToFloats(), want = all->k.ToFloats();
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < kHeads; ++h) {
      for (int t = 0; t < 240; t += 7) {
        for (int d = 0; d < kDim; d += 9) {
          const float w = want[(((l + 1) * kHeads + h) * 300 + t + 10) * kDim + d];
          ASSERT_EQ(got[((l * kHeads + h) * 240 + t) * kDim + d], HalfToFloat(FloatToHalf(w)));
        }
      }
    }
  }
}

TEST_F(ClientRpcTest, FetchOfAnEmptyTokenRangeIsAnEmptyTensor) {
  const std::string id = Create();
  const HostTensor k = RandomHostTensor({kLayers, kHeads, 50, kDim}, 11, DType::kFloat16);
  ASSERT_TRUE(client_->AppendPrompt(id, k, k).ok());
  FetchOptions fetch;
  fetch.token_begin = 20;
  fetch.token_end = 20;
  absl::StatusOr<FetchedKv> kv = client_->FetchDequant(id, fetch);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->token_begin, 20);
  EXPECT_EQ(kv->k.shape, (std::vector<int64_t>{kLayers, kHeads, 0, kDim}));
  EXPECT_EQ(kv->v.shape, kv->k.shape);
}

TEST_F(ClientRpcTest, FetchIsRetriedAsAWhole) {
  const std::string id = Create();
  const HostTensor k = RandomHostTensor({kLayers, kHeads, 50, kDim}, 11);
  ASSERT_TRUE(client_->AppendPrompt(id, k, k).ok());
  fake_.FailNext("FetchDequant", 1, grpc::Status(grpc::StatusCode::UNAVAILABLE, "blip"));
  absl::StatusOr<FetchedKv> kv = client_->FetchDequant(id);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->k.shape, (std::vector<int64_t>{kLayers, kHeads, 50, kDim}));
  EXPECT_EQ(fake_.calls("FetchDequant"), 2);
}

TEST_F(ClientRpcTest, RawFetchDequantizedLocallyMatchesTheServersDequantization) {
  config_.scheme = "kivi4:g32:r128:pre_rope:outliers=1:sink=4";
  const std::string id = Create();
  const HostTensor k = RandomHostTensor({kLayers, kHeads, 600, kDim}, 12);
  ASSERT_TRUE(client_->AppendPromptQuantized(id, config_, k, k, {}).ok());
  // 600 tokens: sink 4, 512 in pages, 84 in the fp16 tail.
  absl::StatusOr<PageLayout> layout = PageLayout::Make(*QuantSpec::Parse(config_.scheme), kDim);
  ASSERT_TRUE(layout.ok());
  for (bool rope : {false, true}) {
    FetchOptions fetch;
    fetch.dtype = DType::kFloat32;
    fetch.apply_rope = rope;
    fetch.layer_begin = 1;
    fetch.token_begin = 3;
    fetch.token_end = 590;
    // Three pages per raw message: 96 tokens, not a whole flush block.
    fetch.max_chunk_bytes = static_cast<int>(3 * kHeads * layout->page_bytes);
    absl::StatusOr<FetchedKv> server = client_->FetchDequant(id, fetch);
    absl::StatusOr<FetchedKv> local = client_->FetchDequantLocal(id, config_, fetch);
    ASSERT_TRUE(server.ok()) << server.status();
    ASSERT_TRUE(local.ok()) << local.status();
    EXPECT_EQ(local->layer_begin, 1);
    EXPECT_EQ(local->token_begin, 3);
    EXPECT_EQ(local->k.shape, server->k.shape);
    EXPECT_TRUE(local->k == server->k) << "rope " << rope;
    EXPECT_TRUE(local->v == server->v) << "rope " << rope;
    // Into tensors reused across calls; the second call's first stream
    // fails once and restarts, rewriting the rows it had placed.
    HostTensor ko = HostTensor::Zeros(DType::kFloat32, server->k.shape);
    HostTensor vo = HostTensor::Zeros(DType::kFloat32, server->v.shape);
    for (int rep = 0; rep < 2; ++rep) {
      if (rep == 1) {
        fake_.FailNext("FetchDequant", 1, grpc::Status(grpc::StatusCode::UNAVAILABLE, "blip"));
      }
      const absl::Status st = client_->FetchDequantLocalInto(id, config_, fetch, &ko, &vo);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(ko == server->k) << "rope " << rope << " rep " << rep;
      EXPECT_TRUE(vo == server->v) << "rope " << rope << " rep " << rep;
    }
  }
  {
    // Output tensors are checked before anything is fetched.
    const int calls = fake_.calls("FetchDequant");
    HostTensor ko = HostTensor::Zeros(DType::kFloat16, {1, kHeads, 10, kDim});
    HostTensor vo = HostTensor::Zeros(DType::kFloat32, ko.shape);
    const absl::Status st = client_->FetchDequantLocalInto(id, config_, {}, &ko, &vo);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(),
              absl::StrCat("k and v must both be [layers, kv_heads, tokens, head_dim] of fp16, got ",
                           ko.DebugString(), " and ", vo.DebugString()));
    EXPECT_EQ(fake_.calls("FetchDequant"), calls);
  }
  FetchOptions pages;
  pages.token_begin = 4;
  pages.token_end = 4 + 512;
  absl::StatusOr<RawFetch> raw = client_->FetchRaw(id, pages);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->responses.size(), static_cast<size_t>(kLayers));
  // 4-bit pages: well under half the bytes of the fp16 tensors.
  EXPECT_LT(raw->wire_bytes * 2, int64_t{2} * kLayers * kHeads * 512 * kDim * 2);
  // The fp16 tail has no pages.
  EXPECT_EQ(client_->FetchRaw(id).status().code(), absl::StatusCode::kOutOfRange);
}

// Streaming stores (FetchOptions::streaming_output_bytes) change where the
// client's fp16 rows are written from, not what: always, never and the
// default (these outputs are under its 16 MiB) give the server's bytes.
TEST_F(ClientRpcTest, StreamedLocalFetchWritesTheServersBytes) {
  config_.scheme = "kivi4:g32:r128:sink=4";
  const std::string id = CreateWithQuantizedPrompt(17);
  ASSERT_FALSE(HasFailure());
  for (auto [b, e] : {std::pair{0, 600}, std::pair{5, 517}, std::pair{37, 38}}) {
    FetchOptions fetch;
    fetch.token_begin = b;
    fetch.token_end = e;
    absl::StatusOr<FetchedKv> server = client_->FetchDequant(id, fetch);
    ASSERT_TRUE(server.ok()) << server.status();
    for (int64_t from : {int64_t{0}, int64_t{-1}, FetchOptions().streaming_output_bytes}) {
      fetch.streaming_output_bytes = from;
      absl::StatusOr<FetchedKv> local = client_->FetchDequantLocal(id, config_, fetch);
      ASSERT_TRUE(local.ok()) << local.status();
      EXPECT_TRUE(local->k == server->k) << "[" << b << ", " << e << ") from " << from;
      EXPECT_TRUE(local->v == server->v) << "[" << b << ", " << e << ") from " << from;
    }
  }
}

TEST_F(ClientRpcTest, LocalFetchOfAnyRangeMatchesTheServerBitForBit) {
  // rotate: the sink and the tail come from the server as it dequantizes
  // them, the pages are inverse-rotated here; both match FetchDequant.
  config_.scheme = "kivi2:g32:r128:rotate:sink=4";
  const std::string id = CreateWithQuantizedPrompt(15);
  ASSERT_FALSE(HasFailure());
  // 600 tokens: sink [0, 4), pages [4, 516) of 32 tokens, tail [516, 600).
  const std::pair<int, int> ranges[] = {{0, 600}, {0, 3}, {100, 300}, {37, 38}, {520, 590},
                                        {500, 530}};
  for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
    for (auto [b, e] : ranges) {
      FetchOptions fetch;
      fetch.dtype = dtype;
      fetch.apply_rope = true;
      fetch.layer_begin = 1;
      fetch.layer_end = kLayers;
      fetch.token_begin = b;
      fetch.token_end = e;
      absl::StatusOr<FetchedKv> server = client_->FetchDequant(id, fetch);
      absl::StatusOr<FetchedKv> local = client_->FetchDequantLocal(id, config_, fetch);
      ASSERT_TRUE(server.ok()) << server.status();
      ASSERT_TRUE(local.ok()) << local.status();
      EXPECT_EQ(local->k.shape, server->k.shape);
      EXPECT_TRUE(local->k == server->k) << DTypeName(dtype) << " [" << b << ", " << e << ")";
      EXPECT_TRUE(local->v == server->v) << DTypeName(dtype) << " [" << b << ", " << e << ")";
    }
  }
  FetchOptions beyond;
  beyond.token_end = 601;
  const absl::StatusOr<FetchedKv> past = client_->FetchDequantLocal(id, config_, beyond);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(past.status().message(), "token range [0, 601) is not inside [0, 600]");
  FetchOptions layers;
  layers.layer_begin = 1;
  layers.layer_end = kLayers + 1;
  const absl::StatusOr<FetchedKv> too_many = client_->FetchDequantLocal(id, config_, layers);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(too_many.status().message(),
            absl::StrCat("layers [1, ", kLayers + 1, ") are not a range inside [0, ", kLayers, ")"));
  // Into tensors that reach past the stored tokens: nothing is fetched.
  HostTensor ko = HostTensor::Zeros(DType::kFloat16, {1, kHeads, 10, kDim});
  HostTensor vo = HostTensor::Zeros(DType::kFloat16, ko.shape);
  FetchOptions tail;
  tail.token_begin = 595;
  const absl::Status into = client_->FetchDequantLocalInto(id, config_, tail, &ko, &vo);
  EXPECT_EQ(into.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(into.message(),
            absl::StrCat("k is ", ko.DebugString(), " from layer 0 token 595; the sequence has ",
                         kLayers, " layers and 600 tokens"));
}

TEST_F(ClientRpcTest, AttendSendsEveryItemAndReturnsTypedResults) {
  std::vector<AttendQuery> items = {{"a", RandomHostTensor({1, 4, kDim}, 13), {}, 0, 0},
                                    {"b", RandomHostTensor({3, 4, kDim}, 14, DType::kFloat16),
                                     {5, 6, 7}, 2, 8}};
  absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(2, items);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ((*out)[i].out.dtype, DType::kFloat32);
    EXPECT_EQ((*out)[i].out.ToFloats(), items[i].q.ToFloats());
    EXPECT_EQ((*out)[i].lse.shape, (std::vector<int64_t>{items[i].q.shape[0], 4}));
    for (float l : (*out)[i].lse.ToFloats()) EXPECT_EQ(l, 2.0f);
  }
  // A malformed query fails locally.
  items[0].q.shape = {4, kDim};
  EXPECT_EQ(client_->Attend(0, items).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientRpcTest, DecodeSessionStepsInOrderAndReportsTheStreamsError) {
  absl::StatusOr<std::unique_ptr<DecodeSession>> session = client_->OpenDecodeSession();
  ASSERT_TRUE(session.ok()) << session.status();
  for (int layer = 0; layer < kLayers; ++layer) {
    AppendAttendItem item{"s", RandomHostTensor({kHeads, 1, kDim}, 20 + layer),
                          RandomHostTensor({kHeads, 1, kDim}, 30 + layer),
                          RandomHostTensor({1, 4, kDim}, 40 + layer)};
    absl::StatusOr<std::vector<AttendOutput>> out = (*session)->Step(layer, {item});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), 1u);
    EXPECT_EQ((*out)[0].lse.ToFloats()[0], static_cast<float>(layer));
    EXPECT_EQ((*out)[0].out.ToFloats(), item.q.ToFloats());
  }
  // Two writes in flight, read back in order.
  AppendAttendItem item{"s", RandomHostTensor({kHeads, 1, kDim}, 1),
                        RandomHostTensor({kHeads, 1, kDim}, 2), RandomHostTensor({1, 4, kDim}, 3)};
  ASSERT_TRUE((*session)->Write(0, {item}).ok());
  ASSERT_TRUE((*session)->Write(1, {item}).ok());
  EXPECT_EQ((*session)->Read()->at(0).lse.ToFloats()[0], 0.0f);
  EXPECT_EQ((*session)->Read()->at(0).lse.ToFloats()[0], 1.0f);
  // The fake ends the stream on a negative layer: its error surfaces.
  (void)(*session)->Write(-1, {item});
  absl::StatusOr<std::vector<AttendOutput>> bad = (*session)->Read();
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*session)->Close().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientRpcTest, DecodeSessionClosesCleanly) {
  absl::StatusOr<std::unique_ptr<DecodeSession>> session = client_->OpenDecodeSession();
  ASSERT_TRUE(session.ok());
  AppendAttendItem item{"s", RandomHostTensor({kHeads, 1, kDim}, 1),
                        RandomHostTensor({kHeads, 1, kDim}, 2), RandomHostTensor({1, 4, kDim}, 3)};
  ASSERT_TRUE((*session)->Write(0, {item}).ok());  // Never read: Close drains it.
  EXPECT_TRUE((*session)->Close().ok());
  EXPECT_EQ((*session)->Write(0, {item}).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(RetryBackoffTest, GrowsExponentiallyUpToTheCap) {
  RetryPolicy p;
  p.initial_backoff = absl::Milliseconds(50);
  p.multiplier = 2.0;
  p.max_backoff = absl::Milliseconds(300);
  EXPECT_EQ(RetryBackoff(p, 1), absl::Milliseconds(50));
  EXPECT_EQ(RetryBackoff(p, 2), absl::Milliseconds(100));
  EXPECT_EQ(RetryBackoff(p, 3), absl::Milliseconds(200));
  EXPECT_EQ(RetryBackoff(p, 4), absl::Milliseconds(300));
  EXPECT_EQ(RetryBackoff(p, 40), absl::Milliseconds(300));
  EXPECT_TRUE(IsRetryableCode(absl::StatusCode::kUnavailable));
  EXPECT_TRUE(IsRetryableCode(absl::StatusCode::kDeadlineExceeded));
  EXPECT_FALSE(IsRetryableCode(absl::StatusCode::kNotFound));
  EXPECT_FALSE(IsRetryableCode(absl::StatusCode::kResourceExhausted));
}

TEST(GrpcStatusTest, KeepsCodeAndMessageBothWays) {
  for (int code = 0; code <= 16; ++code) {
    const grpc::Status g(static_cast<grpc::StatusCode>(code), code == 0 ? "" : "msg");
    const absl::Status a = FromGrpcStatus(g);
    EXPECT_EQ(static_cast<int>(a.code()), code);
    if (code != 0) EXPECT_EQ(a.message(), "msg");
    const grpc::Status back = ToGrpcStatus(a);
    EXPECT_EQ(back.error_code(), g.error_code());
    EXPECT_EQ(back.error_message(), g.error_message());
  }
  // A code past UNAUTHENTICATED (20: within the enum's range of values, so
  // the cast is defined, and not a code).
  EXPECT_EQ(FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(20), "x")).code(),
            absl::StatusCode::kUnknown);
}

}  // namespace
}  // namespace kvq
