// The one shape of KvqService's unary handlers: admit the caller, time the
// call, check its size, count its bytes, run the body and finish with its
// status. kvq_service.cc and device_rpcs.cc both write their handlers with
// KVQ_UNARY, so the handlers of both files behave alike by construction.
#ifndef KVQ_SERVICE_UNARY_CALL_H_
#define KVQ_SERVICE_UNARY_CALL_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "service/kvq_service.h"
#include "service/metrics.h"
#include "service/tenants.h"

namespace kvq {

// What a handler body knows of its call.
struct UnaryCall {
  const Tenant* tenant = nullptr;  // Null: the default tenant.
  std::string tenant_name;         // Empty for the default tenant.
  absl::Time deadline;             // The call's own (infinite without one).
};

// Runs `body(const UnaryCall&) -> absl::Status` once the caller is admitted
// and the request is within the size limit; the response's bytes count
// when the body succeeds.
template <typename Req, typename Resp, typename Body>
grpc::ServerUnaryReactor* RunUnary(KvqService* service, RpcMethod method,
                                   grpc::CallbackServerContext* ctx, const Req* req, Resp* resp,
                                   Body&& body) {
  RpcTimer timer(service->metrics(), method);
  service->metrics()->AddReceivedBytes(method, req->ByteSizeLong());
  std::shared_ptr<Tenant> tenant;
  absl::Status st = service->Admit(ctx, &tenant);
  timer.set_tenant(tenant.get());
  if (st.ok()) st = service->CheckSize(*req);
  if (st.ok()) {
    const UnaryCall call{tenant.get(), tenant ? tenant->name() : std::string(),
                         absl::FromChrono(ctx->deadline())};
    st = body(call);
  }
  if (st.ok()) service->metrics()->AddSentBytes(method, resp->ByteSizeLong());
  timer.Finish(static_cast<int>(st.code()));
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpc(st));
  return reactor;
}

}  // namespace kvq

// The body of a KvqService unary handler: `body` is a block returning
// absl::Status that sees `call` (UnaryCall), `tenant` and `tenant_name`.
#define KVQ_UNARY(method, ctx, req, resp, body)                                      \
  return ::kvq::RunUnary(this, ::kvq::RpcMethod::method, ctx, req, resp,           \
                         [&](const ::kvq::UnaryCall& call) -> absl::Status {       \
                           [[maybe_unused]] const ::kvq::Tenant* tenant = call.tenant; \
                           [[maybe_unused]] const std::string& tenant_name =      \
                               call.tenant_name;                                   \
                           return [&]() -> absl::Status body();                    \
                         })

#endif  // KVQ_SERVICE_UNARY_CALL_H_
