// HTTPS for the Prometheus /metrics port (--metrics_tls_cert,
// --metrics_tls_key), served by GNU libmicrohttpd over GnuTLS.
//
// Without those flags the port stays prometheus-cpp's Exposer (civetweb,
// plain HTTP). civetweb as Debian 12 ships it (1.15) cannot serve HTTPS with
// OpenSSL 3: it looks up SSL_get_peer_certificate at run time, a symbol
// OpenSSL 3 no longer exports, and crashes on the first request. So the TLS
// case has its own small server: GET /metrics answers the text exposition,
// every other path 404.
//
// Rotation: every refresh interval a thread re-reads both files; when their
// bytes changed and they form a valid pair (the same checks as at start-up),
// new handshakes present the new certificate. A half-written rotation (a new
// certificate beside the old key) is refused and the previous pair stays in
// use until the next refresh finds a matching pair. Open connections keep the
// session they negotiated.
#ifndef KVQ_SERVICE_METRICS_HTTPS_SERVER_H_
#define KVQ_SERVICE_METRICS_HTTPS_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvq {

struct MetricsTlsOptions {
  std::string cert_file;  // --metrics_tls_cert: PEM certificate chain, leaf first.
  std::string key_file;   // --metrics_tls_key: PEM private key (unencrypted).
  absl::Duration refresh_interval = absl::Seconds(60);  // --tls_refresh_seconds.

  bool enabled() const { return !cert_file.empty(); }
};

// Both flags or neither, a metrics address to serve them on, refresh in
// [1 s, 1 day], and the files as they are now (readable PEM, the key
// matching the certificate). INVALID_ARGUMENT naming the flag and the file.
absl::Status ValidateMetricsTlsOptions(const MetricsTlsOptions& options,
                                       const std::string& metrics_address);

// Bounds of the server (a scrape is one short request).
inline constexpr unsigned int kMetricsHttpsMaxConnections = 32;
inline constexpr unsigned int kMetricsHttpsTimeoutSeconds = 10;

class MetricsHttpsServer {
 public:
  // Listens on `bind` ("127.0.0.1:9464", "[::1]:0"; port 0 picks a free
  // one) and answers GET /metrics with `scrape()`. Call
  // ValidateMetricsTlsOptions first. One at a time per process (GnuTLS's
  // certificate callback carries no user pointer): FAILED_PRECONDITION for
  // a second one.
  static absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> Start(
      const std::string& bind, const MetricsTlsOptions& options,
      std::function<std::string()> scrape);
  ~MetricsHttpsServer();  // Stops serving and the reload thread.

  int port() const;

  class Impl;

 private:
  explicit MetricsHttpsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_METRICS_HTTPS_SERVER_H_
