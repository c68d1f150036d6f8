// KvqService: the gRPC handlers of kvq.v1.KvCache (callback API).
//
// Handlers are thin: they check the wire input (naming the field and the
// bound), call the store and the kernels, and map absl::Status to
// grpc::Status. Attention over the sequences of one request runs as one
// batched backend call on the backend's threads, started from one kernel
// thread when it uses more than one (service/kernel_thread.h).
#ifndef KVQ_SERVICE_KVQ_SERVICE_H_
#define KVQ_SERVICE_KVQ_SERVICE_H_

#include <array>
#include <cstdint>
#include <string>

#include "kernels/build_info.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "service/calibrations.h"
#include "service/kernel_thread.h"
#include "service/metrics.h"
#include "service/page_guard.h"
#include "service/sequence_store.h"
#include "service/tenants.h"
#include "service/transport/kv_transport.h"
#include "service/transport/transfer_sessions.h"

namespace kvq {

struct CallInfo;  // Who calls and until when (service/unary_call.h).

struct ServiceOptions {
  // Requests above this are answered INVALID_ARGUMENT naming the limit (the
  // gRPC transport limit is set higher so the check can run).
  int64_t max_message_bytes = int64_t{64} << 20;
  // Default size of one FetchDequant response message.
  int64_t fetch_chunk_bytes = int64_t{1} << 20;
  std::string backend_name = "cpu";
  std::string version = std::string(KvqVersion());
  // Share of reads that verify page checksums (--verify_fraction).
  double verify_fraction = 1.0;
  // Longest a device payload transfer may wait for its peer (the call's
  // own deadline applies too): DEADLINE_EXCEEDED after it.
  absl::Duration transfer_timeout = absl::Seconds(30);
  // Transfer sessions (OpenTransfer): the lease without ttl_seconds, and
  // the longest granted.
  absl::Duration transfer_session_ttl = absl::Seconds(60);
  absl::Duration max_transfer_session_ttl = absl::Minutes(10);
};

grpc::Status ToGrpc(const absl::Status& s);

// Every method is raw (grpc::ByteBuffer in and out). gRPC's own decoding
// answers a request that does not parse with UNIMPLEMENTED and no message;
// decoded here (service/request_decoder.h) it is INVALID_ARGUMENT naming
// the field, and every string's length is checked against its bound before
// a handler runs. FetchDequant's messages are also encoded by hand around
// the dequantized tensors or the pages (service/fetch_encoder.h), and
// Append reads raw pages from the received slices
// (service/append_decoder.h). The wrappers sit on the plain Service: over
// CallbackService, the raw DecodeStream would clash with the typed one
// (same parameters, another return type).
// clang-format off
using RawKvCacheService =
    v1::KvCache::WithRawCallbackMethod_GetServerInfo<
    v1::KvCache::WithRawCallbackMethod_CreateSequence<
    v1::KvCache::WithRawCallbackMethod_Append<
    v1::KvCache::WithRawCallbackMethod_FetchDequant<
    v1::KvCache::WithRawCallbackMethod_Attend<
    v1::KvCache::WithRawCallbackMethod_AppendAttend<
    v1::KvCache::WithRawCallbackMethod_DecodeStream<
    v1::KvCache::WithRawCallbackMethod_Fork<
    v1::KvCache::WithRawCallbackMethod_Release<
    v1::KvCache::WithRawCallbackMethod_Stats<
    v1::KvCache::WithRawCallbackMethod_OpenTransfer<
    v1::KvCache::WithRawCallbackMethod_CloseTransfer<
    v1::KvCache::WithRawCallbackMethod_AppendDevice<
    v1::KvCache::WithRawCallbackMethod_FetchDevice<
    v1::KvCache::WithRawCallbackMethod_MatchPrefix<
        v1::KvCache::Service>>>>>>>>>>>>>>>;
// clang-format on

class KvqService final : public RawKvCacheService {
 public:
  KvqService(SequenceStore* store, Metrics* metrics, const ServiceOptions& options);
  // With a table every call must carry a tenant's bearer token and runs in
  // that tenant's namespace; null (the default): the default tenant.
  void set_tenants(const Tenants* tenants) { tenants_ = tenants; }
  // The calibrations CreateSequence and MatchPrefix may name (not owned);
  // null (the default): none, a crq scheme is answered NOT_FOUND.
  void set_calibrations(const Calibrations* calibrations) { calibrations_ = calibrations; }
  // The device payload paths (docs/TRANSPORT.md), not owned; a path left
  // null answers FAILED_PRECONDITION (a server built without CUDA).
  void set_transport(TransportKind kind, KvTransport* transport) {
    transports_[static_cast<int>(kind)] = transport;
  }

