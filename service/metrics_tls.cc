#include "service/metrics_tls.h"

#include <openssl/ssl.h>

#include <exception>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "CivetServer.h"  // CivetCallbacks
#include "service/tls_config.h"

namespace kvq {
namespace {

// civetweb's init_ssl callback gets no context of ours (its user data is the
// CivetServer that prometheus-cpp creates), so the files it loads are
// handed over here; the lock is held while the exposer starts, which is
// when civetweb calls it.
absl::Mutex g_init_mu;
const MetricsTlsOptions* g_init_options ABSL_GUARDED_BY(g_init_mu) = nullptr;

// Loads the certificate chain and the key from their own files (civetweb's
// ssl_certificate option wants both in one file). 1: the certificate is set
// up; -1: TLS fails to start.
int InitSsl(void* ssl_ctx, void* /*user_data*/) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  SSL_CTX* ctx = static_cast<SSL_CTX*>(ssl_ctx);
  const MetricsTlsOptions* o = g_init_options;
  if (o == nullptr) return -1;
  if (SSL_CTX_use_certificate_chain_file(ctx, o->cert_file.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(ctx, o->key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx) != 1) {
    return -1;
  }
  return 1;
}

}  // namespace

absl::Status ValidateMetricsTlsOptions(const MetricsTlsOptions& o) {
  if (o.cert_file.empty() != o.key_file.empty()) {
    return absl::InvalidArgumentError(
        o.cert_file.empty() ? "--metrics_tls_key is set without --metrics_tls_cert: HTTPS needs both"
                            : "--metrics_tls_cert is set without --metrics_tls_key: HTTPS needs both");
  }
  if (!o.enabled()) return absl::OkStatus();
  return CheckKeyPairFiles("metrics_tls_cert", o.cert_file, "metrics_tls_key", o.key_file);
}

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartHttpsExposer(
    const std::string& bind, const MetricsTlsOptions& options) {
  CivetCallbacks callbacks{};
  callbacks.init_ssl = &InitSsl;
  // "s": this port speaks TLS. Protocol 4: TLS 1.2 and later only.
  const std::vector<std::string> civet_options = {
      "listening_ports", bind + "s", "num_threads", "2", "ssl_protocol_version", "4"};
  absl::MutexLock lock(&g_init_mu);
  g_init_options = &options;
  std::unique_ptr<prometheus::Exposer> exposer;
  std::string error;
  try {
    exposer = std::make_unique<prometheus::Exposer>(civet_options, &callbacks);
  } catch (const std::exception& e) {
    error = e.what();
  }
  g_init_options = nullptr;
  if (exposer == nullptr) {
    return absl::UnavailableError(absl::StrCat("metrics: cannot serve HTTPS on ", bind, ": ", error,
                                               " (civetweb needs libssl.so, from libssl-dev)"));
  }
  return exposer;
}

}  // namespace kvq
