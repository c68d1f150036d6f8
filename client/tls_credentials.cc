#include "client/tls_credentials.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvq {
namespace {

// The file's bytes if it holds a PEM block (the check catches a DER file or
// a wrong path early; gRPC itself parses the PEM).
absl::StatusOr<std::string> ReadPem(absl::string_view name, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=", path, ": cannot read (", std::strerror(errno), ")"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string pem = ss.str();
  if (!absl::StrContains(pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=", path, ": no PEM block in the file"));
  }
  return pem;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsCredentialsFromFiles(
    const TlsClientFiles& files) {
  if (files.cert_file.empty() != files.key_file.empty()) {
    return absl::InvalidArgumentError(files.cert_file.empty()
                                          ? "tls_key is set without tls_cert: a client certificate needs both"
                                          : "tls_cert is set without tls_key: a client certificate needs both");
  }
  grpc::SslCredentialsOptions ssl;
  if (!files.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem("tls_ca", files.ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *std::move(ca);
  }
  if (!files.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem("tls_cert", files.cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPem("tls_key", files.key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace kvq
