// HTTPS for the Prometheus /metrics port: prometheus-cpp's Exposer runs
// civetweb, and Debian's civetweb loads OpenSSL (libssl.so) when a
// listening port ends in "s". The certificate and key are read once, when
// the exposer starts (a restart picks up new files; the gRPC port's
// certificates are the ones reloaded live, tls_config.h).
#ifndef KVQ_SERVICE_METRICS_TLS_H_
#define KVQ_SERVICE_METRICS_TLS_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "prometheus/exposer.h"

namespace kvq {

struct MetricsTlsOptions {
  std::string cert_file;  // --metrics_tls_cert: PEM certificate chain, leaf first.
  std::string key_file;   // --metrics_tls_key: PEM private key (unencrypted).

  bool enabled() const { return !cert_file.empty(); }
};

// Both flags or neither; the files readable and matching
// (INVALID_ARGUMENT naming the flag).
absl::Status ValidateMetricsTlsOptions(const MetricsTlsOptions& options);

// An exposer serving HTTPS (TLS 1.2 or later) on `bind` ("host:port", port 0
// picks one). UNAVAILABLE when it cannot listen or TLS cannot start (e.g.
// no libssl.so to load).
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartHttpsExposer(
    const std::string& bind, const MetricsTlsOptions& options);

}  // namespace kvq

#endif  // KVQ_SERVICE_METRICS_TLS_H_
