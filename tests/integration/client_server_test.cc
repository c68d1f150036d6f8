// The real kvq-server on a free loopback port, driven by the C++ client and
// by the kvq CLI: create / append (dense and client-quantized) / fetch
// (server and local dequantization) / attend / append-attend / decode
// stream / stats / fork / release.
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "client/local_sequence.h"
#include "client/npy.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/integration/server_process.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64;

class ClientServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess(BinaryPath("KVQ_SERVER_BIN", KVQ_SERVER_BIN));
    start_ = server_->Start();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(start_.ok()) << start_;
    ClientOptions options;
    options.target = server_->address();
    options.ns = "it";
    absl::StatusOr<std::unique_ptr<KvqClient>> c = KvqClient::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    config_.layout = {kLayers, kHeads, kQHeads, kDim, {}};
    config_.layout.rope.theta = 500000.0f;
  }

  SequenceInfo Create(const std::string& id, const std::string& scheme) {
    CreateOptions create;
    create.sequence_id = id;
    create.config = config_;
    create.config.scheme = scheme;
    absl::StatusOr<SequenceInfo> info = client_->CreateSequence(create);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : SequenceInfo();
  }

  static ServerProcess* server_;
  static absl::Status start_;
  std::unique_ptr<KvqClient> client_;
  SequenceConfig config_;
};

ServerProcess* ClientServerTest::server_ = nullptr;
absl::Status ClientServerTest::start_;

TEST_F(ClientServerTest, QuantizedAndDenseAppendsStoreTheSameCache) {
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->version().empty());

  // Every KVQuant option, 8-bit group parameters, keys and values at
  // different bits, fitted key ranges.
  struct Case {
    const char* scheme;
    int block_tokens;
  };
  EXPECT_NE(std::find(info->scheme_options().begin(), info->scheme_options().end(), "fit"),
            info->scheme_options().end())
      << "GetServerInfo lists the fit option";
  for (const Case& c : {Case{"kivi2:g32:r128:pre_rope:outliers=1:sink=4", 128},
                        Case{"kivi4:g64:r64:p8:pre_rope:sink=4", 64},
                        Case{"kivi4:v3:g32:r32:p8:outliers=1", 32},
                        Case{"kivi2:g16:r16:fit:p8:pre_rope:sink=4", 16}}) {
    SCOPED_TRACE(c.scheme);
    const std::string scheme = c.scheme;
    const std::string quantized = "quantized_" + std::to_string(c.block_tokens);
    const std::string dense = "dense_" + std::to_string(c.block_tokens);
    const SequenceInfo q = Create(quantized, scheme);
    const SequenceInfo d = Create(dense, scheme);
    EXPECT_EQ(q.scheme, scheme);
    EXPECT_EQ(q.block_tokens, c.block_tokens);
    config_.scheme = q.scheme;

    const HostTensor k = Random({kLayers, kHeads, 900, kDim}, 1);
    const HostTensor v = Random({kLayers, kHeads, 900, kDim}, 2);
    AppendOptions options;
    options.max_chunk_bytes = 32 << 10;
    absl::StatusOr<AppendResult> qa = client_->AppendPromptQuantized(quantized, config_, k, v, options);
    ASSERT_TRUE(qa.ok()) << qa.status();
    absl::StatusOr<AppendResult> da = client_->AppendPrompt(dense, k, v, options);
    ASSERT_TRUE(da.ok()) << da.status();
    EXPECT_EQ(qa->num_tokens, 900);
    EXPECT_EQ(qa->bytes_stored, da->bytes_stored);
    EXPECT_LT(qa->wire_bytes * 4, da->wire_bytes);

    FetchOptions fetch;
    fetch.dtype = DType::kFloat32;
    for (bool rope : {false, true}) {
      fetch.apply_rope = rope;
      absl::StatusOr<FetchedKv> a = client_->FetchDequant(quantized, fetch);
      absl::StatusOr<FetchedKv> b = client_->FetchDequant(dense, fetch);
      absl::StatusOr<FetchedKv> local = client_->FetchDequantLocal(quantized, config_, fetch);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
      ASSERT_TRUE(local.ok()) << local.status();
      EXPECT_EQ(a->k.shape, (std::vector<int64_t>{kLayers, kHeads, 900, kDim}));
      EXPECT_TRUE(a->k == b->k) << "rope " << rope;
      EXPECT_TRUE(a->v == b->v);
      EXPECT_TRUE(local->k == a->k) << "rope " << rope;
      EXPECT_TRUE(local->v == a->v);
    }

    absl::StatusOr<v1::StatsResponse> stats = client_->Stats(quantized);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->num_tokens(), 900);
    EXPECT_EQ(stats->scheme(), scheme);
    EXPECT_GT(stats->compression_vs_fp16(), 2.0);
  }
}

