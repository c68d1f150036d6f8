// One kvq-server's service over a store the test owns, on a loopback port:
// service tests call it through a real channel and inspect the store
// directly.
#ifndef KVQ_TESTS_SERVICE_LOOPBACK_SERVICE_H_
#define KVQ_TESTS_SERVICE_LOOPBACK_SERVICE_H_

#include <memory>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "service/kvq_service.h"

namespace kvq {

struct LoopbackService {
  LoopbackService(SequenceStore* store, Metrics* metrics, const ServiceOptions& options) {
    service = std::make_unique<KvqService>(store, metrics, options);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    stub = v1::KvCache::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                                    grpc::InsecureChannelCredentials()));
  }
  ~LoopbackService() { server->Shutdown(); }

  std::unique_ptr<KvqService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<v1::KvCache::Stub> stub;
};

}  // namespace kvq

#endif  // KVQ_TESTS_SERVICE_LOOPBACK_SERVICE_H_
