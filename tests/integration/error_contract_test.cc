// The error contract of proto/kvq/v1/kvq.proto exactly as the real
// kvq-server serves it, through a standard gRPC client: long strings on
// every method, undecodable requests on every method, leases above the
// maximum, one sequence twice in an AppendAttend, an empty key range, and
// two authorization headers.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "client/kvq_client.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "tests/integration/server_client_fixture.h"
#include "tests/integration/server_process.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64;
// A message is a short prefix of the input at most (kernels/quoted.h) plus
// the field's name and bound.
constexpr size_t kMessageBound = 400;

SequenceConfig Config() {
  SequenceConfig c;
  c.layout = {kLayers, kHeads, kQHeads, kDim, {}};
  c.scheme = "kivi2:g32:r128";
  return c;
}

void SetLayout(v1::ModelLayout* l) {
  l->set_num_layers(kLayers);
  l->set_num_kv_heads(kHeads);
  l->set_num_q_heads(kQHeads);
  l->set_head_dim(kDim);
}

// fp32 tensor of `shape`, every element `value`.
void Fill(v1::Tensor* t, std::vector<int64_t> shape, float value) {
  t->set_dtype(v1::DTYPE_FP32);
  size_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= static_cast<size_t>(d);
  }
  std::vector<float> data(n, value);
  t->set_data(std::string(reinterpret_cast<const char*>(data.data()), n * sizeof(float)));
}

std::vector<float> Floats(const v1::Tensor& t) {
  std::vector<float> out(t.data().size() / sizeof(float));
  std::memcpy(out.data(), t.data().data(), out.size() * sizeof(float));
  return out;
}

// Sends `bytes` as the one request message of `method` (any kind: a
// bidirectional stream on the wire is what every kind is) and returns the
// call's status.
grpc::Status RawCall(grpc::Channel* channel, const std::string& method, const std::string& bytes) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const std::string path = "/kvq.v1.KvCache/" + method;
  grpc::internal::RpcMethod rpc(path.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> call(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel, rpc, &ctx));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request);
  call->WritesDone();
  grpc::ByteBuffer response;
  while (call->Read(&response)) {
  }
  return call->Finish();
}

void ExpectInvalid(const grpc::Status& st, const std::string& text, const std::string& what) {
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << what << ": " << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), text))
      << what << ": " << st.error_message() << "\n  expected text: " << text;
  EXPECT_LT(st.error_message().size(), kMessageBound) << what;
}

class ErrorContractTest : public ServerClientFixture {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(
        StartServer({"--max_ttl_seconds=100", "--default_ttl_seconds=60"}, "contract"));
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  }

  // Creates `id` holding `tokens` random tokens.
  void CreateWithTokens(const std::string& id, int tokens) {
    CreateOptions create;
    create.sequence_id = id;
    create.config = Config();
    ASSERT_TRUE(client_->CreateSequence(create).ok());
    if (tokens == 0) return;
    absl::StatusOr<AppendResult> r = client_->AppendPrompt(
        id, Random({kLayers, kHeads, tokens, kDim}, 1), Random({kLayers, kHeads, tokens, kDim}, 2));
    ASSERT_TRUE(r.ok()) << r.status();
  }

  // Tokens stored in layer `layer` (an AppendAttend appends to one layer).
  int LayerTokens(const std::string& id, int layer) {
    FetchOptions o;
    o.layer_begin = layer;
    o.layer_end = layer + 1;
    absl::StatusOr<FetchedKv> kv = client_->FetchDequant(id, o);
    EXPECT_TRUE(kv.ok()) << kv.status();
    return kv.ok() ? static_cast<int>(kv->k.shape[2]) : -1;
  }

  int Tokens(const std::string& id) {
    absl::StatusOr<v1::StatsResponse> st = client_->Stats(id);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? st->num_tokens() : -1;
  }

  v1::SequenceRef Ref(const std::string& id) {
    v1::SequenceRef r;
    r.set_namespace_(ns_);
    r.set_sequence_id(id);
    return r;
  }

  std::shared_ptr<grpc::Channel> channel_;
};

