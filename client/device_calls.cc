// KvqClient's device payload paths: AppendPrompt and FetchDequantInto with
// options.device.transport set (docs/TRANSPORT.md). The RPC carries the
// descriptors (an IPC handle per payload, or a transfer session), the peer
// moves the bytes. Never retried: a transfer is not idempotent on a session
// and a failed one stored nothing, so the caller decides.
#include <cstring>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/grpc_status.h"
#include "client/kvq_client.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

absl::Status CheckDevice(const DevicePayloadOptions& d) {
  if (d.peer == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport = \"", PayloadTransportName(d.transport),
        "\" needs device.peer (client/cuda_device_peers.h; none without CUDA)"));
  }
  if (d.peer->kind() != d.transport) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device.peer is a ", PayloadTransportName(d.peer->kind()), " peer, transport is \"",
        PayloadTransportName(d.transport), "\""));
  }
  if (d.k == nullptr || d.v == nullptr) {
    return absl::InvalidArgumentError("device.k and device.v must point at the payloads");
  }
  return absl::OkStatus();
}

// Bytes of a [layers, kv_heads, tokens, head_dim] tensor of its dtype.
absl::StatusOr<int64_t> DenseBytes(const HostTensor& t, absl::string_view name) {
  if (t.rank() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be [layers, kv_heads, tokens, head_dim], got ", t.DebugString()));
  }
  int64_t n = static_cast<int64_t>(DTypeBytes(t.dtype));
  for (int64_t d : t.shape) {
    if (d < 1) return absl::InvalidArgumentError(absl::StrCat(name, " has an empty dimension"));
    n *= d;
  }
  return n;
}

