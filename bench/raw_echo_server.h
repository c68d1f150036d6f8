// The RawEcho service (bench/raw_echo.proto): gRPC with nothing behind it.
// `kvq-bench rpc` runs it in a child process (`kvq-bench rpc-echo-server`)
// built the way kvq-server is built (callback API, default ServerBuilder,
// the same message limits), so that kvq's figures can be read against the
// transport's own at the same message sizes and concurrency.
#ifndef KVQ_BENCH_RAW_ECHO_SERVER_H_
#define KVQ_BENCH_RAW_ECHO_SERVER_H_

#include <cstdint>
#include <string>

#include "bench/raw_echo.grpc.pb.h"

namespace kvq {

// Largest message RawEcho accepts or produces (kvq-server's default
// --max_message_bytes).
inline constexpr int64_t kRawEchoMaxMessageBytes = int64_t{64} << 20;

class RawEchoService final : public bench::RawEcho::CallbackService {
 public:
  // Counts and drops the payload.
  grpc::ServerUnaryReactor* Sink(grpc::CallbackServerContext* ctx, const bench::Blob* request,
                                 bench::SinkReply* reply) override;
  // Counts and drops every message; replies at the client's half-close.
  grpc::ServerReadReactor<bench::Blob>* SinkStream(grpc::CallbackServerContext* ctx,
                                                   bench::SinkReply* reply) override;
  // Streams total_bytes in messages of chunk_bytes (one prebuilt payload,
  // written again and again). INVALID_ARGUMENT for chunk_bytes outside
  // [1, kRawEchoMaxMessageBytes] or a negative total.
  grpc::ServerWriteReactor<bench::Blob>* Source(grpc::CallbackServerContext* ctx,
                                                const bench::SourceRequest* request) override;
  // Replies reply_bytes zero bytes (INVALID_ARGUMENT outside
  // [0, kRawEchoMaxMessageBytes]).
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx,
                                 const bench::EchoRequest* request, bench::Blob* reply) override;
};

// `kvq-bench rpc-echo-server`: serves RawEcho on 127.0.0.1:0, writes the
// port (and a newline) to `port_file`, and runs until SIGTERM or SIGINT.
// Returns the process exit code.
int RunRawEchoServer(const std::string& port_file);

}  // namespace kvq

#endif  // KVQ_BENCH_RAW_ECHO_SERVER_H_