// One request of every method, with its sequence (or session) named by
// `ref` and `session`, its scheme `scheme`: (method, serialized request).
std::vector<std::pair<std::string, std::string>> EveryRequest(const v1::SequenceRef& ref,
                                                              const std::string& session,
                                                              const std::string& scheme) {
  std::vector<std::pair<std::string, std::string>> out;
  v1::CreateSequenceRequest create;
  create.set_namespace_(ref.namespace_());
  create.set_sequence_id(ref.sequence_id());
  create.set_scheme(scheme);
  SetLayout(create.mutable_layout());
  out.emplace_back("CreateSequence", create.SerializeAsString());
  v1::AppendRequest append;
  *append.mutable_sequence() = ref;
  out.emplace_back("Append", append.SerializeAsString());
  v1::FetchRequest fetch;
  *fetch.mutable_sequence() = ref;
  out.emplace_back("FetchDequant", fetch.SerializeAsString());
  v1::AttendRequest attend;
  *attend.add_items()->mutable_sequence() = ref;
  out.emplace_back("Attend", attend.SerializeAsString());
  v1::AppendAttendRequest append_attend;
  *append_attend.add_items()->mutable_sequence() = ref;
  out.emplace_back("AppendAttend", append_attend.SerializeAsString());
  v1::DecodeRequest decode;
  *decode.mutable_step()->add_items()->mutable_sequence() = ref;
  out.emplace_back("DecodeStream", decode.SerializeAsString());
  v1::ForkRequest fork;
  *fork.mutable_source() = ref;
  out.emplace_back("Fork", fork.SerializeAsString());
  v1::ReleaseRequest release;
  *release.mutable_sequence() = ref;
  out.emplace_back("Release", release.SerializeAsString());
  v1::StatsRequest stats;
  *stats.mutable_sequence() = ref;
  out.emplace_back("Stats", stats.SerializeAsString());
  v1::CloseTransferRequest close;
  close.set_session_id(session);
  out.emplace_back("CloseTransfer", close.SerializeAsString());
  v1::AppendDeviceRequest append_device;
  *append_device.mutable_sequence() = ref;
  out.emplace_back("AppendDevice", append_device.SerializeAsString());
  v1::FetchDeviceRequest fetch_device;
  *fetch_device.mutable_sequence() = ref;
  out.emplace_back("FetchDevice", fetch_device.SerializeAsString());
  return out;
}

// The path of the sequence's field in each method's request.
std::string SequencePath(const std::string& method, const std::string& field) {
  if (method == "CreateSequence") return field;
  if (method == "Attend" || method == "AppendAttend") return "items[0].sequence." + field;
  if (method == "DecodeStream") return "step.items[0].sequence." + field;
  if (method == "Fork") return "source." + field;
  return "sequence." + field;
}