// FetchDequantInto writes exactly what FetchDequant returns, for a sub-range
// spread over several messages per layer, into tensors reused across calls;
// bad output tensors are named.
TEST_F(ClientServerTest, FetchDequantIntoMatchesFetchDequant) {
  const SequenceInfo s = Create("into", "kivi4:g32:r128:sink=4");
  config_.scheme = s.scheme;
  const HostTensor k = Random({kLayers, kHeads, 700, kDim}, 11);
  const HostTensor v = Random({kLayers, kHeads, 700, kDim}, 12);
  ASSERT_TRUE(client_->AppendPrompt("into", k, v, {}).ok());
  FetchOptions fetch;
  fetch.layer_begin = 1;
  fetch.token_begin = 3;
  fetch.token_end = 650;
  fetch.max_chunk_bytes = 8 << 10;  // Several messages per layer.
  for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
    fetch.dtype = dtype;
    fetch.layer_end = kLayers;
    absl::StatusOr<FetchedKv> want = client_->FetchDequant("into", fetch);
    ASSERT_TRUE(want.ok()) << want.status();
    fetch.layer_end = 0;  // Taken from the tensors' shape.
    HostTensor ko = HostTensor::Zeros(dtype, {kLayers - 1, kHeads, 647, kDim});
    HostTensor vo = HostTensor::Zeros(dtype, ko.shape);
    for (int rep = 0; rep < 2; ++rep) {  // The second call overwrites in place.
      const absl::Status st = client_->FetchDequantInto("into", fetch, &ko, &vo);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(ko == want->k) << DTypeName(dtype) << " rep " << rep;
      EXPECT_TRUE(vo == want->v) << DTypeName(dtype) << " rep " << rep;
    }
  }
  HostTensor ko = HostTensor::Zeros(DType::kFloat16, {1, kHeads, 10, kDim});
  HostTensor vo = HostTensor::Zeros(DType::kFloat32, ko.shape);
  FetchOptions bad;
  absl::Status st = client_->FetchDequantInto("into", bad, &ko, &vo);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            absl::StrCat("k and v must both be [layers, kv_heads, tokens, head_dim] of fp16, got ",
                         ko.DebugString(), " and ", vo.DebugString()));
  vo = HostTensor::Zeros(DType::kFloat16, ko.shape);
  bad.token_end = 20;
  st = client_->FetchDequantInto("into", bad, &ko, &vo);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), absl::StrCat("k is ", ko.DebugString(),
                                       ": layers [0, 1) and tokens [0, 10), but options ask for "
                                       "layer_end 0 and token_end 20"));
  // A range past the stored tokens is the server's OUT_OF_RANGE.
  bad.token_end = 0;
  bad.token_begin = 695;
  st = client_->FetchDequantInto("into", bad, &ko, &vo);
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
}

