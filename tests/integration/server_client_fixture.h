#ifndef KVQ_TESTS_INTEGRATION_SERVER_CLIENT_FIXTURE_H_
#define KVQ_TESTS_INTEGRATION_SERVER_CLIENT_FIXTURE_H_

// A fixture with one real kvq-server (KVQ_SERVER_BIN, a compile definition
// of the test), a client of it in one namespace, and a raw stub for the
// requests the client would refuse to send.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/kvq_client.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "tests/integration/server_process.h"

namespace kvq {

class ServerClientFixture : public ::testing::Test {
 protected:
  // Starts a server with `flags` and connects a client in namespace `ns`
  // whose calls each get `deadline` (ClientOptions' default).
  void StartServer(const std::vector<std::string>& flags, const std::string& ns,
                   absl::Duration deadline = absl::Seconds(30)) {
    server_ = std::make_unique<ServerProcess>(KVQ_SERVER_BIN);
    absl::Status st = server_->Start(flags);
    ASSERT_TRUE(st.ok()) << st;
    ns_ = ns;
    ClientOptions options;
    options.target = server_->address();
    options.ns = ns;
    options.deadline = deadline;
    absl::StatusOr<std::unique_ptr<KvqClient>> c = KvqClient::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    stub_ = v1::KvCache::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<KvqClient> client_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  std::string ns_;
};

}  // namespace kvq

#endif  // KVQ_TESTS_INTEGRATION_SERVER_CLIENT_FIXTURE_H_
