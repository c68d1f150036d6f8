// The --tls_* checks kvq-server runs before it starts
// (service/tls_config.h), on certificates made with
// openssl at test time (tests/integration/make_test_certs.sh).
#include "service/tls_config.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_certs_fixture.h"

namespace kvq {
namespace {

class TlsConfigTest : public TestCertsFixture {
 protected:
  static TlsServerOptions Server(std::string cert, std::string key, std::string ca = "") {
    TlsServerOptions o;
    o.cert_file = cert.empty() ? "" : F(cert);
    o.key_file = key.empty() ? "" : F(key);
    o.client_ca_file = ca.empty() ? "" : F(ca);
    return o;
  }
};

void ExpectInvalid(const absl::Status& s, const std::string& message) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), message);
}

TEST_F(TlsConfigTest, NoFlagsIsPlaintextAndValid) {
  TlsServerOptions o;
  EXPECT_FALSE(o.enabled());
  EXPECT_TRUE(ValidateTlsServerOptions(o).ok());
}

TEST_F(TlsConfigTest, MatchingPairAndCaAreValid) {
  EXPECT_TRUE(ValidateTlsServerOptions(Server("server.pem", "server.key")).ok());
  TlsServerOptions m = Server("server.pem", "server.key", "ca.pem");
  EXPECT_TRUE(m.mutual());
  EXPECT_TRUE(ValidateTlsServerOptions(m).ok());
}

TEST_F(TlsConfigTest, HalfAPairIsRefusedNamingTheMissingFlag) {
  ExpectInvalid(ValidateTlsServerOptions(Server("", "server.key")),
                "--tls_key is set without --tls_cert: TLS needs both");
  ExpectInvalid(ValidateTlsServerOptions(Server("server.pem", "")),
                "--tls_cert is set without --tls_key: TLS needs both");
  ExpectInvalid(ValidateTlsServerOptions(Server("", "", "ca.pem")),
                "--tls_client_ca is set without --tls_cert and --tls_key: mutual TLS needs the "
                "server's own certificate too");
}

TEST_F(TlsConfigTest, UnreadableOrWrongFilesAreRefusedNamingFlagAndFile) {
  ExpectInvalid(ValidateTlsServerOptions(Server("missing.pem", "server.key")),
                absl::StrCat("--tls_cert=", F("missing.pem"),
                             ": cannot read (No such file or directory)"));
  ExpectInvalid(ValidateTlsServerOptions(Server("server.key", "server.key")),
                absl::StrCat("--tls_cert=", F("server.key"),
                             ": no PEM certificate (-----BEGIN CERTIFICATE-----) in the file"));
  ExpectInvalid(ValidateTlsServerOptions(Server("server.pem", "server.pem")),
                absl::StrCat("--tls_key=", F("server.pem"),
                             ": no unencrypted PEM private key in the file"));
  ExpectInvalid(ValidateTlsServerOptions(Server("server.pem", "client.key")),
                absl::StrCat("--tls_key=", F("client.key"), ": does not match the certificate of ",
                             "--tls_cert=", F("server.pem")));
  ExpectInvalid(ValidateTlsServerOptions(Server("server.pem", "server.key", "ca.key")),
                absl::StrCat("--tls_client_ca=", F("ca.key"),
                             ": no PEM certificate (-----BEGIN CERTIFICATE-----) in the file"));
}

TEST_F(TlsConfigTest, EncryptedKeyIsRefusedWithoutPrompting) {
  const std::string encrypted = F("encrypted.key");
  ASSERT_EQ(std::system(absl::StrCat("openssl pkey -in '", F("server.key"), "' -aes256 -passout ",
                                     "pass:secret -out '", encrypted, "'")
                            .c_str()),
            0);
  ExpectInvalid(ValidateTlsServerOptions(Server("server.pem", "encrypted.key")),
                absl::StrCat("--tls_key=", encrypted, ": no unencrypted PEM private key in the file"));
}

TEST_F(TlsConfigTest, RefreshIntervalIsBounded) {
  TlsServerOptions o = Server("server.pem", "server.key");
  o.refresh_interval = absl::ZeroDuration();
  ExpectInvalid(ValidateTlsServerOptions(o), "--tls_refresh_seconds=0: must be in [1, 86400]");
  o.refresh_interval = absl::Seconds(86401);
  ExpectInvalid(ValidateTlsServerOptions(o), "--tls_refresh_seconds=86401: must be in [1, 86400]");
  o.refresh_interval = absl::Seconds(1);
  EXPECT_TRUE(ValidateTlsServerOptions(o).ok());
}

}  // namespace
}  // namespace kvq