TEST_F(ClientServerTest, AttentionMatchesALocalCopyOfTheCache) {
  const SequenceInfo s = Create("attend", "kivi4:g32:r128");
  config_.scheme = s.scheme;
  const HostTensor k = Random({kLayers, kHeads, 400, kDim}, 3);
  const HostTensor v = Random({kLayers, kHeads, 400, kDim}, 4);
  ASSERT_TRUE(client_->AppendPromptQuantized("attend", config_, k, v, {}).ok());
  absl::StatusOr<std::unique_ptr<LocalSequence>> local = LocalSequence::Create(config_);
  ASSERT_TRUE(local.ok());
  v1::KvChunk all;
  ToProto(k, all.mutable_k());
  ToProto(v, all.mutable_v());
  ASSERT_TRUE((*local)->ApplyChunk(all).ok());

  const HostTensor q = Random({2, kQHeads, kDim}, 5);
  AttendQuery query{"attend", q, {150, 399}, 0, 0};
  absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(1, {query});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 1u);
  EXPECT_EQ((*out)[0].out.shape, (std::vector<int64_t>{2, kQHeads, kDim}));
  EXPECT_EQ((*out)[0].lse.shape, (std::vector<int64_t>{2, kQHeads}));

  // The same attention over the local streams with the CPU kernels.
  const std::vector<float> qf = q.ToFloats();
  const std::vector<float> got = (*out)[0].out.ToFloats(), got_lse = (*out)[0].lse.ToFloats();
  const int group = kQHeads / kHeads;
  std::vector<float> want(2 * kQHeads * kDim), want_lse(2 * kQHeads);
  std::vector<AttentionTask> tasks;
  for (int h = 0; h < kHeads; ++h) {
    AttentionTask t;
    t.stream = &(*local)->stream(1, h);
    t.num_queries = 2;
    t.q = qf.data() + h * group * kDim;
    t.q_stride = kQHeads * kDim;
    t.q_positions = query.q_positions.data();
    t.out = want.data() + h * group * kDim;
    t.out_stride = kQHeads * kDim;
    t.lse = want_lse.data() + h * group;
    t.lse_stride = kQHeads;
    tasks.push_back(t);
  }
  AttentionOptions attention;
  attention.group_size = group;
  ASSERT_TRUE(CpuBackend().Attend(tasks, attention).ok());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4f) << i;
  for (size_t i = 0; i < want_lse.size(); ++i) ASSERT_NEAR(got_lse[i], want_lse[i], 1e-4f) << i;
}

TEST_F(ClientServerTest, AttendBatchEqualsAttendItemByItem) {
  // Three sequences of different lengths and schemes, one layout.
  const std::vector<std::string> ids = {"b0", "b1", "b2"};
  const char* schemes[] = {"kivi2:g32:r128", "fp16", "kivi4:g32:r64:sink=4"};
  for (int i = 0; i < 3; ++i) {
    Create(ids[i], schemes[i]);
    const int tokens = 100 + 150 * i;
    ASSERT_TRUE(client_
                    ->AppendPrompt(ids[i], Random({kLayers, kHeads, tokens, kDim}, 40 + i),
                                   Random({kLayers, kHeads, tokens, kDim}, 50 + i))
                    .ok());
  }
  const HostTensor q = Random({3, kQHeads, kDim}, 60);
  absl::StatusOr<AttendOutput> packed = client_->AttendBatch(1, ids, q);
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->out.shape, (std::vector<int64_t>{3, kQHeads, kDim}));
  EXPECT_EQ(packed->lse.shape, (std::vector<int64_t>{3, kQHeads}));
  EXPECT_EQ(packed->out.dtype, DType::kFloat32);

  std::vector<AttendQuery> items;
  const size_t row = static_cast<size_t>(kQHeads) * kDim * DTypeBytes(q.dtype);
  for (int i = 0; i < 3; ++i) {
    HostTensor qi = HostTensor::Zeros(q.dtype, {1, kQHeads, kDim});
    qi.data = q.data.substr(i * row, row);
    items.push_back({ids[i], qi, {}, 0, 0});
  }
  absl::StatusOr<std::vector<AttendOutput>> each = client_->Attend(1, items);
  ASSERT_TRUE(each.ok()) << each.status();
  ASSERT_EQ(each->size(), 3u);
  // The same kernel call on the same queries: the same bytes.
  std::string out, lse;
  for (const AttendOutput& o : *each) {
    out += o.out.data;
    lse += o.lse.data;
  }
  EXPECT_TRUE(out == packed->out.data) << "packed out differs from the per-item outputs";
  EXPECT_TRUE(lse == packed->lse.data) << "packed lse differs from the per-item lse";
}

