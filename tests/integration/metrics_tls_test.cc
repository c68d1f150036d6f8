// HTTPS on the metrics port of the real kvq-server (--metrics_tls_cert,
// --metrics_tls_key; service/metrics_https_server.h): what curl sees with
// the right CA, another CA and plain HTTP, certificate rotation, and the
// start-up checks of the flags. Certificates come from make_test_certs.sh.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_helpers.h"
#include "tests/test_certs_fixture.h"

namespace kvq {
namespace {

// curl's exit code when the server's certificate does not verify.
constexpr int kCurlPeerFailedVerification = 60;

class MetricsTlsTest : public TestCertsFixture {
 protected:
  static std::vector<std::string> MetricsTlsFlags() {
    return {"--metrics_tls_cert=" + F("server.pem"), "--metrics_tls_key=" + F("server.key")};
  }

  // curl's exit code for `url`, trusting only `ca_file` (none: plain
  // HTTP); `output` gets the body, or with `write_out` only that.
  static int Curl(const std::string& url, const std::string& ca_file, std::string* output,
                  const std::string& write_out = "") {
    std::string command = "curl -sS --max-time 20";
    if (!ca_file.empty()) absl::StrAppend(&command, " --cacert '", ca_file, "'");
    if (!write_out.empty()) absl::StrAppend(&command, " -o /dev/null -w '", write_out, "'");
    return RunCommand(absl::StrCat(command, " '", url, "'"), output);
  }

};

TEST_F(MetricsTlsTest, ServesTheRegistryOverHttpsAnd404ElsewhereWithTheRightCa) {
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start(MetricsTlsFlags()).ok());
  EXPECT_TRUE(absl::StrContains(server.Stdout(), "kvq-server: metrics at https://127.0.0.1:"))
      << server.Stdout();
  absl::StatusOr<std::string> address = server.MetricsAddress();
  ASSERT_TRUE(address.ok()) << address.status();
  const std::string base = "https://" + *address;
  std::string out;
  ASSERT_EQ(Curl(base + "/metrics", F("ca.pem"), &out), 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "\nkvq_used_bytes{tier=\"host\"} 0\n")) << out;
  EXPECT_TRUE(absl::StrContains(out, "# TYPE kvq_rpc_requests_total counter\n")) << out;
  ASSERT_EQ(Curl(base + "/metrics", F("ca.pem"), &out, "%{http_code} %{content_type}"), 0);
  EXPECT_EQ(out, "200 text/plain; version=0.0.4");
  ASSERT_EQ(Curl(base + "/", F("ca.pem"), &out, "%{http_code}"), 0);
  EXPECT_EQ(out, "404");
  ASSERT_EQ(Curl(base + "/metrics/x", F("ca.pem"), &out, "%{http_code}"), 0);
  EXPECT_EQ(out, "404");
  // The certificate names localhost too.
  ASSERT_EQ(Curl("https://localhost:" + address->substr(address->rfind(':') + 1) + "/metrics",
                 F("ca.pem"), &out, "%{http_code}"),
            0);
  EXPECT_EQ(out, "200");
}

TEST_F(MetricsTlsTest, PlainHttpAndAnotherCaGetNoMetrics) {
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start(MetricsTlsFlags()).ok());
  absl::StatusOr<std::string> address = server.MetricsAddress();
  ASSERT_TRUE(address.ok()) << address.status();
  std::string out;
  EXPECT_NE(Curl("http://" + *address + "/metrics", "", &out), 0) << out;
  EXPECT_FALSE(absl::StrContains(out, "kvq_")) << out;
  EXPECT_EQ(Curl("https://" + *address + "/metrics", F("other_ca.pem"), &out),
            kCurlPeerFailedVerification)
      << out;
  EXPECT_FALSE(absl::StrContains(out, "kvq_")) << out;
  // The server still serves after both.
  EXPECT_EQ(Curl("https://" + *address + "/metrics", F("ca.pem"), &out), 0) << out;
}

TEST_F(MetricsTlsTest, WithoutTheFlagsTheMetricsPortStaysPlainHttp) {
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start().ok());
  EXPECT_TRUE(absl::StrContains(server.Stdout(), "kvq-server: metrics at http://127.0.0.1:"))
      << server.Stdout();
  absl::StatusOr<std::string> address = server.MetricsAddress();
  ASSERT_TRUE(address.ok()) << address.status();
  std::string out;
  ASSERT_EQ(Curl("http://" + *address + "/metrics", "", &out), 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "\nkvq_used_bytes{tier=\"host\"} 0\n")) << out;
}

