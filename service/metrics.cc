#include "service/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/malloc_tuning.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"
#include "service/tenants.h"

namespace kvq {
namespace {

const char* const kCodeNames[kNumStatusCodes] = {
    "OK",           "CANCELLED",       "UNKNOWN",           "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED", "NOT_FOUND",  "ALREADY_EXISTS",    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL",       "UNAVAILABLE",       "DATA_LOSS",
    "UNAUTHENTICATED"};

const prometheus::Histogram::BucketBoundaries kRpcBuckets = {
    1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10, 30};

prometheus::MetricFamily Gauge(std::string name, std::string help) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = prometheus::MetricType::Gauge;
  return f;
}

void Add(prometheus::MetricFamily& f, double value,
         std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  f.metric.push_back(std::move(m));
}

}  // namespace

absl::string_view RpcMethodName(RpcMethod m) {
  static const char* const kNames[kNumRpcMethods] = {
      "GetServerInfo", "CreateSequence", "Append", "FetchDequant", "Attend",
      "AppendAttend",  "DecodeStream",   "Fork",   "Release",      "Stats",
      "OpenTransfer",  "CloseTransfer",  "AppendDevice", "FetchDevice",  "MatchPrefix"};
  return kNames[static_cast<int>(m)];
}

// Reads the store when Prometheus scrapes.
class Metrics::StoreCollector : public prometheus::Collectable {
 public:
  StoreCollector(SequenceStore* store, std::string tier) : store_(store), tier_(std::move(tier)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const StoreStats st = store_->Stats();
    const std::vector<prometheus::ClientMetric::Label> tier = {{"tier", tier_}};
    std::vector<prometheus::MetricFamily> out;

    auto capacity = Gauge("kvq_capacity_bytes", "Page pool capacity.");
    Add(capacity, st.pool.capacity_bytes, tier);
    out.push_back(std::move(capacity));

    auto used = Gauge("kvq_used_bytes",
                      "Bytes of live blocks in the page pool (shared pages count once).");
    Add(used, st.pool.used_bytes, tier);
    out.push_back(std::move(used));

    auto component = Gauge("kvq_kv_bytes",
                           "KV bytes referenced by live sequences, by what they hold "
                           "(a page shared by several sequences counts in each).");
    const std::pair<const char*, size_t> parts[] = {
        {"codes", st.bytes.codes},       {"scales", st.bytes.scales},
        {"outliers", st.bytes.outliers}, {"residual", st.bytes.residual},
        {"sink", st.bytes.sink},         {"codebook", st.bytes.codebook},
        {"padding", st.bytes.padding}};
    for (const auto& [name, bytes] : parts) {
      Add(component, bytes, {{"tier", tier_}, {"component", name}});
    }
    out.push_back(std::move(component));

    auto slabs = Gauge("kvq_pool_slabs", "Page pool slabs by state.");
    Add(slabs, st.pool.slabs_total, {{"tier", tier_}, {"state", "total"}});
    Add(slabs, st.pool.slabs_used, {{"tier", tier_}, {"state", "used"}});
    out.push_back(std::move(slabs));

    auto pages = Gauge("kvq_pool_pages", "Blocks (pages and per-stream fp16 blocks) by state.");
    Add(pages, st.pool.blocks_used, {{"tier", tier_}, {"state", "used"}});
    Add(pages, st.pool.shared_blocks, {{"tier", tier_}, {"state", "shared"}});
    Add(pages, st.pool.sealed_blocks, {{"tier", tier_}, {"state", "sealed"}});
    out.push_back(std::move(pages));

    auto checksums = Gauge("kvq_page_checksum_bytes",
                           "Bytes of page checksums, 8 per slot of every slab in use, kept "
                           "beside the pool (not in kvq_capacity_bytes).");
    Add(checksums, st.pool.checksum_bytes, tier);
    out.push_back(std::move(checksums));

    // The heap besides the pool: what is allocated, and what is freed but
    // kept mapped (up to 64 MiB with --retain_message_buffers), so a
    // growing RSS can be told apart from memory in use.
    const HeapUsage heap_usage = CurrentHeapUsage();
    auto heap = Gauge("kvq_heap_bytes",
                      "The process heap (glibc malloc; the page pool is mapped apart): in "
                      "use, and freed but still mapped.");
    Add(heap, static_cast<double>(heap_usage.in_use_bytes), {{"state", "in_use"}});
    Add(heap, static_cast<double>(heap_usage.free_bytes), {{"state", "free"}});
    out.push_back(std::move(heap));

    auto seqs = Gauge("kvq_sequences", "Sequences by state.");
    Add(seqs, st.sequences, {{"state", "active"}});
    Add(seqs, st.cached_sequences, {{"state", "cached"}});
    out.push_back(std::move(seqs));

    auto tokens = Gauge("kvq_tokens_stored", "Tokens stored in every layer, by scheme.");
    for (const auto& [scheme, n] : st.tokens_by_scheme) Add(tokens, n, {{"scheme", scheme}});
    out.push_back(std::move(tokens));

    auto ratio = Gauge("kvq_compression_ratio",
                       "fp16 bytes the stored tokens would take / bytes they reference.");
    Add(ratio, st.bytes.total() ? static_cast<double>(st.fp16_equivalent_bytes) / st.bytes.total()
                                : 0.0);
    out.push_back(std::move(ratio));
    // Per tenant (tokens file): never sequence ids or tokens.
    const std::vector<SequenceStore::TenantUsage> tenants = store_->TenantUsages();
    if (!tenants.empty()) {
      auto used = Gauge("kvq_tenant_used_bytes",
                        "Bytes of pool blocks a tenant's sequences hold (shared pages once).");
      auto quota = Gauge("kvq_tenant_quota_bytes", "A tenant's quota in bytes (0: none).");
      for (const SequenceStore::TenantUsage& t : tenants) {
        Add(used, static_cast<double>(t.used_bytes), {{"tenant", t.tenant}});
        Add(quota, static_cast<double>(t.quota_bytes), {{"tenant", t.tenant}});
      }
      out.push_back(std::move(used));
      out.push_back(std::move(quota));
    }
    return out;
  }

