// The unary RPCs of kvq.v1.KvCache: the raw callback API has one virtual
// method per RPC, and each is ServeUnary (service/unary_call.h) over its
// body. The bodies are KvqService's Do* methods, which DecodeStream, the
// benchmarks and the GPU tests also call without gRPC; the streaming RPCs
// (Append, FetchDequant, DecodeStream) have reactors of their own
// (service/kvq_service.cc).
#include "service/kvq_service.h"
#include "service/unary_call.h"

namespace kvq {

using Ctx = grpc::CallbackServerContext;
using Raw = grpc::ByteBuffer;

grpc::ServerUnaryReactor* KvqService::GetServerInfo(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kGetServerInfo, ctx, req, resp,
                    &KvqService::DoGetServerInfo);
}

grpc::ServerUnaryReactor* KvqService::CreateSequence(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kCreateSequence, ctx, req, resp,
                    &KvqService::DoCreateSequence);
}

grpc::ServerUnaryReactor* KvqService::MatchPrefix(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary<v1::MatchPrefixRequest, v1::MatchPrefixResponse>(
      this, RpcMethod::kMatchPrefix, ctx, req, resp,
      [this](const v1::MatchPrefixRequest& r, v1::MatchPrefixResponse* out,
             const CallInfo& call) { return DoMatchPrefix(r, out, call.tenant_name); });
}

grpc::ServerUnaryReactor* KvqService::Attend(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary<v1::AttendRequest, v1::AttendResponse>(
      this, RpcMethod::kAttend, ctx, req, resp,
      [this](const v1::AttendRequest& r, v1::AttendResponse* out, const CallInfo& call) {
        return DoAttend(r, out, call.tenant_name);
      });
}

// A DecodeStream step runs the same body under its own method label.
grpc::ServerUnaryReactor* KvqService::AppendAttend(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary<v1::AppendAttendRequest, v1::AttendResponse>(
      this, RpcMethod::kAppendAttend, ctx, req, resp,
      [this](const v1::AppendAttendRequest& r, v1::AttendResponse* out, const CallInfo& call) {
        return DoAppendAttend(r, out, RpcMethod::kAppendAttend, call.tenant_name);
      });
}

grpc::ServerUnaryReactor* KvqService::Fork(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kFork, ctx, req, resp, &KvqService::DoFork);
}

grpc::ServerUnaryReactor* KvqService::Release(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kRelease, ctx, req, resp, &KvqService::DoRelease);
}

grpc::ServerUnaryReactor* KvqService::Stats(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kStats, ctx, req, resp, &KvqService::DoStats);
}

// The device payload RPCs (service/device_rpcs.cc); the call's own deadline
// bounds their transfers (none: infinite).
grpc::ServerUnaryReactor* KvqService::OpenTransfer(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kOpenTransfer, ctx, req, resp,
                    &KvqService::DoOpenTransfer);
}

grpc::ServerUnaryReactor* KvqService::CloseTransfer(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kCloseTransfer, ctx, req, resp,
                    &KvqService::DoCloseTransfer);
}

grpc::ServerUnaryReactor* KvqService::AppendDevice(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kAppendDevice, ctx, req, resp,
                    &KvqService::DoAppendDevice);
}

grpc::ServerUnaryReactor* KvqService::FetchDevice(Ctx* ctx, const Raw* req, Raw* resp) {
  return ServeUnary(this, RpcMethod::kFetchDevice, ctx, req, resp, &KvqService::DoFetchDevice);
}

}  // namespace kvq
