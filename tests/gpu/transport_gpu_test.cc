// The real device payload paths on GPUs (ctest label gpu):
// - CUDA IPC between two processes on one GPU: this process serves kvq with
//   CudaIpcTransport; a child process (this binary with --ipc_client=PORT)
//   appends from and fetches into its own device memory through a handle.
// - NCCL with 2 ranks: the server's NcclTransport on device 0, the client's
//   NcclPeer on device 1.
// Each checks the bytes against the gRPC path and skips itself with a
// message without enough devices.
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/kvq_client.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "client/cuda_device_peers.h"
#include "service/transport/cuda_ipc_transport.h"
#include "kernels/cuda/device_info.h"
#include "service/kvq_service.h"
#include "service/metrics.h"
#include "service/unary_call.h"
#include "tests/client/random_host_tensor.h"
#include "tests/service/store_test_data.h"
#ifdef KVQ_HAVE_NCCL
#include "service/transport/nccl_transport.h"
#endif

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64, kTokens = 300;

HostTensor RandomFp16(uint32_t seed) {
  return RandomHostTensor({kLayers, kHeads, kTokens, kDim}, seed, DType::kFloat16);
}

std::unique_ptr<KvqClient> Connect(int port) {
  ClientOptions o;
  o.target = absl::StrCat("127.0.0.1:", port);
  o.retry.max_attempts = 1;
  return std::move(*KvqClient::Connect(o));
}

void CreateSequence(KvqClient& c, const std::string& id) {
  CreateOptions o;
  o.sequence_id = id;
  o.config.layout = {kLayers, kHeads, kQHeads, kDim, {}};
  o.config.scheme = "kivi4:g32:r64";
  ASSERT_TRUE(c.CreateSequence(o).ok());
}

// Device copies of a host tensor's bytes.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n, int device) : bytes(n) {
    (void)cudaSetDevice(device);
    if (cudaMalloc(&ptr, n) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { if (ptr) (void)cudaFree(ptr); }
  void* ptr = nullptr;
  size_t bytes;
};

