// kvq-server: the quantized KV-cache service.
//
//   kvq-server --address=0.0.0.0:50051 --metrics_address=0.0.0.0:9464 \
//              --capacity_bytes=$((8 << 30)) --backend=auto --evict \
//              --tls_cert=server.pem --tls_key=server.key
//
// A non-loopback --address needs TLS (or tokens) or an explicit --insecure
// (service/exposure_check.h).
//
// SIGTERM or SIGINT: stop accepting, let in-flight RPCs finish (up to
// --shutdown_grace_seconds), exit 0. SIGHUP: rescan --calibration_dir.
#include <csignal>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "kernels/backend.h"
#include "kernels/build_info.h"
#include "kernels/cpu/simd_dispatch.h"
#include "kernels/malloc_tuning.h"
#include "service/backend_choice.h"
#include "service/exposure_check.h"
#include "service/server_config.h"
#include "service/server_usage.h"
#ifdef KVQ_HAVE_CUDA_TRANSPORT
#include "service/transport/cuda_ipc_transport.h"
#include "kernels/cuda/device_info.h"
#ifdef KVQ_HAVE_NCCL
#include "service/transport/nccl_transport.h"
#endif
#endif

namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }
std::atomic<bool> g_rescan{false};
void OnHangup(int) { g_rescan.store(true); }