 private:
  SequenceStore* store_;
  std::string tier_;
};

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const std::string& bind,
                                                         SequenceStore* store,
                                                         absl::string_view tier,
                                                         const MetricsTlsOptions& tls) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  m->collector_ = std::make_shared<StoreCollector>(store, std::string(tier));

  auto& requests = prometheus::BuildCounter()
                       .Name("kvq_rpc_requests_total")
                       .Help("RPCs handled, by method and status code.")
                       .Register(*m->registry_);
  auto& latency = prometheus::BuildHistogram()
                      .Name("kvq_rpc_duration_seconds")
                      .Help("RPC handling time, by method.")
                      .Register(*m->registry_);
  auto& received = prometheus::BuildCounter()
                       .Name("kvq_rpc_received_bytes_total")
                       .Help("Request message bytes received, by method.")
                       .Register(*m->registry_);
  auto& sent = prometheus::BuildCounter()
                   .Name("kvq_rpc_sent_bytes_total")
                   .Help("Response message bytes sent, by method.")
                   .Register(*m->registry_);
  const prometheus::Histogram::BucketBoundaries& buckets = kRpcBuckets;
  for (int i = 0; i < kNumRpcMethods; ++i) {
    const std::string method(RpcMethodName(static_cast<RpcMethod>(i)));
    for (int c = 0; c < kNumStatusCodes; ++c) {
      m->requests_[i][c] = &requests.Add({{"method", method}, {"code", kCodeNames[c]}});
    }
    m->latency_[i] = &latency.Add({{"method", method}}, buckets);
    m->received_[i] = &received.Add({{"method", method}});
    m->sent_[i] = &sent.Add({{"method", method}});
  }
  auto& kernel = prometheus::BuildHistogram()
                     .Name("kvq_attention_kernel_seconds")
                     .Help(
                         "Time in the attention kernels per batched call, by method (Attend, "
                         "AppendAttend, DecodeStream per step); the rest of "
                         "kvq_rpc_duration_seconds is RPC work.")
                     .Register(*m->registry_);
  for (RpcMethod r : {RpcMethod::kAttend, RpcMethod::kAppendAttend, RpcMethod::kDecodeStream}) {
    m->kernel_[static_cast<int>(r)] =
        &kernel.Add({{"method", std::string(RpcMethodName(r))}}, buckets);
  }
  auto& gone = prometheus::BuildCounter()
                   .Name("kvq_sequences_removed_total")
                   .Help("Sequences removed, by reason (released, expired lease, evicted, "
                         "corrupted: a page failed its checksum).")
                   .Register(*m->registry_);
  for (GoneReason r : {GoneReason::kReleased, GoneReason::kExpired, GoneReason::kEvicted,
                       GoneReason::kCorrupted}) {
    m->gone_[static_cast<int>(r)] = &gone.Add({{"reason", std::string(GoneReasonName(r))}});
  }
  m->prefix_hits_ = &prometheus::BuildCounter()
                         .Name("kvq_prefix_reuse_hits_total")
                         .Help("CreateSequence calls that reused a stored prefix.")
                         .Register(*m->registry_)
                         .Add({});
  m->prefix_tokens_ = &prometheus::BuildCounter()
                           .Name("kvq_prefix_reuse_tokens_total")
                           .Help("Tokens of KV shared instead of stored by prefix reuse.")
                           .Register(*m->registry_)
                           .Add({});
  m->checksum_failures_ = &prometheus::BuildCounter()
                               .Name("kvq_page_checksum_failures_total")
                               .Help("Reads that found a sealed page not matching its checksum "
                                     "(answered DATA_LOSS; the sequence was removed).")
                               .Register(*m->registry_)
                               .Add({});
  m->calibrations_loaded_ = &prometheus::BuildGauge()
                                 .Name("kvq_calibrations_loaded")
                                 .Help("Calibrations loaded from --calibration_dir.")
                                 .Register(*m->registry_)
                                 .Add({});
  m->calibration_skips_ = &prometheus::BuildCounter()
                               .Name("kvq_calibration_files_skipped_total")
                               .Help("Calibration files a scan of --calibration_dir skipped "
                                     "(failed validation; counted at every scan).")
                               .Register(*m->registry_)
                               .Add({});
  auto& transfers = prometheus::BuildCounter()
                        .Name("kvq_device_transfers_total")
                        .Help("Device payloads (AppendDevice: receive, FetchDevice: send) by "
                              "transport and status code; a failed one stored nothing.")
                        .Register(*m->registry_);
  for (TransportKind k : {TransportKind::kCudaIpc, TransportKind::kNccl}) {
    for (int dir = 0; dir < 2; ++dir) {
      for (int c = 0; c < kNumStatusCodes; ++c) {
        m->transfers_[static_cast<int>(k)][dir][c] =
            &transfers.Add({{"transport", std::string(TransportKindName(k))},
                            {"direction", dir == 1 ? "receive" : "send"},
                            {"code", kCodeNames[c]}});
      }
    }
  }
  m->tenant_requests_ = &prometheus::BuildCounter()
                             .Name("kvq_tenant_requests_total")
                             .Help("RPCs of each tenant (tokens file), by status code.")
                             .Register(*m->registry_);
  m->tenant_duration_ = &prometheus::BuildHistogram()
                             .Name("kvq_tenant_rpc_duration_seconds")
                             .Help("RPC handling time of each tenant (tokens file), all methods.")
                             .Register(*m->registry_);
  if (!bind.empty() && tls.enabled()) {
    Metrics* raw = m.get();
    absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> https =
        MetricsHttpsServer::Start(bind, tls, [raw] { return raw->Scrape(); });
    if (!https.ok()) return https.status();
    m->https_ = *std::move(https);
    m->port_ = m->https_->port();
  } else if (!bind.empty()) {
    try {
      m->exposer_ = std::make_unique<prometheus::Exposer>(bind);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", bind, ": ", e.what()));
    }
    m->exposer_bind_ = bind;
    m->exposer_->RegisterCollectable(m->registry_);
    m->exposer_->RegisterCollectable(m->collector_);
    const std::vector<int> ports = m->exposer_->GetListeningPorts();
    m->port_ = ports.empty() ? 0 : ports[0];
  }
  return m;
}

