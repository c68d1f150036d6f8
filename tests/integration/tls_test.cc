// TLS and mutual TLS of the real kvq-server (service/tls_config.h), the
// exposure rule of its listen address (--insecure), and the TLS options of the C++ client and the kvq CLI. Certificates
// come from the openssl tool at test time (make_test_certs.sh).
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "client/tls_credentials.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_helpers.h"
#include "tests/test_certs_fixture.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64;

class TlsTest : public TestCertsFixture {
 protected:
  // A client on its own connection (a local subchannel pool: two clients
  // never share one, so each new client makes a fresh TLS handshake), one
  // attempt per call. Null `files`: plaintext.
  static std::unique_ptr<KvqClient> Client(const std::string& target, const TlsClientFiles* files,
                                           const std::string& server_name = "") {
    ClientOptions options;
    options.target = target;
    options.ns = "tls";
    options.deadline = absl::Seconds(20);
    options.retry.max_attempts = 1;
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    if (!server_name.empty()) args.SetSslTargetNameOverride(server_name);
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (files != nullptr) {
      absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> tls = TlsCredentialsFromFiles(*files);
      EXPECT_TRUE(tls.ok()) << tls.status();
      if (tls.ok()) creds = *tls;
    }
    return std::make_unique<KvqClient>(grpc::CreateCustomChannel(target, creds, args), options);
  }

  static absl::StatusCode InfoCode(KvqClient* client) {
    return client->GetServerInfo().status().code();
  }

  // A sequence with a 100-token prompt, created and filled through `client`.
  static void CreateAndFill(KvqClient* client, const std::string& id) {
    CreateOptions create;
    create.sequence_id = id;
    create.config.layout = {kLayers, kHeads, kQHeads, kDim, {}};
    create.config.scheme = "kivi4:g32:r128";
    ASSERT_TRUE(client->CreateSequence(create).ok());
    const HostTensor k = Random({kLayers, kHeads, 100, kDim}, 1);
    absl::StatusOr<AppendResult> r = client->AppendPrompt(id, k, k);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->num_tokens, 100);
  }

  static std::vector<std::string> TlsFlags() {
    return {"--tls_cert=" + F("server.pem"), "--tls_key=" + F("server.key")};
  }

};

TEST_F(TlsTest, ClientTrustingTheServersCaStoresAndReads) {
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start(TlsFlags()).ok());
  EXPECT_TRUE(absl::StrContains(server.Stdout(), ", TLS)")) << server.Stdout();
  TlsClientFiles files{.ca_file = F("ca.pem")};
  std::unique_ptr<KvqClient> client = Client(server.address(), &files);
  CreateAndFill(client.get(), "s");
  absl::StatusOr<v1::StatsResponse> stats = client->Stats("s");
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->num_tokens(), 100);
}

TEST_F(TlsTest, PlaintextClientAgainstTlsServerIsUnavailable) {
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start(TlsFlags()).ok());
  EXPECT_EQ(InfoCode(Client(server.address(), nullptr).get()), absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, ClientTrustingAnotherCaIsUnavailable) {
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start(TlsFlags()).ok());
  TlsClientFiles other{.ca_file = F("other_ca.pem")};
  EXPECT_EQ(InfoCode(Client(server.address(), &other).get()), absl::StatusCode::kUnavailable);
  TlsClientFiles right{.ca_file = F("ca.pem")};
  EXPECT_EQ(InfoCode(Client(server.address(), &right).get()), absl::StatusCode::kOk);
}

TEST_F(TlsTest, TheServerNameIsCheckedAgainstTheCertificate) {
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start(TlsFlags()).ok());
  TlsClientFiles files{.ca_file = F("ca.pem")};
  // The certificate names localhost and 127.0.0.1, not kvq.invalid.
  EXPECT_EQ(InfoCode(Client(server.address(), &files, "kvq.invalid").get()),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(InfoCode(Client(server.address(), &files, "localhost").get()), absl::StatusCode::kOk);
  // The override through ClientOptions, as KvqClient::Connect applies it.
  ClientOptions options;
  options.target = server.address();
  options.retry.max_attempts = 1;
  options.credentials = *TlsCredentialsFromFiles(files);
  options.tls_server_name = "kvq.invalid";
  absl::StatusOr<std::unique_ptr<KvqClient>> c = KvqClient::Connect(options);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(InfoCode(c->get()), absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, MutualTlsAdmitsOnlyClientsWithACertificateOfTheClientCa) {
  ServerProcess server(KVQ_SERVER_BIN);
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_client_ca=" + F("ca.pem"));
  ASSERT_TRUE(server.Start(flags).ok());
  EXPECT_TRUE(absl::StrContains(server.Stdout(), ", mutual TLS)")) << server.Stdout();
  TlsClientFiles no_cert{.ca_file = F("ca.pem")};
  EXPECT_EQ(InfoCode(Client(server.address(), &no_cert).get()), absl::StatusCode::kUnavailable);
  TlsClientFiles other_ca_cert{.ca_file = F("ca.pem"), .cert_file = F("other_client.pem"),
                               .key_file = F("other_client.key")};
  EXPECT_EQ(InfoCode(Client(server.address(), &other_ca_cert).get()),
            absl::StatusCode::kUnavailable);
  TlsClientFiles right{.ca_file = F("ca.pem"), .cert_file = F("client.pem"),
                       .key_file = F("client.key")};
  std::unique_ptr<KvqClient> client = Client(server.address(), &right);
  CreateAndFill(client.get(), "m");
  absl::StatusOr<v1::StatsResponse> stats = client->Stats("m");
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->num_tokens(), 100);
}