TEST_F(MetricsTlsTest, RotationServesTheNewCertificateAndSkipsAHalfDoneOne) {
  const std::string live = F("live");
  ASSERT_NO_FATAL_FAILURE(MakeLiveCertFolder(live, F("server.pem"), F("server.key")));
  std::string out;
  ServerProcess server(KVQ_SERVER_BIN);
  server.set_capture_stderr(true);
  ASSERT_TRUE(server
                  .Start({"--metrics_tls_cert=" + live + "/cert.pem",
                          "--metrics_tls_key=" + live + "/key.pem", "--tls_refresh_seconds=1"})
                  .ok());
  absl::StatusOr<std::string> address = server.MetricsAddress();
  ASSERT_TRUE(address.ok()) << address.status();
  const std::string url = "https://" + *address + "/metrics";
  ASSERT_EQ(Curl(url, F("ca.pem"), &out), 0) << out;
  EXPECT_EQ(Curl(url, F("other_ca.pem"), &out), kCurlPeerFailedVerification) << out;

  // Half a rotation: the new key beside the old certificate. The server
  // says so and keeps serving the old pair. Bounds are generous for a
  // loaded machine, not timing assertions.
  ReplaceFile(F("other_server.key"), live + "/key.pem");
  const std::string warning = absl::StrCat(
      "kvq-server: metrics TLS: --metrics_tls_key does not match the certificate of "
      "--metrics_tls_cert; the previous certificate stays in use\n");
  const absl::Time warn_by = absl::Now() + absl::Seconds(60);
  while (absl::Now() < warn_by && !absl::StrContains(server.Stderr(), warning)) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(absl::StrContains(server.Stderr(), warning)) << server.Stderr();
  EXPECT_EQ(Curl(url, F("ca.pem"), &out), 0) << out;

  ReplaceFile(F("other_server.pem"), live + "/cert.pem");
  int code = -1;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (absl::Now() < give_up) {
    code = Curl(url, F("other_ca.pem"), &out);
    if (code == 0) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_EQ(code, 0) << "a new connection never saw the new certificate: " << out;
  EXPECT_TRUE(absl::StrContains(out, "\nkvq_used_bytes{tier=\"host\"} 0\n")) << out;
  EXPECT_EQ(Curl(url, F("ca.pem"), &out), kCurlPeerFailedVerification) << out;
  // The issuer of what the port presents now, as openssl sees it.
  ASSERT_EQ(RunCommand(absl::StrCat("openssl s_client -connect ", *address,
                                    " -CAfile '", F("other_ca.pem"),
                                    "' -verify_return_error </dev/null 2>/dev/null "
                                    "| openssl x509 -noout -issuer"),
                       &out),
            0)
      << out;
  EXPECT_EQ(out, "issuer=CN = kvq other test CA\n");
}

TEST_F(MetricsTlsTest, StartupRefusesBadMetricsTlsFlagsNamingTheFlagAndFile) {
  // Under `timeout`: a server that wrongly starts is killed (exit 124).
  const std::string base = absl::StrCat("timeout 60 ", KVQ_SERVER_BIN,
                                        " --address=127.0.0.1:0 --metrics_address=127.0.0.1:0 "
                                        "--backend=cpu --capacity_bytes=16777216");
  std::string out;
  EXPECT_EQ(RunCommand(base + " --metrics_tls_key=" + F("server.key"), &out), 2);
  EXPECT_EQ(out,
            "kvq-server: --metrics_tls_key is set without --metrics_tls_cert: TLS needs both\n");
  EXPECT_EQ(RunCommand(base + " --metrics_tls_cert=" + F("server.pem"), &out), 2);
  EXPECT_EQ(out,
            "kvq-server: --metrics_tls_cert is set without --metrics_tls_key: TLS needs both\n");
  EXPECT_EQ(RunCommand(base + " --metrics_tls_cert=" + F("server.pem") +
                           " --metrics_tls_key=" + F("client.key"),
                       &out),
            2);
  EXPECT_EQ(out, absl::StrCat("kvq-server: --metrics_tls_key=", F("client.key"),
                              ": does not match the certificate of --metrics_tls_cert=",
                              F("server.pem"), "\n"));
  EXPECT_EQ(RunCommand(base + " --metrics_tls_cert=" + F("missing.pem") +
                           " --metrics_tls_key=" + F("server.key"),
                       &out),
            2);
  EXPECT_EQ(out, absl::StrCat("kvq-server: --metrics_tls_cert=", F("missing.pem"),
                              ": cannot read (No such file or directory)\n"));
  EXPECT_EQ(RunCommand(base + " --metrics_tls_cert=" + F("server.key") +
                           " --metrics_tls_key=" + F("server.key"),
                       &out),
            2);
  EXPECT_EQ(out, absl::StrCat("kvq-server: --metrics_tls_cert=", F("server.key"),
                              ": no PEM certificate (-----BEGIN CERTIFICATE-----) in the file\n"));
  EXPECT_EQ(RunCommand(base + " --metrics_tls_cert=" + F("server.pem") + " --metrics_tls_key=" +
                           F("server.key") + " --tls_refresh_seconds=0",
                       &out),
            2);
  EXPECT_EQ(out, "kvq-server: --tls_refresh_seconds=0: must be in [1, 86400]\n");
  EXPECT_EQ(RunCommand(base + " --metrics_address= --metrics_tls_cert=" + F("server.pem") +
                           " --metrics_tls_key=" + F("server.key"),
                       &out),
            2);
  EXPECT_EQ(out,
            "kvq-server: --metrics_tls_cert is set but --metrics_address is empty: there is no "
            "metrics port\n");
}

}  // namespace
}  // namespace kvq
