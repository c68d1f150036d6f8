// ServerConfig: every setting of kvq-server, filled from absl flags and
// checked in one place (each error names the flag and its bound).
#ifndef KVQ_SERVICE_SERVER_CONFIG_H_
#define KVQ_SERVICE_SERVER_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "service/backend_choice.h"
#include "service/kvq_service.h"
#include "service/metrics_https_server.h"
#include "service/sequence_store.h"
#include "service/tls_config.h"

namespace kvq {

struct ServerConfig {
  std::string address = "127.0.0.1:50051";
  std::string metrics_address = "127.0.0.1:9464";  // Empty: no metrics endpoint.
  std::string backend = "auto";                    // auto | cpu | ref | cuda
  std::string port_file;  // Written with the bound gRPC port (tests use port 0).
  absl::Duration reaper_interval = absl::Seconds(1);
  absl::Duration shutdown_grace = absl::Seconds(10);
  bool retain_message_buffers = true;  // RetainMessageBuffers() at start.
  std::string tokens_file;  // Empty: no tenants (every call is the default tenant).
  absl::Duration tokens_reload_interval = absl::Seconds(1);
  std::string calibration_dir;  // Empty: no calibrations (service/calibrations.h).
  absl::Duration calibration_reload_interval = absl::Seconds(60);  // Zero: SIGHUP only.
  StoreOptions store;
  DevicePoolConfig device_pool;  // --device_*: the pages' pool with --backend=cuda.
  ServiceOptions service;
  TlsServerOptions tls;           // --tls_cert, --tls_key, --tls_client_ca.
  MetricsTlsOptions metrics_tls;  // --metrics_tls_cert, --metrics_tls_key.
  bool insecure = false;          // --insecure (exposure_check.h).
};

// Reads the flags defined in server_config.cc.
absl::StatusOr<ServerConfig> ConfigFromFlags();

// Bytes of memory available for the pool on this machine (host memory on
// the CPU backend), for --capacity_fraction.
absl::StatusOr<size_t> AvailableMemoryBytes();

}  // namespace kvq

#endif  // KVQ_SERVICE_SERVER_CONFIG_H_
