// TLS of kvq-server's gRPC port: the --tls_* flags as one options struct,
// checked before the server starts (every error names the flag and the
// file), and turned into gRPC server credentials that re-read the files
// while the server runs.
//
// The credentials come from gRPC's FileWatcherCertificateProvider: every
// refresh interval it re-reads the key, the certificate chain and the
// client CA bundle, and new handshakes use what it read. Connections that
// are already up (and their streams) keep the session they negotiated, so
// rotating a certificate drops nothing. Replace the key and the
// certificate together, as gRPC asks: write the new files beside the old
// ones and rename them over, or swap a symlinked directory. A refresh that
// reads a key and a certificate that do not belong together can serve a
// broken pair until the next refresh.
#ifndef KVQ_SERVICE_TLS_CONFIG_H_
#define KVQ_SERVICE_TLS_CONFIG_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"

namespace kvq {

struct TlsServerOptions {
  std::string cert_file;       // --tls_cert: PEM certificate chain, leaf first.
  std::string key_file;        // --tls_key: PEM private key (unencrypted).
  std::string client_ca_file;  // --tls_client_ca: require client certificates it signed (mTLS).
  absl::Duration refresh_interval = absl::Seconds(60);  // --tls_refresh_seconds.

  bool enabled() const { return !cert_file.empty(); }
  bool mutual() const { return !client_ca_file.empty(); }
};

// The flag combination (a key needs a certificate and the other way round,
// a client CA needs both, refresh in [1 s, 1 day]) and the files as they are
// now: readable, PEM, the key matching the certificate's public key. All
// INVALID_ARGUMENT naming the flag. OK for options without TLS.
absl::Status ValidateTlsServerOptions(const TlsServerOptions& options);

// Insecure credentials when TLS is off; otherwise TLS credentials that
// watch the files (call ValidateTlsServerOptions first).
std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsServerOptions& options);

// Checks that `cert_path` holds at least one PEM certificate and `key_path`
// an unencrypted PEM private key of the first one; errors name `cert_flag`
// and `key_flag` ("tls_cert", "tls_key").
absl::Status CheckKeyPairFiles(absl::string_view cert_flag, const std::string& cert_path,
                               absl::string_view key_flag, const std::string& key_path);

// Checks that `path` holds at least one PEM certificate (a CA bundle).
absl::Status CheckCertificateFile(absl::string_view flag, const std::string& path);

}  // namespace kvq

#endif  // KVQ_SERVICE_TLS_CONFIG_H_