// The child's side of the IPC test; its exit code is the verdict.
int IpcClient(int port) {
  std::unique_ptr<KvqClient> c = Connect(port);
  HostTensor k = RandomFp16(1), v = RandomFp16(2);
  DeviceBuffer dk(k.data.size(), 0), dv(v.data.size(), 0);
  if (!dk.ptr || !dv.ptr) return 10;
  cudaMemcpy(dk.ptr, k.data.data(), dk.bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(dv.ptr, v.data.data(), dv.bytes, cudaMemcpyHostToDevice);
  CudaIpcPeer peer(0);
  AppendOptions a;
  a.device = {PayloadTransport::kCudaIpc, &peer, dk.ptr, dv.ptr};
  absl::StatusOr<AppendResult> r = c->AppendPrompt("ipc", k, v, a);
  if (!r.ok()) {
    fprintf(stderr, "append: %s\n", r.status().ToString().c_str());
    return 11;
  }
  // Fetch back into fresh device memory and compare with the gRPC path.
  HostTensor ok = HostTensor::Zeros(DType::kFloat16, {kLayers, kHeads, kTokens, kDim});
  HostTensor ov = HostTensor::Zeros(DType::kFloat16, {kLayers, kHeads, kTokens, kDim});
  DeviceBuffer fk(ok.data.size(), 0), fv(ov.data.size(), 0);
  FetchOptions f;
  f.device = {PayloadTransport::kCudaIpc, &peer, fk.ptr, fv.ptr};
  if (absl::Status st = c->FetchDequantInto("ipc", f, &ok, &ov); !st.ok()) {
    fprintf(stderr, "fetch: %s\n", st.ToString().c_str());
    return 12;
  }
  std::string got(fk.bytes + fv.bytes, '\0');
  cudaMemcpy(got.data(), fk.ptr, fk.bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(got.data() + fk.bytes, fv.ptr, fv.bytes, cudaMemcpyDeviceToHost);
  absl::StatusOr<FetchedKv> want = c->FetchDequant("ipc");
  if (!want.ok() || got != want->k.data + want->v.data) return 13;
  return 0;
}

struct LoopbackServer {
  explicit LoopbackServer(KvTransport* ipc, KvTransport* nccl) {
    store = NewTestStore(64 << 20);
    metrics = std::move(*Metrics::Create("", store.get(), "host"));
    service = std::make_unique<KvqService>(store.get(), metrics.get(), ServiceOptions{});
    if (ipc) service->set_transport(TransportKind::kCudaIpc, ipc);
    if (nccl) service->set_transport(TransportKind::kNccl, nccl);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service.get());
    server = b.BuildAndStart();
  }
  ~LoopbackServer() { server->Shutdown(); }
  std::unique_ptr<SequenceStore> store;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<KvqService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

TEST(TransportGpuTest, CudaIpcBetweenTwoProcessesOnOneGpu) {
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device: the CUDA IPC test needs one GPU";
  CudaIpcTransport ipc(0);
  LoopbackServer s(&ipc, nullptr);
  std::unique_ptr<KvqClient> c = Connect(s.port);
  CreateSequence(*c, "ipc");
  CreateSequence(*c, "grpc");
  ASSERT_TRUE(c->AppendPrompt("grpc", RandomFp16(1), RandomFp16(2)).ok());
  // The child is a fresh process (exec), with its own CUDA context.
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string port = absl::StrCat("--ipc_client=", s.port);
    execl("/proc/self/exe", "transport_gpu_test", port.c_str(), nullptr);
    _exit(99);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the child's stderr";
  absl::StatusOr<FetchedKv> a = c->FetchDequant("ipc"), b = c->FetchDequant("grpc");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->k.data, b->k.data);
  EXPECT_EQ(a->v.data, b->v.data);
}

TEST(TransportGpuTest, NcclWithTwoRanks) {
#ifndef KVQ_HAVE_NCCL
  GTEST_SKIP() << "built without NCCL (KVQ_WITH_NCCL=OFF)";
#else
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "no CUDA device: the NCCL test needs one";
  // One rank per GPU; on one GPU both ranks share it where NCCL allows that
  // (NCCL refuses a communicator with two ranks on one device as invalid
  // usage: the test then skips, saying so).
  const int peer_device = CudaDeviceCount() >= 2 ? 1 : 0;
  NcclTransport nccl(0);
  LoopbackServer s(nullptr, &nccl);
  std::unique_ptr<KvqClient> c = Connect(s.port);
  CreateSequence(*c, "nccl");
  CreateSequence(*c, "grpc");
  HostTensor k = RandomFp16(3), v = RandomFp16(4);
  ASSERT_TRUE(c->AppendPrompt("grpc", k, v).ok());
  DeviceBuffer dk(k.data.size(), 1), dv(v.data.size(), 1);
  ASSERT_TRUE(dk.ptr && dv.ptr);
  cudaMemcpy(dk.ptr, k.data.data(), dk.bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(dv.ptr, v.data.data(), dv.bytes, cudaMemcpyHostToDevice);
  NcclPeer peer(peer_device);
  AppendOptions a;
  a.device = {PayloadTransport::kNccl, &peer, dk.ptr, dv.ptr};
  absl::StatusOr<AppendResult> r = c->AppendPrompt("nccl", k, v, a);
  if (!r.ok() && peer_device == 0 && absl::StrContains(r.status().message(), "invalid usage")) {
    GTEST_SKIP() << "NCCL refuses two ranks on one GPU: " << r.status();
  }
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<FetchedKv> x = c->FetchDequant("nccl"), y = c->FetchDequant("grpc");
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(x->k.data + x->v.data, y->k.data + y->v.data);
  FetchOptions f;
  HostTensor ok = HostTensor::Zeros(DType::kFloat16, {kLayers, kHeads, kTokens, kDim});
  HostTensor ov = ok;
  DeviceBuffer fk(ok.data.size(), 1), fv(ov.data.size(), 1);
  f.device = {PayloadTransport::kNccl, &peer, fk.ptr, fv.ptr};
  ASSERT_TRUE(c->FetchDequantInto("nccl", f, &ok, &ov).ok());
  std::string got(fk.bytes + fv.bytes, '\0');
  cudaMemcpy(got.data(), fk.ptr, fk.bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(got.data() + fk.bytes, fv.ptr, fv.bytes, cudaMemcpyDeviceToHost);
  EXPECT_EQ(got, y->k.data + y->v.data);
  // A client that never joins: the server's transfer fails by its deadline
  // and stores nothing.
  const int64_t used = s.store->pool().Stats().used_bytes;
  v1::OpenTransferRequest open;
  open.set_transport(v1::TRANSPORT_NCCL);
  v1::OpenTransferResponse opened;
  CallInfo call;  // The default tenant.
  call.deadline = absl::Now() + absl::Seconds(5);
  ASSERT_TRUE(s.service->DoOpenTransfer(open, &opened, call).ok());
  v1::AppendDeviceRequest req;
  req.mutable_sequence()->set_sequence_id("nccl");
  req.set_dtype(v1::DTYPE_FP16);
  for (int64_t d : {kLayers, kHeads, kTokens, kDim}) req.add_shape(d);
  for (v1::DevicePayload* p : {req.mutable_k(), req.mutable_v()}) {
    p->mutable_transfer()->set_session_id(opened.session_id());
    p->mutable_transfer()->set_size(static_cast<int64_t>(k.data.size()));
  }
  v1::AppendResponse resp;
  call.deadline = absl::Now() + absl::Seconds(2);
  const absl::Status st = s.service->DoAppendDevice(req, &resp, call);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_EQ(s.store->pool().Stats().used_bytes, used);
#endif
}

}  // namespace
}  // namespace kvq

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    int port = 0;
    if (std::strncmp(argv[i], "--ipc_client=", 13) == 0 && absl::SimpleAtoi(argv[i] + 13, &port)) {
      return kvq::IpcClient(port);
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
