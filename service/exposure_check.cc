#include "service/exposure_check.h"

#include <arpa/inet.h>

#include <algorithm>
#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvq {
namespace {

// The host part of "host:port", "[v6]:port" or a bare "v6" literal with a
// port ("::1:50051" is ambiguous, so IPv6 hosts need brackets, as gRPC
// wants them too). Errors name --address.
absl::StatusOr<std::string> HostOf(absl::string_view address) {
  absl::string_view host;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--address=", address, ": an IPv6 host needs a closing ']'"));
    }
    host = address.substr(1, close - 1);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("--address=", address, ": must be host:port"));
    }
    host = address.substr(0, colon);
  }
  return std::string(host);
}

}  // namespace

bool IsLoopbackHost(absl::string_view host) {
  if (absl::AsciiStrToLower(host) == "localhost") return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    static const in6_addr kLoopback = IN6ADDR_LOOPBACK_INIT;
    return std::equal(std::begin(v6.s6_addr), std::end(v6.s6_addr), std::begin(kLoopback.s6_addr));
  }
  return false;  // Empty, 0.0.0.0, ::, another name or address: not only this machine.
}

absl::StatusOr<ExposureVerdict> CheckExposure(const ExposureInputs& in) {
  absl::StatusOr<std::string> host = HostOf(in.address);
  if (!host.ok()) return host.status();
  ExposureVerdict verdict;
  verdict.loopback = IsLoopbackHost(*host);
  const bool authenticated = in.tokens_enabled || (in.tls_enabled && in.client_certs_required);
  if (verdict.loopback || (in.tls_enabled && authenticated)) return verdict;
  if (!in.insecure) {
    if (!in.tls_enabled) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--address=", in.address,
          " is reachable from the network in plaintext: set --tls_cert and --tls_key (and "
          "--tokens_file or --tls_client_ca), or pass --insecure to serve it anyway"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "--address=", in.address,
        " is reachable from the network without authenticating callers: set --tokens_file or "
        "--tls_client_ca, or pass --insecure to serve it anyway"));
  }
  if (!in.tls_enabled && !authenticated) {
    verdict.warning = absl::StrCat(
        "WARNING: --insecure: serving ", in.address,
        " in plaintext without tokens; anyone who can reach it can read and change every "
        "sequence");
  } else if (!in.tls_enabled) {
    verdict.warning = absl::StrCat("WARNING: --insecure: serving ", in.address,
                                   " in plaintext; tokens and KV cross the network unencrypted");
  } else {
    verdict.warning = absl::StrCat(
        "WARNING: --insecure: serving ", in.address,
        " without authenticating callers; anyone who can reach it can read and change every "
        "sequence");
  }
  return verdict;
}

}  // namespace kvq
