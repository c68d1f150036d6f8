// The exposure rule of kvq-server's gRPC listen address: a server anyone
// on the network can reach must encrypt (TLS) and authenticate its callers
// (tenant tokens, or client certificates with mutual TLS), unless the
// operator says --insecure on purpose. Tokens alone would cross the
// network in clear text; TLS alone lets anyone who reaches the port read
// every sequence.
// Loopback (127.0.0.0/8, ::1, localhost) is only reachable from this
// machine and needs nothing. A pure function, so the rule is unit-tested
// without starting a server.
#ifndef KVQ_SERVICE_EXPOSURE_CHECK_H_
#define KVQ_SERVICE_EXPOSURE_CHECK_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvq {

struct ExposureInputs {
  std::string address;  // --address, "host:port" ("[::1]:port" for IPv6).
  bool tls_enabled = false;
  bool client_certs_required = false;  // --tls_client_ca (mutual TLS).
  bool tokens_enabled = false;
  bool insecure = false;  // --insecure.
};

struct ExposureVerdict {
  bool loopback = false;
  // Non-empty: the server starts but logs this line (reachable from the
  // network without TLS or without authentication, allowed by --insecure).
  std::string warning;
};

// INVALID_ARGUMENT when the address has no host; FAILED_PRECONDITION
// naming what is missing (--tls_cert and --tls_key; --tokens_file or
// --tls_client_ca) and --insecure when a non-loopback address lacks TLS or
// caller authentication and --insecure is not set.
absl::StatusOr<ExposureVerdict> CheckExposure(const ExposureInputs& in);

// Whether `host` (no port, no brackets) only names this machine:
// 127.0.0.0/8, ::1, or "localhost". An empty host, 0.0.0.0 and :: are every
// interface, not loopback.
bool IsLoopbackHost(absl::string_view host);

}  // namespace kvq

#endif  // KVQ_SERVICE_EXPOSURE_CHECK_H_