TEST_F(ErrorContractTest, LongIdsNamespacesAndSchemesAreRefusedOnEveryMethodInShortMessages) {
  ASSERT_NO_FATAL_FAILURE(CreateWithTokens("kept", 40));
  const std::string long_name(20000, 'x');
  const std::string long_scheme = "kivi2:" + std::string(19994, 'g');
  v1::SequenceRef long_id = Ref(long_name);
  v1::SequenceRef long_ns = Ref("kept");
  long_ns.set_namespace_(long_name);
  for (const auto& [method, bytes] : EveryRequest(long_id, "s", "int8")) {
    if (method == "CloseTransfer") continue;  // It names no sequence.
    ExpectInvalid(RawCall(channel_.get(), method, bytes),
                  SequencePath(method, "sequence_id") + " has 20000 bytes; the limit is 128",
                  method + " with a long sequence_id");
  }
  for (const auto& [method, bytes] : EveryRequest(long_ns, "s", "int8")) {
    if (method == "CloseTransfer") continue;
    ExpectInvalid(RawCall(channel_.get(), method, bytes),
                  SequencePath(method, "namespace") + " has 20000 bytes; the limit is 128",
                  method + " with a long namespace");
  }
  ExpectInvalid(RawCall(channel_.get(), "CreateSequence",
                        EveryRequest(Ref("new"), "s", long_scheme)[0].second),
                "scheme has 20000 bytes; the limit is 256", "a long scheme");
  ExpectInvalid(
      RawCall(channel_.get(), "CloseTransfer", EveryRequest(Ref("x"), long_name, "int8")[9].second),
      "session_id has 20000 bytes; the limit is 128", "a long session_id");
  v1::ForkRequest fork;
  *fork.mutable_source() = Ref("kept");
  fork.set_new_sequence_id(long_name);
  ExpectInvalid(RawCall(channel_.get(), "Fork", fork.SerializeAsString()),
                "new_sequence_id has 20000 bytes; the limit is 128", "a long new_sequence_id");

  // Through the generated stub, as a client written from the proto sends
  // them: the status is readable (not RESOURCE_EXHAUSTED from a status
  // too large for the client's metadata limit).
  {
    grpc::ClientContext ctx;
    v1::StatsRequest req;
    *req.mutable_sequence() = long_id;
    v1::StatsResponse resp;
    ExpectInvalid(stub_->Stats(&ctx, req, &resp), "sequence.sequence_id has 20000 bytes",
                  "typed Stats");
  }
  {
    grpc::ClientContext ctx;
    v1::FetchRequest req;
    *req.mutable_sequence() = long_ns;
    std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> reader = stub_->FetchDequant(&ctx, req);
    v1::FetchResponse resp;
    while (reader->Read(&resp)) {
    }
    ExpectInvalid(reader->Finish(), "sequence.namespace has 20000 bytes", "typed FetchDequant");
  }
  {
    grpc::ClientContext ctx;
    v1::CreateSequenceRequest req;
    req.set_sequence_id("new");
    req.set_scheme(long_scheme);
    SetLayout(req.mutable_layout());
    v1::CreateSequenceResponse resp;
    ExpectInvalid(stub_->CreateSequence(&ctx, req, &resp), "scheme has 20000 bytes",
                  "typed CreateSequence");
  }
  // Input within the bounds is still quoted by its prefix only: a scheme
  // the parser refuses, echoed twice before, and an unknown 128-byte id.
  {
    grpc::ClientContext ctx;
    v1::CreateSequenceRequest req;
    req.set_sequence_id("new");
    req.set_scheme("kivi2:" + std::string(250, 'q'));
    SetLayout(req.mutable_layout());
    v1::CreateSequenceResponse resp;
    const grpc::Status st = stub_->CreateSequence(&ctx, req, &resp);
    ExpectInvalid(st,
                  absl::StrCat("scheme \"kivi2:", std::string(26, 'q'),
                               "...\" (256 bytes): unknown option \"", std::string(32, 'q'),
                               "...\" (250 bytes); expected"),
                  "a long bad scheme");
  }
  {
    grpc::ClientContext ctx;
    v1::StatsRequest req;
    *req.mutable_sequence() = Ref(std::string(128, 'u'));
    v1::StatsResponse resp;
    const grpc::Status st = stub_->Stats(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
    EXPECT_EQ(st.error_message(), absl::StrCat("sequence \"", std::string(32, 'u'),
                                               "...\" (128 bytes) in namespace \"contract\" does "
                                               "not exist"));
  }
  EXPECT_EQ(Tokens("kept"), 40) << "refused requests change nothing";
}

TEST_F(ErrorContractTest, UndecodableRequestsAreInvalidArgumentNamingTheFieldOnEveryMethod) {
  ASSERT_NO_FATAL_FAILURE(CreateWithTokens("kept", 40));
  // Not protobuf at all: a varint of more than ten bytes.
  const std::string garbage(11, '\xff');
  const std::vector<std::pair<std::string, std::string>> types = {
      {"GetServerInfo", "GetServerInfoRequest"},
      {"CreateSequence", "CreateSequenceRequest"},
      {"Append", "AppendRequest"},
      {"FetchDequant", "FetchRequest"},
      {"Attend", "AttendRequest"},
      {"AppendAttend", "AppendAttendRequest"},
      {"DecodeStream", "DecodeRequest"},
      {"Fork", "ForkRequest"},
      {"Release", "ReleaseRequest"},
      {"Stats", "StatsRequest"},
      {"OpenTransfer", "OpenTransferRequest"},
      {"CloseTransfer", "CloseTransferRequest"},
      {"AppendDevice", "AppendDeviceRequest"},
      {"FetchDevice", "FetchDeviceRequest"}};
  for (const auto& [method, type] : types) {
    const grpc::Status st = RawCall(channel_.get(), method, garbage);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_EQ(st.error_message(), "request is not a valid kvq.v1." + type) << method;
  }
  // Invalid UTF-8 in a string field: the same length as the placeholder,
  // so every length prefix around it still holds.
  const std::string placeholder = "@@@@@@@";
  const std::string bad_utf8 = "ok\xc3\x28\xff\xfe!";
  ASSERT_EQ(placeholder.size(), bad_utf8.size());
  auto corrupt = [&](const std::string& bytes) {
    return absl::StrReplaceAll(bytes, {{placeholder, bad_utf8}});
  };
  for (const auto& [method, bytes] : EveryRequest(Ref(placeholder), placeholder, "int8")) {
    const std::string path =
        method == "CloseTransfer" ? "session_id" : SequencePath(method, "sequence_id");
    const grpc::Status st = RawCall(channel_.get(), method, corrupt(bytes));
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_EQ(st.error_message(), path + " is not valid UTF-8") << method;
  }
  for (const auto& [method, bytes] : EveryRequest(Ref("kept"), "s", placeholder)) {
    if (method != "CreateSequence") continue;
    const grpc::Status st = RawCall(channel_.get(), method, corrupt(bytes));
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(), "scheme is not valid UTF-8");
  }
  // The second item of an Attend.
  v1::AttendRequest attend;
  *attend.add_items()->mutable_sequence() = Ref("kept");
  *attend.add_items()->mutable_sequence() = Ref(placeholder);
  const grpc::Status st = RawCall(channel_.get(), "Attend", corrupt(attend.SerializeAsString()));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(), "items[1].sequence.sequence_id is not valid UTF-8");
  EXPECT_EQ(Tokens("kept"), 40);
}

TEST_F(ErrorContractTest, LeasesAboveTheMaximumAreCappedAndReported) {
  // The server runs with --max_ttl_seconds=100 --default_ttl_seconds=60.
  struct Case {
    uint32_t asked, granted;
  };
  for (const Case& c :
       {Case{0, 60}, Case{30, 30}, Case{100, 100}, Case{101, 100}, Case{4000000000u, 100}}) {
    grpc::ClientContext ctx;
    v1::CreateSequenceRequest req;
    req.set_namespace_(ns_);
    req.set_sequence_id(absl::StrCat("ttl-", c.asked));
    req.set_scheme("int8");
    req.set_ttl_seconds(c.asked);
    SetLayout(req.mutable_layout());
    v1::CreateSequenceResponse resp;
    const grpc::Status st = stub_->CreateSequence(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << c.asked << ": " << st.error_message();
    EXPECT_EQ(resp.ttl_seconds(), c.granted) << "asked " << c.asked;
  }
  for (const Case& c : {Case{0, 30}, Case{7, 7}, Case{500, 100}}) {
    grpc::ClientContext ctx;
    v1::ForkRequest req;
    *req.mutable_source() = Ref("ttl-30");
    req.set_new_sequence_id(absl::StrCat("fork-", c.asked));
    req.set_ttl_seconds(c.asked);
    v1::ForkResponse resp;
    const grpc::Status st = stub_->Fork(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << c.asked << ": " << st.error_message();
    EXPECT_EQ(resp.ttl_seconds(), c.granted) << "fork asked " << c.asked << " (source: 30)";
  }
  // The C++ client reports the lease granted too.
  CreateOptions create;
  create.sequence_id = "client-ttl";
  create.config = Config();
  create.ttl_seconds = 1000;
  absl::StatusOr<SequenceInfo> info = client_->CreateSequence(create);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->ttl_seconds, 100u);
  ForkOptions fork;
  fork.new_sequence_id = "client-ttl-fork";
  fork.ttl_seconds = 20;
  absl::StatusOr<ForkResult> forked = client_->Fork("client-ttl", fork);
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(forked->ttl_seconds, 20u);
}

TEST_F(ErrorContractTest, OneSequenceTwiceInAnAppendAttendIsRefusedAndNothingIsStored) {
  ASSERT_NO_FATAL_FAILURE(CreateWithTokens("a", 40));
  ASSERT_NO_FATAL_FAILURE(CreateWithTokens("b", 40));
  v1::AppendAttendRequest req;
  req.set_layer(0);
  for (const char* id : {"a", "b", "a"}) {
    v1::AppendAttendItem* it = req.add_items();
    *it->mutable_sequence() = Ref(id);
    Fill(it->mutable_k(), {kHeads, 1, kDim}, 0.5f);
    Fill(it->mutable_v(), {kHeads, 1, kDim}, 0.25f);
    Fill(it->mutable_q(), {1, kQHeads, kDim}, 0.125f);
  }
  {
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    const grpc::Status st = stub_->AppendAttend(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(),
              "items[2] names the same sequence as items[0]; a sequence may appear once per call");
  }
  // The same through a DecodeStream step.
  {
    grpc::ClientContext ctx;
    auto stream = stub_->DecodeStream(&ctx);
    v1::DecodeRequest step;
    *step.mutable_step() = req;
    ASSERT_TRUE(stream->Write(step));
    stream->WritesDone();
    v1::DecodeResponse resp;
    EXPECT_FALSE(stream->Read(&resp));
    const grpc::Status st = stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(
        absl::StrContains(st.error_message(), "items[2] names the same sequence as items[0]"))
        << st.error_message();
  }
  EXPECT_EQ(LayerTokens("a", 0), 40);
  EXPECT_EQ(LayerTokens("b", 0), 40) << "the other item is not appended either";
  // Without the repeat the same call goes through.
  req.mutable_items()->RemoveLast();
  grpc::ClientContext ctx;
  v1::AttendResponse resp;
  ASSERT_TRUE(stub_->AppendAttend(&ctx, req, &resp).ok());
  EXPECT_EQ(LayerTokens("a", 0), 41);
  EXPECT_EQ(LayerTokens("b", 0), 41);
  // And so does a stream of such steps, each answered in turn.
  grpc::ClientContext stream_ctx;
  auto stream = stub_->DecodeStream(&stream_ctx);
  for (int layer : {1, 0}) {
    v1::DecodeRequest step;
    *step.mutable_step() = req;
    step.mutable_step()->set_layer(layer);
    ASSERT_TRUE(stream->Write(step));
    v1::DecodeResponse answer;
    ASSERT_TRUE(stream->Read(&answer)) << "layer " << layer;
    EXPECT_EQ(answer.result().results_size(), 2);
  }
  stream->WritesDone();
  const grpc::Status finished = stream->Finish();
  EXPECT_TRUE(finished.ok()) << finished.error_message();
  EXPECT_EQ(LayerTokens("a", 0), 42);
  EXPECT_EQ(LayerTokens("a", 1), 41);
}

TEST_F(ErrorContractTest, AnEmptyKeyRangeIsOkWithZeroOutAndMinusInfinityLse) {
  ASSERT_NO_FATAL_FAILURE(CreateWithTokens("full", 40));
  ASSERT_NO_FATAL_FAILURE(CreateWithTokens("empty", 0));
  v1::AttendRequest req;
  req.set_layer(1);
  v1::AttendItem* ranged = req.add_items();
  *ranged->mutable_sequence() = Ref("full");
  Fill(ranged->mutable_q(), {2, kQHeads, kDim}, 0.5f);
  ranged->set_key_begin(17);
  ranged->set_key_end(17);
  v1::AttendItem* none = req.add_items();
  *none->mutable_sequence() = Ref("empty");
  Fill(none->mutable_q(), {1, kQHeads, kDim}, 0.5f);
  grpc::ClientContext ctx;
  v1::AttendResponse resp;
  const grpc::Status st = stub_->Attend(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.results_size(), 2);
  for (int i = 0; i < 2; ++i) {
    const std::vector<float> out = Floats(resp.results(i).out());
    const std::vector<float> lse = Floats(resp.results(i).lse());
    ASSERT_EQ(out.size(), static_cast<size_t>((i == 0 ? 2 : 1) * kQHeads * kDim));
    ASSERT_EQ(lse.size(), static_cast<size_t>((i == 0 ? 2 : 1) * kQHeads));
    for (float x : out) EXPECT_EQ(x, 0.0f) << "item " << i;
    for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity()) << "item " << i;
  }
  // A range outside the stored tokens is still OUT_OF_RANGE.
  ranged->set_key_begin(41);
  ranged->set_key_end(41);
  grpc::ClientContext ctx2;
  EXPECT_EQ(stub_->Attend(&ctx2, req, &resp).error_code(), grpc::StatusCode::OUT_OF_RANGE);
}

