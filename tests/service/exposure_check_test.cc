// The exposure rule of kvq-server's listen address (service/exposure_check.h).
#include "service/exposure_check.h"

#include "gtest/gtest.h"

namespace kvq {
namespace {

constexpr char kPlaintextRefusal[] =
    " is reachable from the network in plaintext: set --tls_cert and --tls_key (and "
    "--tokens_file or --tls_client_ca), or pass --insecure to serve it anyway";
constexpr char kUnauthenticatedRefusal[] =
    " is reachable from the network without authenticating callers: set --tokens_file or "
    "--tls_client_ca, or pass --insecure to serve it anyway";

TEST(IsLoopbackHostTest, OnlyThisMachinesAddressesAndLocalhost) {
  for (const char* host : {"127.0.0.1", "127.255.0.9", "::1", "0:0:0:0:0:0:0:1", "localhost",
                           "LocalHost"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host : {"", "0.0.0.0", "::", "128.0.0.1", "10.0.0.1", "::2", "::ffff:127.0.0.1",
                           "kvq.internal", "localhost.example", "126.255.255.255"}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
}

TEST(CheckExposureTest, LoopbackNeedsNothing) {
  for (const char* address : {"127.0.0.1:50051", "[::1]:0", "localhost:50051", "127.0.0.2:1"}) {
    absl::StatusOr<ExposureVerdict> v = CheckExposure({.address = address});
    ASSERT_TRUE(v.ok()) << address << ": " << v.status();
    EXPECT_TRUE(v->loopback) << address;
    EXPECT_EQ(v->warning, "") << address;
  }
}

TEST(CheckExposureTest, NetworkAddressWithoutTlsIsRefusedNamingTheFlags) {
  for (const char* address : {"0.0.0.0:50051", "[::]:50051", "10.1.2.3:0", "kvq.internal:50051",
                              ":50051"}) {
    for (bool tokens : {false, true}) {  // Tokens alone would cross in clear text.
      absl::StatusOr<ExposureVerdict> v =
          CheckExposure({.address = address, .tokens_enabled = tokens});
      ASSERT_FALSE(v.ok()) << address;
      EXPECT_EQ(v.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(v.status().message(), std::string("--address=") + address + kPlaintextRefusal);
    }
  }
}

TEST(CheckExposureTest, TlsWithoutAuthenticationIsRefusedNamingTheFlags) {
  absl::StatusOr<ExposureVerdict> v =
      CheckExposure({.address = "0.0.0.0:50051", .tls_enabled = true});
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(v.status().message(), std::string("--address=0.0.0.0:50051") + kUnauthenticatedRefusal);
}

TEST(CheckExposureTest, TlsWithTokensOrClientCertsMakeANetworkAddressFineWithoutAWarning) {
  for (const ExposureInputs& in :
       {ExposureInputs{.address = "0.0.0.0:50051", .tls_enabled = true, .tokens_enabled = true},
        ExposureInputs{
            .address = "0.0.0.0:50051", .tls_enabled = true, .client_certs_required = true},
        ExposureInputs{.address = "[::]:1",
                       .tls_enabled = true,
                       .client_certs_required = true,
                       .insecure = true}}) {
    absl::StatusOr<ExposureVerdict> v = CheckExposure(in);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_FALSE(v->loopback);
    EXPECT_EQ(v->warning, "");
  }
}

TEST(CheckExposureTest, InsecureAllowsPlaintextOnTheNetworkWithAWarning) {
  absl::StatusOr<ExposureVerdict> v =
      CheckExposure({.address = "0.0.0.0:50051", .insecure = true});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->loopback);
  EXPECT_EQ(v->warning,
            "WARNING: --insecure: serving 0.0.0.0:50051 in plaintext without tokens; anyone who "
            "can reach it can read and change every sequence");
  v = CheckExposure({.address = "0.0.0.0:50051", .tokens_enabled = true, .insecure = true});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->warning,
            "WARNING: --insecure: serving 0.0.0.0:50051 in plaintext; tokens and KV cross the "
            "network unencrypted");
  v = CheckExposure({.address = "0.0.0.0:50051", .tls_enabled = true, .insecure = true});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->warning,
            "WARNING: --insecure: serving 0.0.0.0:50051 without authenticating callers; anyone "
            "who can reach it can read and change every sequence");
  // On loopback --insecure changes nothing and warns of nothing.
  v = CheckExposure({.address = "127.0.0.1:50051", .insecure = true});
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->warning, "");
}

TEST(CheckExposureTest, MalformedAddressIsInvalidArgument) {
  absl::StatusOr<ExposureVerdict> v = CheckExposure({.address = "0.0.0.0"});
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v.status().message(), "--address=0.0.0.0: must be host:port");
  v = CheckExposure({.address = "[::1:50051"});
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v.status().message(), "--address=[::1:50051: an IPv6 host needs a closing ']'");
}

}  // namespace
}  // namespace kvq