// Rows [i, i + 1) of a packed [n, heads, dim] tensor as [heads, 1, dim]
// (a decode item's k or v) or [1, heads, dim] (its q).
HostTensor Row(const HostTensor& t, int i, bool as_kv) {
  const int64_t heads = t.shape[1], dim = t.shape[2];
  HostTensor r = HostTensor::Zeros(t.dtype, as_kv ? std::vector<int64_t>{heads, 1, dim}
                                                  : std::vector<int64_t>{1, heads, dim});
  const size_t row = static_cast<size_t>(heads * dim) * DTypeBytes(t.dtype);
  r.data = t.data.substr(i * row, row);
  return r;
}

TEST_F(ClientServerTest, PackedDecodeStepsEqualItemByItem) {
  // Two copies of three sequences; one copy steps item by item, the other
  // packed (unary, then on a DecodeStream): the same outputs, the same KV.
  const char* schemes[] = {"kivi2:g32:r128", "fp16", "kivi4:g32:r64:sink=4"};
  std::vector<std::string> each_ids, packed_ids;
  for (int i = 0; i < 3; ++i) {
    const HostTensor k = Random({kLayers, kHeads, 90 + 40 * i, kDim}, 70 + i);
    const HostTensor v = Random({kLayers, kHeads, 90 + 40 * i, kDim}, 80 + i);
    for (std::vector<std::string>* ids : {&each_ids, &packed_ids}) {
      const std::string id = absl::StrCat(ids == &each_ids ? "e" : "p", i);
      Create(id, schemes[i]);
      ASSERT_TRUE(client_->AppendPrompt(id, k, v).ok());
      ids->push_back(id);
    }
  }
  absl::StatusOr<std::unique_ptr<DecodeSession>> session = client_->OpenDecodeSession();
  ASSERT_TRUE(session.ok()) << session.status();
  for (int step = 0; step < 2; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) {
      DecodeBatch batch{packed_ids, Random({3, kHeads, kDim}, 100 + 10 * step + layer),
                        Random({3, kHeads, kDim}, 200 + 10 * step + layer),
                        Random({3, kQHeads, kDim}, 300 + 10 * step + layer)};
      std::vector<AppendAttendItem> items;
      for (int i = 0; i < 3; ++i) {
        items.push_back({each_ids[i], Row(batch.k, i, true), Row(batch.v, i, true),
                         Row(batch.q, i, false)});
      }
      absl::StatusOr<std::vector<AttendOutput>> each = client_->AppendAttend(layer, items);
      ASSERT_TRUE(each.ok()) << each.status();
      absl::StatusOr<AttendOutput> packed = step == 0
                                                ? client_->AppendAttendBatch(layer, batch)
                                                : (*session)->StepBatch(layer, batch);
      ASSERT_TRUE(packed.ok()) << packed.status();
      EXPECT_EQ(packed->out.shape, (std::vector<int64_t>{3, kQHeads, kDim}));
      EXPECT_EQ(packed->lse.shape, (std::vector<int64_t>{3, kQHeads}));
      std::string out, lse;
      for (const AttendOutput& o : *each) {
        out += o.out.data;
        lse += o.lse.data;
      }
      EXPECT_TRUE(out == packed->out.data) << "step " << step << " layer " << layer;
      EXPECT_TRUE(lse == packed->lse.data) << "step " << step << " layer " << layer;
    }
  }
  ASSERT_TRUE((*session)->Close().ok());
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<FetchedKv> a = client_->FetchDequant(each_ids[i]);
    absl::StatusOr<FetchedKv> b = client_->FetchDequant(packed_ids[i]);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(a->k.data == b->k.data && a->v.data == b->v.data) << schemes[i];
  }
}