// Rescans the calibration directory and logs what changed (a file that
// fails validation at every scan it fails).
void ScanCalibrations(kvq::Calibrations& calibrations, kvq::Metrics* metrics) {
  const kvq::Calibrations::ScanReport report = calibrations.Rescan();
  for (const std::string& name : report.loaded) {
    std::printf("kvq-server: calibration \"%s\" loaded\n", name.c_str());
  }
  for (const std::string& name : report.removed) {
    std::printf("kvq-server: calibration \"%s\" unloaded: its file is gone\n", name.c_str());
  }
  for (const absl::Status& s : report.skipped) {
    std::printf("kvq-server: calibration file skipped (a version loaded before stays): %s\n",
                std::string(s.message()).c_str());
  }
  metrics->RecordCalibrationScan(calibrations.size(), report.skipped.size());
  std::fflush(stdout);
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "kvq-server: %s\n", std::string(s.message()).c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (kvq::PrintVersionIfAsked(argc, argv, "kvq-server")) return 0;
  // --help lists the server's own flags, grouped; absl's would list only
  // flags defined in a file named like the program (none).
  for (int i = 1; i < argc; ++i) {
    if (kvq::IsHelpArg(argv[i])) {
      std::fputs(kvq::ServerUsage().c_str(), stdout);
      return 0;
    }
  }
  absl::SetProgramUsageMessage("kvq-server: a quantized KV-cache service over gRPC. Flags: --help");
  absl::ParseCommandLine(argc, argv);
  // Abseil built without NDEBUG (as Debian ships it) records every lock
  // order in a global graph: an Attend over 32 sequences holds 32 reader
  // locks, hundreds of edge updates per call. The unit and integration
  // tests keep the detection on for the same locking code.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::StatusOr<kvq::ServerConfig> config = kvq::ConfigFromFlags();
  if (!config.ok()) return Fail(config.status());
  absl::StatusOr<kvq::ExposureVerdict> exposure =
      kvq::CheckExposure({.address = config->address,
                          .tls_enabled = config->tls.enabled(),
                          .client_certs_required = config->tls.mutual(),
                          .tokens_enabled = !config->tokens_file.empty(),
                          .insecure = config->insecure});
  if (!exposure.ok()) return Fail(exposure.status());
  if (!exposure->warning.empty()) {
    std::fprintf(stderr, "kvq-server: %s\n", exposure->warning.c_str());
  }
  if (config->retain_message_buffers) {
    if (absl::Status s = kvq::RetainMessageBuffers(); !s.ok()) {
      std::fprintf(stderr, "kvq-server: --retain_message_buffers: %s\n",
                   std::string(s.message()).c_str());
    }
  }

  absl::StatusOr<kvq::BackendChoice> choice =
      kvq::ChooseBackend(config->backend, kvq::ProbeBackends());
  if (!choice.ok()) return Fail(choice.status());
  // Which backend auto picked, and why (an explicit choice needs no line).
  if (config->backend == "auto") std::printf("kvq-server: %s\n", choice->reason.c_str());
  const std::string backend_name = choice->name;
  const bool on_device = backend_name == "cuda";
  if (on_device && !config->tokens_file.empty()) {
    // Tenants' allocators (TenantPages) draw from the host pool.
    return Fail(absl::FailedPreconditionError(
        "--tokens_file: tenants are served from host memory only; use --backend=cpu"));
  }
  absl::StatusOr<const kvq::KernelBackend*> backend = kvq::BackendByName(backend_name);
  if (!backend.ok()) return Fail(backend.status());
  config->service.backend_name = backend_name;
  if (on_device) {
    // Pages in one device allocation; the host pool keeps the streams'
    // fp16 sink and tail rows.
    const kvq::DevicePoolConfig device_pool = config->device_pool;
    config->store.make_pages = [device_pool](kvq::PagePool* host) {
      return kvq::MakeDevicePagePool(device_pool, host);
    };
  }

  absl::StatusOr<std::unique_ptr<kvq::SequenceStore>> store =
      kvq::SequenceStore::Create(config->store, *backend);
  if (!store.ok()) return Fail(store.status());
  // The metrics' tier label says where the pages are.
  absl::StatusOr<std::unique_ptr<kvq::Metrics>> metrics = kvq::Metrics::Create(
      config->metrics_address, store->get(), on_device ? "device" : "host", config->metrics_tls);
  if (!metrics.ok()) return Fail(metrics.status());
  kvq::Metrics* m = metrics->get();
  (*store)->set_events({[m](kvq::GoneReason r) { m->RecordGone(r); },
                        [m](int tokens) { m->RecordPrefixHit(tokens); }});

  std::unique_ptr<kvq::Tenants> tenants;
  if (!config->tokens_file.empty()) {
    absl::StatusOr<std::unique_ptr<kvq::Tenants>> t = kvq::Tenants::Load(config->tokens_file);
    if (!t.ok()) return Fail(t.status());
    tenants = std::move(*t);
    tenants->AttachStore(store->get());
  }
  // Loaded before the port opens, so the first CreateSequence finds them.
  kvq::Calibrations calibrations(config->calibration_dir);
  if (!config->calibration_dir.empty()) ScanCalibrations(calibrations, m);
  // Before the service: its open sessions close on them when it goes.
  std::unique_ptr<kvq::KvTransport> ipc_transport, nccl_transport;
  kvq::KvqService service(store->get(), m, config->service);
  service.set_tenants(tenants.get());
  service.set_calibrations(&calibrations);
#ifdef KVQ_HAVE_CUDA_TRANSPORT
  // Device payloads (docs/TRANSPORT.md) on GPU 0 when there is one;
  // without, AppendDevice / FetchDevice answer FAILED_PRECONDITION.
  if (kvq::CudaDeviceCount() > 0) {
    ipc_transport = std::make_unique<kvq::CudaIpcTransport>(0);
    service.set_transport(kvq::TransportKind::kCudaIpc, ipc_transport.get());
#ifdef KVQ_HAVE_NCCL
    nccl_transport = std::make_unique<kvq::NcclTransport>(0);
    service.set_transport(kvq::TransportKind::kNccl, nccl_transport.get());
#endif
  }
#endif
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config->address, kvq::ServerCredentialsFor(config->tls), &port);
  // Twice the limit, so an oversized message reaches the handler's check
  // (which names the limit) instead of failing in the transport.
  const int64_t transport_limit = std::min<int64_t>(2 * config->service.max_message_bytes, INT32_MAX);
  builder.SetMaxReceiveMessageSize(static_cast<int>(transport_limit));
  builder.SetMaxSendMessageSize(static_cast<int>(transport_limit));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(absl::UnavailableError(absl::StrCat("cannot listen on ", config->address)));
  }
  // Before the port file and the start-up lines announce the server: a
  // SIGTERM sent as soon as they appear must shut it down cleanly.
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGHUP, OnHangup);
  if (!config->port_file.empty()) {
    std::ofstream(config->port_file) << port << "\n";
  }
  const std::string host = config->address.substr(0, config->address.rfind(':'));
  std::printf("kvq-server: listening on %s:%d (backend %s, SIMD %s, pool %zu MiB%s)\n", host.c_str(),
              port, backend_name.c_str(), kvq::cpu::ActiveSimdTarget().c_str(),
              config->store.pool.capacity_bytes >> 20,
              config->tls.mutual() ? ", mutual TLS" : config->tls.enabled() ? ", TLS" : "");
  if (tenants) {
    std::printf("kvq-server: %zu tenants from %s\n", tenants->Specs().size(),
                config->tokens_file.c_str());
  }
  if (m->port() != 0) {
    const std::string mhost = config->metrics_address.substr(0, config->metrics_address.rfind(':'));
    std::printf("kvq-server: metrics at %s://%s:%d/metrics\n",
                config->metrics_tls.enabled() ? "https" : "http", mhost.c_str(), m->port());
  }
  std::fflush(stdout);

  absl::Time next_reap = absl::Now() + config->reaper_interval;
  absl::Time next_tokens = absl::Now() + config->tokens_reload_interval;
  const bool reload_calibrations = config->calibration_reload_interval > absl::ZeroDuration();
  absl::Time next_calibrations = absl::Now() + config->calibration_reload_interval;
  while (!g_stop.load()) {
    absl::SleepFor(absl::Milliseconds(50));
    if (!config->calibration_dir.empty() &&
        (g_rescan.exchange(false) || (reload_calibrations && absl::Now() >= next_calibrations))) {
      ScanCalibrations(calibrations, m);
      next_calibrations = absl::Now() + config->calibration_reload_interval;
    }
    if (tenants && absl::Now() >= next_tokens) {
      // A file that does not parse keeps the table in force.
      absl::StatusOr<bool> reloaded = tenants->ReloadIfChanged();
      if (!reloaded.ok()) {
        std::printf("kvq-server: tokens file not reloaded, the previous table stays: %s\n",
                    std::string(reloaded.status().message()).c_str());
        std::fflush(stdout);
      } else if (*reloaded) {
        std::printf("kvq-server: tokens file reloaded: %zu tenants\n", tenants->Specs().size());
        std::fflush(stdout);
      }
      next_tokens = absl::Now() + config->tokens_reload_interval;
    }
    if (absl::Now() >= next_reap) {
      (*store)->ExpireIdle(absl::Now());
      next_reap = absl::Now() + config->reaper_interval;
    }
  }
  std::printf("kvq-server: shutting down\n");
  std::fflush(stdout);
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(config->shutdown_grace)));
  server->Wait();
  return 0;
}
