// TLS and mutual-TLS channel credentials for KvqClient from PEM files:
//
//   ClientOptions options{.target = "kvq.example:50051"};
//   options.credentials = TlsCredentialsFromFiles({.ca_file = "ca.pem",
//                                                  .cert_file = "client.pem",
//                                                  .key_file = "client.key"}).value();
//   auto client = KvqClient::Connect(options).value();
//
// The files are read once, here. ClientOptions::tls_server_name overrides the
// name checked against the server's certificate (when the target is an
// address the certificate does not name).
#ifndef KVQ_CLIENT_TLS_CREDENTIALS_H_
#define KVQ_CLIENT_TLS_CREDENTIALS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"

namespace kvq {

struct TlsClientFiles {
  // PEM CA bundle the server's certificate must chain to; empty: the
  // system's roots (gRPC's default roots).
  std::string ca_file;
  // The client's PEM certificate chain and unencrypted key, for a server
  // that requires client certificates (mutual TLS); both or neither.
  std::string cert_file;
  std::string key_file;
};

// INVALID_ARGUMENT naming the field (tls_ca, tls_cert, tls_key: the names of
// the CLI flags) when a file cannot be read or holds no PEM block, or when
// only one of cert and key is set.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsCredentialsFromFiles(
    const TlsClientFiles& files);

}  // namespace kvq

#endif  // KVQ_CLIENT_TLS_CREDENTIALS_H_
