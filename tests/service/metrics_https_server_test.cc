// MetricsHttpsServer in-process (service/metrics_https_server.h): listens
// on IPv4 and IPv6 loopback, serves what the scrape function returns (read
// with curl), refuses a second instance and an address it cannot bind.
// The real server's flags and rotation: tests/integration/metrics_tls_test.cc.
#include "service/metrics_https_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_certs_fixture.h"

namespace kvq {
namespace {

// stdout of `command` (stderr joined); -1 when it did not exit normally.
int RunShell(const std::string& command, std::string* out) {
  out->clear();
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out->append(buf.data(), n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class MetricsHttpsServerTest : public TestCertsFixture {
 protected:
  static MetricsTlsOptions Options() {
    MetricsTlsOptions o;
    o.cert_file = F("server.pem");
    o.key_file = F("server.key");
    return o;
  }
};

TEST_F(MetricsHttpsServerTest, ServesTheScrapeOnIpv4AndIpv6Loopback) {
  for (const char* bind : {"127.0.0.1:0", "[::1]:0"}) {
    SCOPED_TRACE(bind);
    ASSERT_TRUE(ValidateMetricsTlsOptions(Options(), bind).ok());
    absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> server =
        MetricsHttpsServer::Start(bind, Options(), [] { return std::string("kvq_test 1\n"); });
    if (!server.ok() && std::string(bind) == "[::1]:0" &&
        server.status().code() == absl::StatusCode::kUnavailable) {
      continue;  // No IPv6 loopback on this machine.
    }
    ASSERT_TRUE(server.ok()) << server.status();
    ASSERT_GT((*server)->port(), 0);
    const std::string host = std::string(bind) == "[::1]:0" ? "[::1]" : "127.0.0.1";
    std::string out;
    ASSERT_EQ(RunShell(absl::StrCat("curl -sS --max-time 20 --cacert '", F("ca.pem"), "' https://",
                               host, ":", (*server)->port(), "/metrics"),
                  &out),
              0)
        << out;
    EXPECT_EQ(out, "kvq_test 1\n");
    ASSERT_EQ(RunShell(absl::StrCat("curl -sS --max-time 20 -X POST -o /dev/null -w '%{http_code}' "
                               "--cacert '", F("ca.pem"), "' https://", host, ":",
                               (*server)->port(), "/metrics"),
                  &out),
              0);
    EXPECT_EQ(out, "405");
  }
}

TEST_F(MetricsHttpsServerTest, OneAtATimeAndTheAddressMustBind) {
  auto scrape = [] { return std::string(); };
  absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> first =
      MetricsHttpsServer::Start("127.0.0.1:0", Options(), scrape);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> second =
      MetricsHttpsServer::Start("127.0.0.1:0", Options(), scrape);
  EXPECT_EQ(second.status(),
            absl::FailedPreconditionError("metrics: an HTTPS metrics server already runs"));
  first->reset();
  // A port another socket listens on: UNAVAILABLE naming the address, and
  // the failed start leaves the slot free for the next one.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string busy = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> refused =
      MetricsHttpsServer::Start(busy, Options(), scrape);
  close(fd);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StartsWith(refused.status().message(),
                               absl::StrCat("metrics: cannot listen on ", busy, " (HTTPS): ")))
      << refused.status();
  absl::StatusOr<std::unique_ptr<MetricsHttpsServer>> again =
      MetricsHttpsServer::Start("127.0.0.1:0", Options(), scrape);
  EXPECT_TRUE(again.ok()) << again.status();
  again->reset();
  EXPECT_EQ(MetricsHttpsServer::Start("no-port", Options(), scrape).status(),
            absl::InvalidArgumentError("metrics: no-port is not host:port"));
  EXPECT_EQ(ValidateMetricsTlsOptions(Options(), "").message(),
            "--metrics_tls_cert is set but --metrics_address is empty: there is no metrics port");
  EXPECT_TRUE(ValidateMetricsTlsOptions(MetricsTlsOptions{}, "").ok());
}

}  // namespace
}  // namespace kvq
