// Metrics: one object owns the Prometheus registry, the exposer on its own
// port, the RPC families (built once, handles kept: no Add() on the hot
// path) and a collector that reads the store's gauges at scrape time, so
// memory figures are the allocation at that moment, never a stale copy.
#ifndef KVQ_SERVICE_METRICS_H_
#define KVQ_SERVICE_METRICS_H_

#include <array>
#include <atomic>
#include <memory>
#include <string>

#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "service/metrics_https_server.h"
#include "service/sequence_store.h"
#include "service/transport/kv_transport.h"

namespace kvq {

enum class RpcMethod {
  kGetServerInfo,
  kCreateSequence,
  kAppend,
  kFetchDequant,
  kAttend,
  kAppendAttend,
  kDecodeStream,
  kFork,
  kRelease,
  kStats,
  kOpenTransfer,
  kCloseTransfer,
  kAppendDevice,
  kFetchDevice,
  kMatchPrefix,
};
inline constexpr int kNumRpcMethods = 15;
inline constexpr int kNumStatusCodes = 17;  // grpc::StatusCode 0..16.
absl::string_view RpcMethodName(RpcMethod m);

class Tenant;  // service/tenants.h
// One tenant's handles of kvq_tenant_requests_total and
// kvq_tenant_rpc_duration_seconds, added once per tenant.
struct TenantMetrics {
  std::array<prometheus::Counter*, kNumStatusCodes> requests{};
  prometheus::Histogram* duration = nullptr;
};

class Metrics {
 public:
  // Starts the exposer on `bind` ("127.0.0.1:9464"; port 0 picks a free
  // one); an empty `bind` keeps metrics in memory only (tests). With `tls`
  // enabled the port speaks HTTPS (service/metrics_https_server.h) instead.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const std::string& bind,
                                                         SequenceStore* store,
                                                         absl::string_view tier,
                                                         const MetricsTlsOptions& tls = {});
  ~Metrics();

  // Port the exposer listens on (0 without one).
  int port() const { return port_; }
  // The text exposition of everything (what /metrics serves).
  std::string Scrape() const;

  void RecordRpc(RpcMethod method, int status_code, double seconds);
  // One batched attention call of the backend in an Attend, an AppendAttend
  // or a DecodeStream step: the compute share of kvq_rpc_duration_seconds.
  void RecordAttentionKernel(RpcMethod method, double seconds);
  void AddReceivedBytes(RpcMethod method, size_t bytes);
  void AddSentBytes(RpcMethod method, size_t bytes);
  void RecordGone(GoneReason reason);
  void RecordPrefixHit(int tokens);
  // A sealed page that failed its checksum (service/page_checksum.h).
  void RecordChecksumFailure();
  // One device payload moved (or not) by a transport: `receive` for the
  // client-to-server direction (AppendDevice), by its status code.
  void RecordTransfer(TransportKind kind, bool receive, int status_code);
  // One call of a tenant (none for the default tenant: null).
  void RecordTenantRpc(Tenant* tenant, int status_code, double seconds);
  // After a scan of --calibration_dir: the calibrations loaded now and the
  // files the scan skipped (failed validation).
  void RecordCalibrationScan(size_t loaded, size_t skipped);

 private:
  class StoreCollector;
  Metrics() = default;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StoreCollector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string exposer_bind_;  // What exposer_ was asked to listen on.
  std::unique_ptr<MetricsHttpsServer> https_;  // Instead of exposer_ with --metrics_tls_*.
  int port_ = 0;
  std::array<std::array<prometheus::Counter*, kNumStatusCodes>, kNumRpcMethods> requests_{};
  std::array<prometheus::Histogram*, kNumRpcMethods> latency_{};
  std::array<prometheus::Counter*, kNumRpcMethods> received_{};
  std::array<prometheus::Counter*, kNumRpcMethods> sent_{};
  std::array<prometheus::Counter*, 4> gone_{};
  std::array<prometheus::Histogram*, kNumRpcMethods> kernel_{};  // Attention methods only.
  prometheus::Counter* prefix_hits_ = nullptr;
  prometheus::Counter* prefix_tokens_ = nullptr;
  prometheus::Counter* checksum_failures_ = nullptr;
  prometheus::Gauge* calibrations_loaded_ = nullptr;
  prometheus::Counter* calibration_skips_ = nullptr;
  // [transport][direction: 0 send, 1 receive][code]
  std::array<std::array<std::array<prometheus::Counter*, kNumStatusCodes>, 2>, 2> transfers_{};
  prometheus::Family<prometheus::Counter>* tenant_requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* tenant_duration_ = nullptr;
  absl::Mutex tenant_mu_;
  absl::node_hash_map<std::string, TenantMetrics> tenant_handles_ ABSL_GUARDED_BY(tenant_mu_);
};

// Times one RPC and records it when destroyed (or when Finish is called).
class RpcTimer {
 public:
  RpcTimer(Metrics* metrics, RpcMethod method);
  ~RpcTimer();
  // The caller's tenant once known (tokens file): Finish records the call
  // under it too.
  void set_tenant(Tenant* tenant) { tenant_ = tenant; }
  void Finish(int status_code);

 private:
  Metrics* metrics_;
  Tenant* tenant_ = nullptr;
  RpcMethod method_;
  absl::Time start_;
  bool done_ = false;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_METRICS_H_