v1::DType WireDType(DType d) {
  switch (d) {
    case DType::kFloat32: return v1::DTYPE_FP32;
    case DType::kFloat16: return v1::DTYPE_FP16;
    case DType::kBFloat16: return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

}  // namespace

absl::Status KvqClient::DescribePayloads(const DevicePayloadOptions& device, int64_t bytes,
                                         const CallOptions& call, v1::DevicePayload* k,
                                         v1::DevicePayload* v, std::string* session) {
  if (device.transport == PayloadTransport::kCudaIpc) {
    for (auto [ptr, out] : {std::pair{device.k, k}, std::pair{device.v, v}}) {
      KVQ_ASSIGN_OR_RETURN(IpcExport e, device.peer->Export(ptr));
      v1::CudaIpcRef* r = out->mutable_cuda_ipc();
      r->set_handle(e.handle);
      r->set_offset(e.offset);
      r->set_size(bytes);
      r->set_device(e.device);
    }
    return absl::OkStatus();
  }
  v1::OpenTransferRequest req;
  req.set_transport(v1::TRANSPORT_NCCL);
  req.set_ttl_seconds(device.session_ttl_seconds);
  v1::OpenTransferResponse resp;
  KVQ_RETURN_IF_ERROR(Call(false, call, [&](grpc::ClientContext* ctx, int) {
    return stub_->OpenTransfer(ctx, req, &resp);
  }));
  SessionJoin join{resp.session_id(), resp.nccl_unique_id(), resp.world_size(),
                   resp.server_rank(), resp.client_rank()};
  const absl::Duration d = call.deadline > absl::ZeroDuration() ? call.deadline : options_.deadline;
  KVQ_RETURN_IF_ERROR(device.peer->Join(join, absl::Now() + d));
  *session = resp.session_id();
  for (v1::DevicePayload* p : {k, v}) {
    p->mutable_transfer()->set_session_id(resp.session_id());
    p->mutable_transfer()->set_size(bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<AppendResult> KvqClient::AppendDevice(absl::string_view sequence_id,
                                                     const HostTensor& k, const HostTensor& v,
                                                     const AppendOptions& options) {
  const DevicePayloadOptions& device = options.device;
  KVQ_RETURN_IF_ERROR(CheckDevice(device));
  KVQ_ASSIGN_OR_RETURN(const int64_t bytes, DenseBytes(k, "k"));
  if (v.shape != k.shape || v.dtype != k.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("v is ", v.DebugString(), ", k is ",
                                                   k.DebugString(), ": they must match"));
  }
  v1::AppendDeviceRequest req;
  Ref(sequence_id, req.mutable_sequence());
  req.set_layer_begin(options.layer_begin);
  req.set_dtype(WireDType(k.dtype));
  for (int64_t d : k.shape) req.add_shape(d);
  for (int32_t id : options.token_ids) req.add_token_ids(id);
  std::string session;
  KVQ_RETURN_IF_ERROR(DescribePayloads(device, bytes, options.call, req.mutable_k(),
                                       req.mutable_v(), &session));
  v1::AppendResponse resp;
  if (session.empty()) {
    KVQ_RETURN_IF_ERROR(Call(false, options.call, [&](grpc::ClientContext* ctx, int) {
      return stub_->AppendDevice(ctx, req, &resp);
    }));
  } else {
    // The server receives while the RPC runs: send alongside it.
    grpc::ClientContext ctx;
    SetDeadline(&ctx, options.call);
    AddToken(&ctx);
    std::future<grpc::Status> rpc =
        std::async(std::launch::async, [&] { return stub_->AppendDevice(&ctx, req, &resp); });
    const absl::Time deadline = absl::FromChrono(ctx.deadline());
    absl::Status sent = device.peer->Send(device.k, bytes, deadline);
    if (sent.ok()) sent = device.peer->Send(device.v, bytes, deadline);
    const absl::Status st = FromGrpcStatus(rpc.get());
    device.peer->Leave();
    // Not cancelled when the peer fails: the server's transfers end by
    // their own deadline, and its answer says what happened to the data
    // (a peer error is often only the echo of the server's).
    if (!st.ok()) return st;
    KVQ_RETURN_IF_ERROR(sent);
    v1::CloseTransferRequest close;
    close.set_session_id(session);
    v1::CloseTransferResponse closed;
    (void)Call(false, options.call, [&](grpc::ClientContext* c, int) {
      return stub_->CloseTransfer(c, close, &closed);
    });
  }
  AppendResult r;
  r.num_tokens = resp.num_tokens();
  r.bytes_stored = resp.bytes_stored();
  r.wire_bytes = 0;  // Nothing of the payload went through gRPC.
  r.chunks = 1;
  return r;
}

absl::Status KvqClient::FetchDevice(absl::string_view sequence_id, const FetchOptions& options,
                                    const HostTensor& k, const HostTensor& v) {
  const DevicePayloadOptions& device = options.device;
  KVQ_RETURN_IF_ERROR(CheckDevice(device));
  KVQ_ASSIGN_OR_RETURN(const int64_t bytes, DenseBytes(k, "k"));
  if (v.shape != k.shape || k.dtype != options.dtype || v.dtype != options.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k and v must both be [layers, kv_heads, tokens, head_dim] of ", DTypeName(options.dtype),
        ", got ", k.DebugString(), " and ", v.DebugString()));
  }
  v1::FetchDeviceRequest req;
  Ref(sequence_id, req.mutable_sequence());
  req.set_layer_begin(options.layer_begin);
  req.set_layer_end(static_cast<int>(options.layer_begin + k.shape[0]));
  req.set_token_begin(options.token_begin);
  req.set_token_end(static_cast<int>(options.token_begin + k.shape[2]));
  req.set_dtype(WireDType(options.dtype));
  req.set_apply_rope(options.apply_rope);
  std::string session;
  KVQ_RETURN_IF_ERROR(DescribePayloads(device, bytes, options.call, req.mutable_k(),
                                       req.mutable_v(), &session));
  v1::FetchDeviceResponse resp;
  if (session.empty()) {
    return Call(false, options.call, [&](grpc::ClientContext* ctx, int) {
      return stub_->FetchDevice(ctx, req, &resp);
    });
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options.call);
  AddToken(&ctx);
  std::future<grpc::Status> rpc =
      std::async(std::launch::async, [&] { return stub_->FetchDevice(&ctx, req, &resp); });
  const absl::Time deadline = absl::FromChrono(ctx.deadline());
  absl::Status got = device.peer->Recv(device.k, bytes, deadline);
  if (got.ok()) got = device.peer->Recv(device.v, bytes, deadline);
  const absl::Status st = FromGrpcStatus(rpc.get());
  device.peer->Leave();
  KVQ_RETURN_IF_ERROR(st);
  KVQ_RETURN_IF_ERROR(got);
  v1::CloseTransferRequest close;
  close.set_session_id(session);
  v1::CloseTransferResponse closed;
  (void)Call(false, options.call, [&](grpc::ClientContext* c, int) {
    return stub_->CloseTransfer(c, close, &closed);
  });
  return absl::OkStatus();
}

}  // namespace kvq