  // The RPCs; the unary ones are ServeUnary over a Do* body
  // (service/unary_rpcs.cc).
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* req,
                                          grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* req,
                                           grpc::ByteBuffer* resp) override;
  // Read-only prefix probe (service/match_prefix.cc).
  grpc::ServerUnaryReactor* MatchPrefix(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* Append(grpc::CallbackServerContext* ctx,
                                                    grpc::ByteBuffer* resp) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchDequant(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* req) override;
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                   grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* AppendAttend(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* req,
                                         grpc::ByteBuffer* resp) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DecodeStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Fork(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                 grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                    grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                  grpc::ByteBuffer* resp) override;
  // Device payloads (service/device_rpcs.cc).
  grpc::ServerUnaryReactor* OpenTransfer(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* req,
                                         grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* CloseTransfer(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* req,
                                          grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* AppendDevice(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* req,
                                         grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* FetchDevice(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;

  // The handler bodies, callable without gRPC (DecodeStream reuses them).
  // `method` labels the kernel time (a DecodeStream step passes its own).
  // `tenant`: whose sequences the request names (empty: the default tenant).
  absl::Status DoAppendAttend(const v1::AppendAttendRequest& req, v1::AttendResponse* resp,
                              RpcMethod method = RpcMethod::kAppendAttend,
                              absl::string_view tenant = {});
  absl::Status DoAttend(const v1::AttendRequest& req, v1::AttendResponse* resp,
                        absl::string_view tenant = {});
  absl::Status DoMatchPrefix(const v1::MatchPrefixRequest& req, v1::MatchPrefixResponse* resp,
                             absl::string_view tenant);

  // The caller's tenant (null for the default tenant) once its token and
  // its rate allow the call: UNAUTHENTICATED or RESOURCE_EXHAUSTED.
  absl::Status Admit(const grpc::CallbackServerContext* ctx, std::shared_ptr<Tenant>* tenant);
  // Admit for one more request of an admitted call (a DecodeStream step).
  absl::Status AdmitStep(Tenant* tenant);

  // Device payload bodies; the call's deadline bounds the transfers.
  absl::Status DoOpenTransfer(const v1::OpenTransferRequest& req, v1::OpenTransferResponse* resp,
                              const CallInfo& call);
  absl::Status DoCloseTransfer(const v1::CloseTransferRequest& req,
                               v1::CloseTransferResponse* resp, const CallInfo& call);
  absl::Status DoAppendDevice(const v1::AppendDeviceRequest& req, v1::AppendResponse* resp,
                              const CallInfo& call);
  absl::Status DoFetchDevice(const v1::FetchDeviceRequest& req, v1::FetchDeviceResponse* resp,
                             const CallInfo& call);
  TransferSessions& transfer_sessions() { return sessions_; }

  SequenceStore* store() { return store_; }
  Metrics* metrics() { return metrics_; }
  const ServiceOptions& options() const { return options_; }
  PageGuard& guard() { return guard_; }
  absl::Status CheckSize(const google::protobuf::Message& m) const;
  absl::Status CheckSize(size_t message_bytes) const;

 private:
  class AppendReactor;
  class FetchReactor;
  class DecodeReactor;

  // The bodies of the unary RPCs that only gRPC calls (ServeUnary).
  absl::Status DoGetServerInfo(const v1::GetServerInfoRequest& req, v1::ServerInfo* resp,
                               const CallInfo& call);
  absl::Status DoCreateSequence(const v1::CreateSequenceRequest& req,
                                v1::CreateSequenceResponse* resp, const CallInfo& call);
  absl::Status DoFork(const v1::ForkRequest& req, v1::ForkResponse* resp, const CallInfo& call);
  absl::Status DoRelease(const v1::ReleaseRequest& req, v1::ReleaseResponse* resp,
                         const CallInfo& call);
  absl::Status DoStats(const v1::StatsRequest& req, v1::StatsResponse* resp,
                       const CallInfo& call);

  SequenceStore* store_;
  Metrics* metrics_;
  const Tenants* tenants_ = nullptr;
  const Calibrations* calibrations_ = nullptr;
  ServiceOptions options_;
  KernelThread kernel_thread_;  // Runs the backend's multi-threaded calls.
  PageGuard guard_;             // Page checksums: sealed on append, verified on read.
  std::array<KvTransport*, 2> transports_{};  // By TransportKind; null: none.
  TransferSessions sessions_;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_KVQ_SERVICE_H_