TEST_F(TlsTest, RotatedCertificateServesNewConnectionsAndKeepsOpenStreams) {
  const std::string live = F("live");
  ASSERT_NO_FATAL_FAILURE(MakeLiveCertFolder(live, F("server.pem"), F("server.key")));
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server
                  .Start({"--tls_cert=" + live + "/cert.pem", "--tls_key=" + live + "/key.pem",
                          "--tls_refresh_seconds=1"})
                  .ok());
  TlsClientFiles old_ca{.ca_file = F("ca.pem")};
  TlsClientFiles new_ca{.ca_file = F("other_ca.pem")};
  std::unique_ptr<KvqClient> client = Client(server.address(), &old_ca);
  CreateAndFill(client.get(), "r");
  absl::StatusOr<std::unique_ptr<DecodeSession>> session = client->OpenDecodeSession();
  ASSERT_TRUE(session.ok()) << session.status();
  auto step = [&](int i) {
    for (int layer = 0; layer < kLayers; ++layer) {
      AppendAttendItem item{"r", Random({kHeads, 1, kDim}, 10 + i), Random({kHeads, 1, kDim}, 20 + i),
                            Random({1, kQHeads, kDim}, 30 + i)};
      absl::StatusOr<std::vector<AttendOutput>> r = (*session)->Step(layer, {item});
      ASSERT_TRUE(r.ok()) << "step " << i << " layer " << layer << ": " << r.status();
    }
  };
  step(0);
  EXPECT_EQ(InfoCode(Client(server.address(), &new_ca).get()), absl::StatusCode::kUnavailable);

  ReplaceFile(F("other_server.key"), live + "/key.pem");
  ReplaceFile(F("other_server.pem"), live + "/cert.pem");
  // The server re-reads the files every second; a generous bound for a
  // loaded machine, not a timing assertion.
  absl::StatusCode code = absl::StatusCode::kUnknown;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (absl::Now() < give_up) {
    code = InfoCode(Client(server.address(), &new_ca).get());
    if (code == absl::StatusCode::kOk) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_EQ(code, absl::StatusCode::kOk) << "a new connection never saw the new certificate";
  EXPECT_EQ(InfoCode(Client(server.address(), &old_ca).get()), absl::StatusCode::kUnavailable);

  // The stream opened before the rotation goes on, and so does the old
  // client's connection.
  step(1);
  EXPECT_TRUE((*session)->Close().ok());
  absl::StatusOr<v1::StatsResponse> stats = client->Stats("r");
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->num_tokens(), 102);
}

TEST_F(TlsTest, StartupRefusesBadTlsFlagsNamingTheFlag) {
  // Under `timeout`: a server that wrongly starts is killed (exit 124)
  // instead of hanging the test.
  const std::string base = absl::StrCat("timeout 60 ", KVQ_SERVER_BIN,
                                        " --address=127.0.0.1:0 --metrics_address= --backend=cpu "
                                        "--capacity_bytes=16777216");
  std::string out;
  EXPECT_EQ(RunCommand(base + " --tls_key=" + F("server.key"), &out), 2);
  EXPECT_EQ(out, "kvq-server: --tls_key is set without --tls_cert: TLS needs both\n");
  EXPECT_EQ(RunCommand(base + " --tls_cert=" + F("server.pem") + " --tls_key=" + F("client.key"),
                       &out),
            2);
  EXPECT_EQ(out, absl::StrCat("kvq-server: --tls_key=", F("client.key"),
                              ": does not match the certificate of --tls_cert=", F("server.pem"),
                              "\n"));
}