TEST_F(ClientServerTest, DecodeStepsAppendAndAttendEveryLayer) {
  Create("decode", "kivi2:g32:r128");
  const HostTensor k = Random({kLayers, kHeads, 200, kDim}, 6);
  ASSERT_TRUE(client_->AppendPrompt("decode", k, k).ok());
  absl::StatusOr<std::unique_ptr<DecodeSession>> session = client_->OpenDecodeSession();
  ASSERT_TRUE(session.ok()) << session.status();
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < kLayers; ++layer) {
      AppendAttendItem item{"decode", Random({kHeads, 1, kDim}, 10 * step + layer),
                            Random({kHeads, 1, kDim}, 100 + step), Random({1, kQHeads, kDim}, 7)};
      absl::StatusOr<std::vector<AttendOutput>> out = (*session)->Step(layer, {item});
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_EQ(out->size(), 1u);
      for (float l : (*out)[0].lse.ToFloats()) EXPECT_TRUE(std::isfinite(l));
    }
  }
  EXPECT_TRUE((*session)->Close().ok());
  // One more step through the unary call.
  AppendAttendItem item{"decode", Random({kHeads, 1, kDim}, 8), Random({kHeads, 1, kDim}, 9),
                        Random({1, kQHeads, kDim}, 10)};
  for (int layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(client_->AppendAttend(layer, {item}).ok());
  }
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats("decode");
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->num_tokens(), 204);
}

TEST_F(ClientServerTest, ForkAndReleaseFollowTheProtocol) {
  Create("parent", "kivi2:g32:r128");
  const HostTensor k = Random({kLayers, kHeads, 300, kDim}, 11);
  ASSERT_TRUE(client_->AppendPrompt("parent", k, k).ok());
  ForkOptions fork;
  fork.new_sequence_id = "child";
  fork.num_tokens = 128;
  absl::StatusOr<ForkResult> child = client_->Fork("parent", fork);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->sequence_id, "child");
  EXPECT_EQ(child->num_tokens, 128);
  CreateOptions again;
  again.sequence_id = "parent";
  again.config = config_;
  EXPECT_EQ(client_->CreateSequence(again).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(client_->Release("child").ok());
  EXPECT_TRUE(client_->Release("parent").ok());
  EXPECT_EQ(client_->Release("parent").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Stats("parent").status().code(), absl::StatusCode::kNotFound);
}

// Runs the kvq CLI; returns its exit code and what it printed.
int RunCli(const std::string& args, std::string* out) {
  return RunCommand(absl::StrCat(BinaryPath("KVQ_CLI_BIN", KVQ_CLI_BIN), " ", args), out);
}

std::string Field(const std::string& text, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, absl::StrCat(key, ": "))) {
      return std::string(line.substr(key.size() + 2));
    }
  }
  return "";
}

