// ServeUnary: the one path of every unary method of KvqService. Each method
// is raw (grpc::ByteBuffer, service/request_decoder.h): admit the caller
// (its tenant and rate), check the message size, decode the request and
// its strings' bounds, run the handler's body, encode the response, and
// time and count all of it.
#ifndef KVQ_SERVICE_UNARY_CALL_H_
#define KVQ_SERVICE_UNARY_CALL_H_

#include <google/protobuf/arena.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "service/kvq_service.h"
#include "service/metrics.h"
#include "service/request_decoder.h"
#include "service/tenants.h"

namespace kvq {

// Who calls and until when, for a handler's body.
struct CallInfo {
  std::shared_ptr<Tenant> tenant;  // Null: the default tenant (no tokens file).
  std::string tenant_name;         // Empty for the default tenant.
  absl::Time deadline;             // The call's deadline (InfiniteFuture: none).
};

// `body(const Req&, Resp*, const CallInfo&)` returns the call's status; on
// OK the response is sent.
template <typename Req, typename Resp, typename Body>
grpc::ServerUnaryReactor* ServeUnary(KvqService* service, RpcMethod method,
                                     grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* raw_req, grpc::ByteBuffer* raw_resp,
                                     Body body) {
  RpcTimer timer(service->metrics(), method);
  service->metrics()->AddReceivedBytes(method, raw_req->Length());
  CallInfo call;
  absl::Status st = service->Admit(ctx, &call.tenant);
  timer.set_tenant(call.tenant.get());
  google::protobuf::Arena arena;
  Req* req = google::protobuf::Arena::CreateMessage<Req>(&arena);
  Resp* resp = google::protobuf::Arena::CreateMessage<Resp>(&arena);
  if (st.ok()) st = service->CheckSize(raw_req->Length());
  if (st.ok()) st = DecodeRequest(*raw_req, req);
  if (st.ok()) {
    if (call.tenant != nullptr) call.tenant_name = call.tenant->name();
    call.deadline = absl::FromChrono(ctx->deadline());
    st = body(static_cast<const Req&>(*req), resp, static_cast<const CallInfo&>(call));
  }
  if (st.ok()) st = EncodeResponse(*resp, raw_resp);
  if (st.ok()) service->metrics()->AddSentBytes(method, raw_resp->Length());
  timer.Finish(static_cast<int>(st.code()));
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpc(st));
  return reactor;
}

// The same with a KvqService member function as the body, for the RPCs
// whose body is also called without gRPC.
template <typename Req, typename Resp>
grpc::ServerUnaryReactor* ServeUnary(KvqService* service, RpcMethod method,
                                     grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* raw_req, grpc::ByteBuffer* raw_resp,
                                     absl::Status (KvqService::*body)(const Req&, Resp*,
                                                                      const CallInfo&)) {
  return ServeUnary<Req, Resp>(
      service, method, ctx, raw_req, raw_resp,
      [&](const Req& req, Resp* resp, const CallInfo& call) {
        return (service->*body)(req, resp, call);
      });
}

}  // namespace kvq

#endif  // KVQ_SERVICE_UNARY_CALL_H_