TEST_F(TlsTest, NetworkAddressWithoutTlsNeedsInsecure) {
  std::string out;
  EXPECT_EQ(RunCommand(absl::StrCat("timeout 60 ", KVQ_SERVER_BIN,
                                    " --address=0.0.0.0:0 --metrics_address= --backend=cpu "
                                    "--capacity_bytes=16777216"),
                       &out),
            2);
  EXPECT_EQ(out,
            "kvq-server: --address=0.0.0.0:0 is reachable from the network in plaintext: set "
            "--tls_cert and --tls_key (and --tokens_file or --tls_client_ca), or pass --insecure "
            "to serve it anyway\n");

  // With --insecure it starts, warns, and serves (the test's traffic stays
  // on loopback).
  ServerProcess server(KVQ_SERVER_BIN);
  server.set_capture_stderr(true);
  ASSERT_TRUE(server.Start({"--address=0.0.0.0:0", "--insecure"}).ok());
  EXPECT_TRUE(absl::StrContains(
      server.Stderr(),
      "kvq-server: WARNING: --insecure: serving 0.0.0.0:0 in plaintext without tokens; anyone "
      "who can reach it can read and change every sequence\n"))
      << server.Stderr();
  EXPECT_EQ(InfoCode(Client(server.address(), nullptr).get()), absl::StatusCode::kOk);
}

TEST_F(TlsTest, NetworkAddressWithTlsAlonePassesOnlyWithInsecure) {
  std::string out;
  EXPECT_EQ(RunCommand(absl::StrCat("timeout 60 ", KVQ_SERVER_BIN,
                                    " --address=0.0.0.0:0 --metrics_address= --backend=cpu "
                                    "--capacity_bytes=16777216 --tls_cert=",
                                    F("server.pem"), " --tls_key=", F("server.key")),
                       &out),
            2);
  EXPECT_EQ(out,
            "kvq-server: --address=0.0.0.0:0 is reachable from the network without "
            "authenticating callers: set --tokens_file or --tls_client_ca, or pass --insecure "
            "to serve it anyway\n");
}

TEST_F(TlsTest, NetworkAddressWithMutualTlsStartsWithoutInsecureOrWarning) {
  ServerProcess server(KVQ_SERVER_BIN);
  server.set_capture_stderr(true);
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_client_ca=" + F("ca.pem"));
  flags.push_back("--address=0.0.0.0:0");
  ASSERT_TRUE(server.Start(flags).ok());
  TlsClientFiles files{
      .ca_file = F("ca.pem"), .cert_file = F("client.pem"), .key_file = F("client.key")};
  EXPECT_EQ(InfoCode(Client(server.address(), &files).get()), absl::StatusCode::kOk);
  EXPECT_FALSE(absl::StrContains(server.Stderr(), "WARNING")) << server.Stderr();
}

TEST_F(TlsTest, CliTakesTheTlsFlags) {
  ServerProcess server(KVQ_SERVER_BIN);
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_client_ca=" + F("ca.pem"));
  ASSERT_TRUE(server.Start(flags).ok());
  const std::string cli =
      absl::StrCat(KVQ_CLI_BIN, " --server=", server.address(), " --retries=0 --deadline_ms=20000");
  std::string out;
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " --tls_ca=", F("ca.pem"), " --tls_cert=",
                                    F("client.pem"), " --tls_key=", F("client.key"),
                                    " --tls_server_name=localhost info"),
                       &out),
            0)
      << out;
  EXPECT_TRUE(absl::StrContains(out, "cpu")) << out;
  // No client certificate: the handshake is refused (exit 1, an RPC error).
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " --tls_ca=", F("ca.pem"), " info"), &out), 1) << out;
  EXPECT_TRUE(absl::StrContains(out, "UNAVAILABLE")) << out;
  // Bad flags: usage errors naming the flag (exit 2).
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " --tls_cert=", F("client.pem"), " info"), &out), 2);
  EXPECT_EQ(out, "kvq info: INVALID_ARGUMENT: --tls_cert is set without tls_key: a client "
                 "certificate needs both\n");
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " --tls_ca=", F("missing.pem"), " info"), &out), 2);
  EXPECT_EQ(out, absl::StrCat("kvq info: INVALID_ARGUMENT: --tls_ca=", F("missing.pem"),
                              ": cannot read (No such file or directory)\n"));
  EXPECT_EQ(RunCommand(absl::StrCat(cli, " --tls_server_name=localhost info"), &out), 2);
  EXPECT_EQ(out, "kvq info: INVALID_ARGUMENT: --tls_server_name is set without --tls_ca, "
                 "--tls_cert or --tls_key: the connection would be plaintext\n");
}

}  // namespace
}  // namespace kvq