namespace {

// Destroys `exposer` (listening on `port` of `bind`) without waiting out
// civetweb's poll: its listener polls in 2 s rounds and sees a stop only
// between rounds, so the Exposer's destructor took up to 2 s (about 1 s on
// average; every kvq-server shutdown with a metrics port). A connection to
// the port ends the round at once: a thread knocks every 20 ms until the
// Exposer is gone. The knocks send nothing; a knock that lands before the
// stop is an empty connection that civetweb closes.
void DestroyPromptly(std::unique_ptr<prometheus::Exposer> exposer, const std::string& bind,
                     int port) {
  if (exposer == nullptr) return;
  std::string host = bind.substr(0, bind.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* addrs = nullptr;
  if (port == 0 ||
      getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &addrs) != 0) {
    return;  // Nothing to knock on: the destructor waits its round.
  }
  std::atomic<bool> gone{false};
  std::thread knocker([&] {
    while (!gone.load()) {
      for (const addrinfo* a = addrs; a != nullptr; a = a->ai_next) {
        const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                              a->ai_protocol);
        if (fd < 0) continue;
        (void)connect(fd, a->ai_addr, a->ai_addrlen);
        close(fd);
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  exposer.reset();
  gone.store(true);
  knocker.join();
  freeaddrinfo(addrs);
}

}  // namespace

Metrics::~Metrics() { DestroyPromptly(std::move(exposer_), exposer_bind_, port_); }

std::string Metrics::Scrape() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (auto& f : collector_->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

void Metrics::RecordRpc(RpcMethod method, int status_code, double seconds) {
  const int i = static_cast<int>(method);
  if (status_code < 0 || status_code >= kNumStatusCodes) status_code = 2;  // UNKNOWN
  requests_[i][status_code]->Increment();
  latency_[i]->Observe(seconds);
}

void Metrics::RecordAttentionKernel(RpcMethod method, double seconds) {
  if (prometheus::Histogram* h = kernel_[static_cast<int>(method)]) h->Observe(seconds);
}

void Metrics::AddReceivedBytes(RpcMethod method, size_t bytes) {
  received_[static_cast<int>(method)]->Increment(static_cast<double>(bytes));
}

void Metrics::AddSentBytes(RpcMethod method, size_t bytes) {
  sent_[static_cast<int>(method)]->Increment(static_cast<double>(bytes));
}

void Metrics::RecordGone(GoneReason reason) { gone_[static_cast<int>(reason)]->Increment(); }

void Metrics::RecordTenantRpc(Tenant* tenant, int status_code, double seconds) {
  if (tenant == nullptr) return;
  if (status_code < 0 || status_code >= kNumStatusCodes) status_code = 2;  // UNKNOWN
  TenantMetrics* h = tenant->metrics.load(std::memory_order_acquire);
  if (h == nullptr) {
    // A tenant's first call: its handles are added once and kept.
    absl::MutexLock lock(&tenant_mu_);
    auto [it, added] = tenant_handles_.try_emplace(tenant->name());
    if (added) {
      for (int c = 0; c < kNumStatusCodes; ++c) {
        it->second.requests[c] =
            &tenant_requests_->Add({{"tenant", tenant->name()}, {"code", kCodeNames[c]}});
      }
      it->second.duration = &tenant_duration_->Add({{"tenant", tenant->name()}}, kRpcBuckets);
    }
    h = &it->second;
    tenant->metrics.store(h, std::memory_order_release);
  }
  h->requests[status_code]->Increment();
  h->duration->Observe(seconds);
}

void Metrics::RecordPrefixHit(int tokens) {
  prefix_hits_->Increment();
  prefix_tokens_->Increment(tokens);
}

void Metrics::RecordTransfer(TransportKind kind, bool receive, int status_code) {
  if (status_code < 0 || status_code >= kNumStatusCodes) status_code = 2;  // UNKNOWN
  transfers_[static_cast<int>(kind)][receive ? 1 : 0][status_code]->Increment();
}

void Metrics::RecordChecksumFailure() { checksum_failures_->Increment(); }

void Metrics::RecordCalibrationScan(size_t loaded, size_t skipped) {
  calibrations_loaded_->Set(static_cast<double>(loaded));
  calibration_skips_->Increment(static_cast<double>(skipped));
}

RpcTimer::RpcTimer(Metrics* metrics, RpcMethod method)
    : metrics_(metrics), method_(method), start_(absl::Now()) {}

RpcTimer::~RpcTimer() {
  if (!done_) Finish(2);
}

void RpcTimer::Finish(int status_code) {
  if (done_) return;
  done_ = true;
  if (metrics_ != nullptr) {
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    metrics_->RecordRpc(method_, status_code, seconds);
    if (tenant_ != nullptr) metrics_->RecordTenantRpc(tenant_, status_code, seconds);
  }
}

}  // namespace kvq
