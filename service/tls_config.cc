#include "service/tls_config.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace kvq {
namespace {

absl::Status Bad(absl::string_view flag, const std::string& path, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": ", why));
}

absl::StatusOr<std::string> ReadFile(absl::string_view flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Bad(flag, path, absl::StrCat("cannot read (", std::strerror(errno), ")"));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Bad(flag, path, "cannot read");
  return ss.str();
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

std::unique_ptr<BIO, BioFree> MemBio(const std::string& bytes) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(bytes.data(), static_cast<int>(bytes.size())));
}

// The first PEM certificate of the file, or an error naming the flag.
absl::StatusOr<X509Ptr> FirstCertificate(absl::string_view flag, const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFile(flag, path);
  if (!bytes.ok()) return bytes.status();
  auto bio = MemBio(*bytes);
  X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (cert == nullptr) return Bad(flag, path, "no PEM certificate (-----BEGIN CERTIFICATE-----) in the file");
  return cert;
}

// Never prompts on the terminal for an encrypted key's passphrase.
int NoPassphrase(char*, int, int, void*) { return -1; }

}  // namespace

absl::Status CheckCertificateFile(absl::string_view flag, const std::string& path) {
  return FirstCertificate(flag, path).status();
}

absl::Status CheckKeyPairFiles(absl::string_view cert_flag, const std::string& cert_path,
                               absl::string_view key_flag, const std::string& key_path) {
  absl::StatusOr<X509Ptr> cert = FirstCertificate(cert_flag, cert_path);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key_bytes = ReadFile(key_flag, key_path);
  if (!key_bytes.ok()) return key_bytes.status();
  auto bio = MemBio(*key_bytes);
  std::unique_ptr<EVP_PKEY, PkeyFree> key(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  ERR_clear_error();
  if (key == nullptr) {
    return Bad(key_flag, key_path, "no unencrypted PEM private key in the file");
  }
  if (X509_check_private_key(cert->get(), key.get()) != 1) {
    ERR_clear_error();
    return Bad(key_flag, key_path,
               absl::StrCat("does not match the certificate of --", cert_flag, "=", cert_path));
  }
  return absl::OkStatus();
}

absl::Status ValidateTlsServerOptions(const TlsServerOptions& o) {
  if (o.cert_file.empty() && !o.key_file.empty()) {
    return absl::InvalidArgumentError("--tls_key is set without --tls_cert: TLS needs both");
  }
  if (!o.cert_file.empty() && o.key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert is set without --tls_key: TLS needs both");
  }
  if (!o.enabled()) {
    if (o.mutual()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca is set without --tls_cert and --tls_key: mutual TLS needs the "
          "server's own certificate too");
    }
    return absl::OkStatus();
  }
  if (o.refresh_interval < absl::Seconds(1) || o.refresh_interval > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat("--tls_refresh_seconds=",
                                                   absl::ToInt64Seconds(o.refresh_interval),
                                                   ": must be in [1, 86400]"));
  }
  if (absl::Status s = CheckKeyPairFiles("tls_cert", o.cert_file, "tls_key", o.key_file); !s.ok()) {
    return s;
  }
  if (o.mutual()) return CheckCertificateFile("tls_client_ca", o.client_ca_file);
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsServerOptions& o) {
  if (!o.enabled()) return grpc::InsecureServerCredentials();
  using grpc::experimental::FileWatcherCertificateProvider;
  auto provider = std::make_shared<FileWatcherCertificateProvider>(
      o.key_file, o.cert_file, o.client_ca_file,
      static_cast<unsigned int>(absl::ToInt64Seconds(o.refresh_interval)));
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (o.mutual()) {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace kvq