TEST_F(ClientServerTest, CliRunsEveryCommand) {
  const std::string dir = server_->dir();
  const std::string server = "--server=" + server_->address() + " --namespace=cli";
  std::string out;
  ASSERT_EQ(RunCli("info " + server, &out), 0) << out;
  EXPECT_NE(Field(out, "schemes").find("kivi2"), std::string::npos) << out;
  ASSERT_EQ(RunCli("create " + server + " --id=c1 --layers=2 --kv_heads=2 --q_heads=4 "
                   "--head_dim=64 --scheme=kivi2:sink=4", &out), 0) << out;
  EXPECT_EQ(Field(out, "scheme"), "kivi2:g32:r128:sink=4");

  const HostTensor k = Random({kLayers, kHeads, 500, kDim}, 12);
  const HostTensor v = Random({kLayers, kHeads, 500, kDim}, 13);
  ASSERT_TRUE(WriteNpy(dir + "/k.npy", k).ok());
  ASSERT_TRUE(WriteNpy(dir + "/v.npy", v.Cast(DType::kFloat16)).ok());
  ASSERT_EQ(RunCli("append " + server + " --id=c1 --k=" + dir + "/k.npy --v=" + dir +
                   "/v.npy --quantize --chunk_bytes=20000 --progress", &out), 0) << out;
  EXPECT_EQ(Field(out, "num_tokens"), "500");
  EXPECT_NE(out.find("append ["), std::string::npos) << "no progress bar: " << out;

  ASSERT_EQ(RunCli("fetch " + server + " --id=c1 --dtype=float32 --k_out=" + dir +
                   "/kf.npy --v_out=" + dir + "/vf.npy", &out), 0) << out;
  ASSERT_EQ(RunCli("fetch " + server + " --id=c1 --dtype=float32 --local --layers=2 "
                   "--kv_heads=2 --head_dim=64 --k_out=" + dir + "/kl.npy", &out), 0) << out;
  absl::StatusOr<HostTensor> kf = ReadNpy(dir + "/kf.npy");
  absl::StatusOr<HostTensor> vf = ReadNpy(dir + "/vf.npy");
  absl::StatusOr<HostTensor> kl = ReadNpy(dir + "/kl.npy");
  ASSERT_TRUE(kf.ok() && vf.ok() && kl.ok()) << kf.status() << vf.status() << kl.status();
  EXPECT_EQ(kf->shape, (std::vector<int64_t>{kLayers, kHeads, 500, kDim}));
  EXPECT_TRUE(*kl == *kf);
  // The same through the C++ client, in the same namespace.
  ClientOptions options = client_->options();
  options.ns = "cli";
  absl::StatusOr<std::unique_ptr<KvqClient>> cli_ns = KvqClient::Connect(options);
  ASSERT_TRUE(cli_ns.ok());
  FetchOptions fetch;
  fetch.dtype = DType::kFloat32;
  absl::StatusOr<FetchedKv> cpp = (*cli_ns)->FetchDequant("c1", fetch);
  ASSERT_TRUE(cpp.ok()) << cpp.status();
  EXPECT_TRUE(cpp->k == *kf);
  EXPECT_TRUE(cpp->v == *vf);

  ASSERT_TRUE(WriteNpy(dir + "/q.npy", Random({1, kQHeads, kDim}, 14)).ok());
  ASSERT_EQ(RunCli("attend " + server + " --id=c1 --layer=1 --q=" + dir + "/q.npy --out=" + dir +
                   "/o.npy --lse=" + dir + "/l.npy", &out), 0) << out;
  absl::StatusOr<HostTensor> o = ReadNpy(dir + "/o.npy");
  absl::StatusOr<HostTensor> l = ReadNpy(dir + "/l.npy");
  ASSERT_TRUE(o.ok() && l.ok());
  EXPECT_EQ(o->shape, (std::vector<int64_t>{1, kQHeads, kDim}));
  EXPECT_EQ(l->shape, (std::vector<int64_t>{1, kQHeads}));

  ASSERT_EQ(RunCli("stats " + server + " --id=c1", &out), 0) << out;
  EXPECT_EQ(Field(out, "num_tokens"), "500");
  ASSERT_EQ(RunCli("fork " + server + " --id=c1 --new_id=c2", &out), 0) << out;
  EXPECT_EQ(Field(out, "num_tokens"), "500");
  ASSERT_EQ(RunCli("release " + server + " --id=c2", &out), 0) << out;
  ASSERT_EQ(RunCli("release " + server + " --id=c1", &out), 0) << out;
  EXPECT_EQ(RunCli("release " + server + " --id=c1", &out), 1);
  EXPECT_NE(out.find("NOT_FOUND"), std::string::npos) << out;
  // Usage errors exit 2 and say why.
  EXPECT_EQ(RunCli("create " + server + " --k=x.npy", &out), 2);
  EXPECT_NE(out.find("--k does not apply"), std::string::npos) << out;
  EXPECT_EQ(RunCli("append --help", &out), 0);
  EXPECT_NE(out.find("--quantize"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvq
