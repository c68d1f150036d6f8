// The device payload RPCs (AppendDevice, FetchDevice, OpenTransfer,
// CloseTransfer) through the real handlers on a loopback server and the
// real C++ client, with the in-process fake transport: exact bytes against
// the gRPC path, every fault's status code, nothing stored or allocated by
// a failed transfer, the session table's lifecycle, and the server without
// a transport answering FAILED_PRECONDITION.
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "service/kvq_service.h"
#include "service/metrics.h"
#include "tests/client/random_host_tensor.h"
#include "tests/service/store_test_data.h"
#include "tests/transport/fake_transport.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64, kTokens = 200;
using Fault = FakeTransportHub::Fault;

HostTensor RandomFp16(uint32_t seed) {
  return RandomHostTensor({kLayers, kHeads, kTokens, kDim}, seed, DType::kFloat16);
}

class DeviceRpcsTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(/*with_transports=*/true); }
  void TearDown() override { Stop(); }

  void Start(bool with_transports) {
    store_ = NewTestStore(32 << 20);
    metrics_ = std::move(*Metrics::Create("", store_.get(), "host"));
    ServiceOptions o;
    o.transfer_timeout = absl::Milliseconds(300);
    service_ = std::make_unique<KvqService>(store_.get(), metrics_.get(), o);
    if (with_transports) {
      service_->set_transport(TransportKind::kCudaIpc, &ipc_);
      service_->set_transport(TransportKind::kNccl, &nccl_);
    }
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ClientOptions co;
    co.target = absl::StrCat("127.0.0.1:", port_);
    co.retry.max_attempts = 1;
    client_ = std::move(*KvqClient::Connect(co));
    stub_ = v1::KvCache::NewStub(
        grpc::CreateChannel(co.target, grpc::InsecureChannelCredentials()));
  }
  void Stop() {
    client_.reset();
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }

  std::string Create(const std::string& id) {
    CreateOptions c;
    c.sequence_id = id;
    c.config.layout = {kLayers, kHeads, kQHeads, kDim};
    c.config.scheme = "kivi4:g32:r64";
    absl::StatusOr<SequenceInfo> s = client_->CreateSequence(c);
    EXPECT_TRUE(s.ok()) << s.status();
    return id;
  }

  // Every byte a sequence holds, dequantized to fp16 over gRPC.
  std::string Bytes(const std::string& id) {
    absl::StatusOr<FetchedKv> f = client_->FetchDequant(id);
    if (!f.ok()) return "error: " + f.status().ToString();
    return f->k.data + f->v.data;
  }

  int64_t UsedBytes() { return store_->pool().Stats().used_bytes; }
  std::string Scrape() { return metrics_->Scrape(); }

  FakeTransportHub hub_;
  FakeKvTransport ipc_{&hub_, TransportKind::kCudaIpc};
  FakeKvTransport nccl_{&hub_, TransportKind::kNccl};
  std::unique_ptr<SequenceStore> store_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<KvqService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<KvqClient> client_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

AppendOptions DeviceAppend(DevicePeer* peer, HostTensor& k, HostTensor& v) {
  AppendOptions o;
  o.device.transport = peer->kind();
  o.device.peer = peer;
  o.device.k = k.data.data();
  o.device.v = v.data.data();
  return o;
}

// The shape-only tensors a device fetch takes, and the "device" buffers.
struct DeviceOut {
  HostTensor k = HostTensor::Zeros(DType::kFloat16, {kLayers, kHeads, kTokens, kDim});
  HostTensor v = HostTensor::Zeros(DType::kFloat16, {kLayers, kHeads, kTokens, kDim});
  std::string dk = std::string(k.data.size(), '\x7f'), dv = std::string(v.data.size(), '\x7f');
};

FetchOptions DeviceFetch(DevicePeer* peer, DeviceOut& out) {
  FetchOptions o;
  o.device.transport = peer->kind();
  o.device.peer = peer;
  o.device.k = out.dk.data();
  o.device.v = out.dv.data();
  return o;
}

TEST_F(DeviceRpcsTest, CudaIpcAppendAndFetchEqualTheGrpcPathByteForByte) {
  HostTensor k = RandomFp16(1), v = RandomFp16(2);
  ASSERT_TRUE(client_->AppendPrompt(Create("grpc"), k, v).ok());
  FakeDevicePeer peer(&hub_, PayloadTransport::kCudaIpc);
  peer.Register(k.data.data(), k.data.size());
  peer.Register(v.data.data(), v.data.size());
  absl::StatusOr<AppendResult> r =
      client_->AppendPrompt(Create("ipc"), k, v, DeviceAppend(&peer, k, v));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_tokens, kTokens);
  EXPECT_EQ(r->wire_bytes, 0);
  const std::string want = Bytes("grpc");
  ASSERT_EQ(want.size(), 2 * k.data.size());
  EXPECT_EQ(Bytes("ipc"), want);

  DeviceOut out;
  peer.Register(out.dk.data(), out.dk.size());
  peer.Register(out.dv.data(), out.dv.size());
  ASSERT_TRUE(client_->FetchDequantInto("ipc", DeviceFetch(&peer, out), &out.k, &out.v).ok());
  EXPECT_EQ(out.dk + out.dv, want);
  EXPECT_TRUE(absl::StrContains(
      Scrape(),
      "kvq_device_transfers_total{code=\"OK\",direction=\"receive\",transport=\"cuda_ipc\"} 2"));
  EXPECT_TRUE(absl::StrContains(
      Scrape(),
      "kvq_device_transfers_total{code=\"OK\",direction=\"send\",transport=\"cuda_ipc\"} 2"));
}

TEST_F(DeviceRpcsTest, NcclSessionAppendAndFetchEqualTheGrpcPathAndCloseTheirSessions) {
  HostTensor k = RandomFp16(3), v = RandomFp16(4);
  ASSERT_TRUE(client_->AppendPrompt(Create("grpc"), k, v).ok());
  FakeDevicePeer peer(&hub_, PayloadTransport::kNccl);
  absl::StatusOr<AppendResult> r =
      client_->AppendPrompt(Create("nccl"), k, v, DeviceAppend(&peer, k, v));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Bytes("nccl"), Bytes("grpc"));
  DeviceOut out;
  ASSERT_TRUE(client_->FetchDequantInto("nccl", DeviceFetch(&peer, out), &out.k, &out.v).ok());
  EXPECT_EQ(out.dk + out.dv, Bytes("grpc"));
  EXPECT_EQ(service_->transfer_sessions().size(), 0);
  EXPECT_EQ(hub_.open_sessions(), 0);
}

// A fault leaves the pool's allocation and every stored byte as they were,
// answers its own code, and is counted.
struct FaultCase {
  PayloadTransport transport;
  Fault fault;
  std::string field;
  absl::StatusCode code;
  std::string message;
};

class DeviceFaultTest : public DeviceRpcsTest, public ::testing::WithParamInterface<FaultCase> {};

TEST_P(DeviceFaultTest, FailedAppendStoresNothingAndFreesItsPages) {
  const FaultCase& c = GetParam();
  HostTensor k = RandomFp16(5), v = RandomFp16(6);
  ASSERT_TRUE(client_->AppendPrompt(Create("kept"), k, v).ok());
  Create("target");
  // Half the prompt is stored already: the failed append must keep it.
  HostTensor k1 = RandomFp16(7), v1 = RandomFp16(8);
  ASSERT_TRUE(client_->AppendPrompt("target", k1, v1).ok());
  const std::string kept = Bytes("kept"), target = Bytes("target");
  const int64_t used = UsedBytes();

  FakeDevicePeer peer(&hub_, c.transport);
  peer.Register(k.data.data(), k.data.size());
  peer.Register(v.data.data(), v.data.size());
  hub_.set_fault(c.fault, c.field);
  AppendOptions o = DeviceAppend(&peer, k, v);
  const absl::Time start = absl::Now();
  absl::StatusOr<AppendResult> r = client_->AppendPrompt("target", k, v, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), c.code) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), c.message)) << r.status();
  if (c.fault == Fault::kNeverArrives) {
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));  // The server's transfer_timeout.
  }
  EXPECT_EQ(UsedBytes(), used);
  EXPECT_EQ(Bytes("kept"), kept);
  EXPECT_EQ(Bytes("target"), target);
  EXPECT_EQ(service_->transfer_sessions().size(), 0);  // A failed session is closed.
  const std::string code = absl::StatusCodeToString(c.code);
  EXPECT_TRUE(absl::StrContains(
      Scrape(), absl::StrCat("kvq_device_transfers_total{code=\"", code,
                             "\",direction=\"receive\",transport=\"",
                             PayloadTransportName(c.transport), "\"} 1")))
      << Scrape();

  // The same append without the fault then succeeds.
  hub_.set_fault(Fault::kNone);
  ASSERT_TRUE(client_->AppendPrompt("target", k, v, o).ok());
  EXPECT_EQ(Bytes("kept"), kept);
}

TEST_P(DeviceFaultTest, FailedFetchLeavesTheSequenceAsItWas) {
  const FaultCase& c = GetParam();
  HostTensor k = RandomFp16(9), v = RandomFp16(10);
  ASSERT_TRUE(client_->AppendPrompt(Create("s"), k, v).ok());
  const std::string before = Bytes("s");
  const int64_t used = UsedBytes();
  FakeDevicePeer peer(&hub_, c.transport);
  DeviceOut out;
  peer.Register(out.dk.data(), out.dk.size());
  peer.Register(out.dv.data(), out.dv.size());
  hub_.set_fault(c.fault, c.field);
  FetchOptions o = DeviceFetch(&peer, out);
  o.call.deadline = absl::Seconds(2);
  const absl::Status st = client_->FetchDequantInto("s", o, &out.k, &out.v);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), c.code) << st;
  EXPECT_EQ(Bytes("s"), before);
  EXPECT_EQ(UsedBytes(), used);
  EXPECT_EQ(service_->transfer_sessions().size(), 0);
}

std::string FaultName(const ::testing::TestParamInfo<FaultCase>& i) {
  static const char* const kNames[] = {"None", "PeerVanishes", "NeverArrives", "ShortPayload"};
  return absl::StrCat(PayloadTransportName(i.param.transport),
                      kNames[static_cast<int>(i.param.fault)]);
}

INSTANTIATE_TEST_SUITE_P(
    Faults, DeviceFaultTest,
    ::testing::Values(
        FaultCase{PayloadTransport::kCudaIpc, Fault::kPeerVanishes, "v",
                  absl::StatusCode::kUnavailable, "v: the peer went away after"},
        FaultCase{PayloadTransport::kCudaIpc, Fault::kNeverArrives, "",
                  absl::StatusCode::kDeadlineExceeded, "k: the peer moved no bytes"},
        FaultCase{PayloadTransport::kCudaIpc, Fault::kShortPayload, "k",
                  absl::StatusCode::kInvalidArgument, "k.size = "},
        FaultCase{PayloadTransport::kNccl, Fault::kPeerVanishes, "k",
                  absl::StatusCode::kUnavailable, "k: the peer went away after"},
        FaultCase{PayloadTransport::kNccl, Fault::kNeverArrives, "v",
                  absl::StatusCode::kDeadlineExceeded, "v: the peer moved no bytes"},
        FaultCase{PayloadTransport::kNccl, Fault::kShortPayload, "",
                  absl::StatusCode::kInvalidArgument, "k.size = "}),
    FaultName);

TEST_F(DeviceRpcsTest, WrongSizeOrHandleIsInvalidArgumentNamingTheField) {
  Create("s");
  const int64_t used = UsedBytes();
  v1::AppendDeviceRequest req;
  req.mutable_sequence()->set_sequence_id("s");
  req.set_dtype(v1::DTYPE_FP16);
  for (int64_t d : {kLayers, kHeads, 10, kDim}) req.add_shape(d);
  const int64_t bytes = int64_t{kLayers} * kHeads * 10 * kDim * 2;
  std::string buf(bytes, '\0');
  const std::string handle = hub_.Export(buf.data(), buf.size());
  req.mutable_k()->mutable_cuda_ipc()->set_handle(handle);
  req.mutable_k()->mutable_cuda_ipc()->set_size(bytes);
  req.mutable_v()->mutable_cuda_ipc()->set_handle(handle);
  req.mutable_v()->mutable_cuda_ipc()->set_size(bytes - 2);
  v1::AppendResponse resp;
  {
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->AppendDevice(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(), absl::StrCat("v.size = ", bytes - 2, " must be ", bytes,
                                               " (the request's shape and dtype)"));
  }
  req.mutable_v()->mutable_cuda_ipc()->set_size(bytes);
  req.mutable_v()->mutable_cuda_ipc()->set_handle(std::string(64, 'x'));
  {
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->AppendDevice(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(), "v.cuda_ipc.handle is not an allocation exported on this node");
  }
  req.mutable_v()->mutable_transfer()->set_session_id("x");
  {
    grpc::ClientContext ctx;
    const grpc::Status st = stub_->AppendDevice(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(), "k and v must use the same transport");
  }
  EXPECT_EQ(UsedBytes(), used);
}

TEST_F(DeviceRpcsTest, SessionsExpireBelongToTheirTenantAndCarryOneRequestAtATime) {
  TransferSessions& s = service_->transfer_sessions();
  const absl::Time now = absl::Now();
  absl::StatusOr<TransferSessions::Opened> a =
      s.Open(&nccl_, "tenant-a", absl::Seconds(5), now, now + absl::Seconds(1));
  ASSERT_TRUE(a.ok()) << a.status();
  const std::string id = a->descriptor.session_id;
  EXPECT_EQ(a->descriptor.nccl_unique_id.size(), 128u);
  EXPECT_EQ(s.Acquire(id, "tenant-b", now).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(s.Acquire(id, "tenant-a", now).ok());
  EXPECT_EQ(s.Acquire(id, "tenant-a", now).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Busy sessions never expire; idle ones do, one ttl after their last use.
  EXPECT_EQ(s.ExpireIdle(now + absl::Seconds(60)), 0);
  s.Release(id, /*failed=*/false, now + absl::Seconds(60));
  EXPECT_EQ(s.ExpireIdle(now + absl::Seconds(64)), 0);
  EXPECT_EQ(hub_.open_sessions(), 1);
  EXPECT_EQ(s.ExpireIdle(now + absl::Seconds(65)), 1);
  EXPECT_EQ(hub_.open_sessions(), 0);  // Closed on the transport too.
  const absl::Status gone = s.Acquire(id, "tenant-a", now + absl::Seconds(65)).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.message(), absl::StrCat("transfer session \"", id,
                                         "\" is unknown, expired or closed; open a new one"));
  // The lease asked for is capped at the server's maximum (10 minutes).
  absl::StatusOr<TransferSessions::Opened> b =
      s.Open(&nccl_, "", absl::Hours(5), now, now + absl::Seconds(1));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ttl, absl::Minutes(10));
}

TEST_F(DeviceRpcsTest, OpenTransferOverRpcAndCloseTransfer) {
  v1::OpenTransferRequest req;
  req.set_transport(v1::TRANSPORT_NCCL);
  req.set_ttl_seconds(7);
  v1::OpenTransferResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->OpenTransfer(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.world_size(), 2);
  EXPECT_EQ(resp.server_rank(), 0);
  EXPECT_EQ(resp.client_rank(), 1);
  EXPECT_EQ(resp.ttl_seconds(), 7u);
  v1::CloseTransferRequest close;
  close.set_session_id(resp.session_id());
  v1::CloseTransferResponse closed;
  grpc::ClientContext c1, c2;
  EXPECT_TRUE(stub_->CloseTransfer(&c1, close, &closed).ok());
  EXPECT_EQ(stub_->CloseTransfer(&c2, close, &closed).error_code(), grpc::StatusCode::NOT_FOUND);
  req.set_transport(v1::TRANSPORT_CUDA_IPC);
  grpc::ClientContext c3;
  const grpc::Status st = stub_->OpenTransfer(&c3, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(st.error_message(), "transport = TRANSPORT_CUDA_IPC"));
}

TEST_F(DeviceRpcsTest, ServerWithoutCudaTransportAnswersFailedPrecondition) {
  Stop();
  Start(/*with_transports=*/false);
  HostTensor k = RandomFp16(11), v = RandomFp16(12);
  Create("s");
  const int64_t used = UsedBytes();
  FakeDevicePeer ipc(&hub_, PayloadTransport::kCudaIpc);
  ipc.Register(k.data.data(), k.data.size());
  ipc.Register(v.data.data(), v.data.size());
  absl::StatusOr<AppendResult> r = client_->AppendPrompt("s", k, v, DeviceAppend(&ipc, k, v));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(r.status().message(),
                               "this server has no CUDA transport (cuda_ipc)"))
      << r.status();
  FakeDevicePeer nccl(&hub_, PayloadTransport::kNccl);
  r = client_->AppendPrompt("s", k, v, DeviceAppend(&nccl, k, v));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(r.status().message(), "this server has no CUDA transport (nccl)"))
      << r.status();
  DeviceOut out;
  ipc.Register(out.dk.data(), out.dk.size());
  ipc.Register(out.dv.data(), out.dv.size());
  const absl::Status st = client_->FetchDequantInto("s", DeviceFetch(&ipc, out), &out.k, &out.v);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(UsedBytes(), used);
}

TEST_F(DeviceRpcsTest, ClientRefusesAMissingOrMismatchedPeer) {
  HostTensor k = RandomFp16(13), v = RandomFp16(14);
  Create("s");
  AppendOptions o;
  o.device.transport = PayloadTransport::kCudaIpc;
  absl::StatusOr<AppendResult> r = client_->AppendPrompt("s", k, v, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(r.status().message(), "transport = \"cuda_ipc\" needs device.peer"));
  FakeDevicePeer nccl(&hub_, PayloadTransport::kNccl);
  o = DeviceAppend(&nccl, k, v);
  o.device.transport = PayloadTransport::kCudaIpc;
  r = client_->AppendPrompt("s", k, v, o);
  EXPECT_EQ(r.status().message(), "device.peer is a nccl peer, transport is \"cuda_ipc\"");
  EXPECT_EQ(ParsePayloadTransport("rdma").status().message(),
            "transport = \"rdma\" must be \"grpc\", \"cuda_ipc\" or \"nccl\"");
  EXPECT_EQ(*ParsePayloadTransport("nccl"), PayloadTransport::kNccl);
}

}  // namespace
}  // namespace kvq