TEST(ErrorContractTenantTest, TwoAuthorizationHeadersAreUnauthenticated) {
  char dir[] = "/tmp/kvq-contract-it-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string tokens = std::string(dir) + "/tokens";
  std::ofstream(tokens) << "tenant=a token=tenant-a-token-0123456789\n"
                        << "tenant=b token=tenant-b-token-9876543210\n";
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start({"--tokens_file=" + tokens}).ok());
  std::unique_ptr<v1::KvCache::Stub> stub = v1::KvCache::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  auto stats = [&](const std::vector<std::string>& headers) {
    grpc::ClientContext ctx;
    for (const std::string& h : headers) ctx.AddMetadata("authorization", h);
    v1::StatsRequest req;
    v1::StatsResponse resp;
    return stub->Stats(&ctx, req, &resp);
  };
  const std::string a = "Bearer tenant-a-token-0123456789";
  const std::string b = "Bearer tenant-b-token-9876543210";
  EXPECT_TRUE(stats({a}).ok());
  for (const std::vector<std::string>& twice : {std::vector<std::string>{a, b}, {a, a}, {b, "x"}}) {
    const grpc::Status st = stats(twice);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(st.error_message(),
              "more than one authorization header; send exactly one bearer token");
  }
  std::remove(tokens.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace kvq
