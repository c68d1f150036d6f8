#include "client/tls_flags.h"

#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/tls_credentials.h"

ABSL_FLAG(std::string, tls_ca, "",
          "TLS: PEM CA bundle the server's certificate must chain to (any --tls_* flag turns TLS "
          "on; without --tls_ca the system's roots are trusted)");
ABSL_FLAG(std::string, tls_cert, "", "TLS: PEM client certificate chain, for mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "TLS: PEM private key (unencrypted) of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "TLS: the name checked against the server's certificate, when --server's host is not "
          "one it names");

namespace kvq {

absl::Status ApplyTlsFlags(ClientOptions* options) {
  TlsClientFiles files{.ca_file = absl::GetFlag(FLAGS_tls_ca),
                       .cert_file = absl::GetFlag(FLAGS_tls_cert),
                       .key_file = absl::GetFlag(FLAGS_tls_key)};
  const std::string server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (files.ca_file.empty() && files.cert_file.empty() && files.key_file.empty()) {
    if (!server_name.empty()) {
      return absl::InvalidArgumentError(
          "--tls_server_name is set without --tls_ca, --tls_cert or --tls_key: the connection "
          "would be plaintext");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = TlsCredentialsFromFiles(files);
  if (!creds.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", creds.status().message()));
  }
  options->credentials = *std::move(creds);
  options->tls_server_name = server_name;
  return absl::OkStatus();
}

}  // namespace kvq
