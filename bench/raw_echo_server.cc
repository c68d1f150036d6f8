#include "bench/raw_echo_server.h"

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <thread>

#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace kvq {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

class SinkReactor : public grpc::ServerReadReactor<bench::Blob> {
 public:
  explicit SinkReactor(bench::SinkReply* reply) : reply_(reply) { StartRead(&blob_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      reply_->set_bytes(bytes_);
      reply_->set_messages(messages_);
      Finish(grpc::Status::OK);
      return;
    }
    bytes_ += static_cast<int64_t>(blob_.data().size());
    ++messages_;
    StartRead(&blob_);
  }

  void OnDone() override { delete this; }

 private:
  bench::SinkReply* reply_;
  bench::Blob blob_;
  int64_t bytes_ = 0;
  int64_t messages_ = 0;
};

class SourceReactor : public grpc::ServerWriteReactor<bench::Blob> {
 public:
  explicit SourceReactor(const bench::SourceRequest& request)
      : remaining_(request.total_bytes()), chunk_(request.chunk_bytes()) {
    if (chunk_ < 1 || chunk_ > kRawEchoMaxMessageBytes || remaining_ < 0) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "chunk_bytes must be in [1, 64 MiB] and total_bytes >= 0"));
      return;
    }
    blob_.mutable_data()->assign(static_cast<size_t>(chunk_), '\x5a');
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "source stream broken"));
      return;
    }
    Next();
  }

  void OnDone() override { delete this; }

 private:
  void Next() {
    if (remaining_ == 0) {
      Finish(grpc::Status::OK);
      return;
    }
    if (remaining_ < chunk_) blob_.mutable_data()->resize(static_cast<size_t>(remaining_));
    remaining_ -= static_cast<int64_t>(blob_.data().size());
    StartWrite(&blob_);
  }

  int64_t remaining_;
  int64_t chunk_;
  bench::Blob blob_;
};

}  // namespace

grpc::ServerUnaryReactor* RawEchoService::Sink(grpc::CallbackServerContext* ctx,
                                               const bench::Blob* request,
                                               bench::SinkReply* reply) {
  reply->set_bytes(static_cast<int64_t>(request->data().size()));
  reply->set_messages(1);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerReadReactor<bench::Blob>* RawEchoService::SinkStream(grpc::CallbackServerContext*,
                                                                 bench::SinkReply* reply) {
  return new SinkReactor(reply);
}

grpc::ServerWriteReactor<bench::Blob>* RawEchoService::Source(grpc::CallbackServerContext*,
                                                              const bench::SourceRequest* request) {
  return new SourceReactor(*request);
}

grpc::ServerUnaryReactor* RawEchoService::Echo(grpc::CallbackServerContext* ctx,
                                               const bench::EchoRequest* request,
                                               bench::Blob* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (request->reply_bytes() < 0 || request->reply_bytes() > kRawEchoMaxMessageBytes) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "reply_bytes must be in [0, 64 MiB]"));
    return reactor;
  }
  reply->mutable_data()->resize(static_cast<size_t>(request->reply_bytes()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

int RunRawEchoServer(const std::string& port_file) {
  if (port_file.empty()) {
    std::fprintf(stderr, "kvq-bench rpc-echo-server: --echo_port_file is required\n");
    return 2;
  }
  RawEchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  // As kvq-server: twice the message limit at the transport.
  builder.SetMaxReceiveMessageSize(static_cast<int>(2 * kRawEchoMaxMessageBytes));
  builder.SetMaxSendMessageSize(static_cast<int>(2 * kRawEchoMaxMessageBytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "kvq-bench rpc-echo-server: cannot listen on 127.0.0.1\n");
    return 2;
  }
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  {
    // Written whole, then renamed: a reader never sees a partial port.
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    if (std::rename(tmp.c_str(), port_file.c_str()) != 0) {
      std::fprintf(stderr, "kvq-bench rpc-echo-server: cannot write %s\n", port_file.c_str());
      return 2;
    }
  }
  while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server->Wait();
  return 0;
}

}  // namespace kvq
