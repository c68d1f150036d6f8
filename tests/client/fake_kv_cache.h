// FakeKvCache: an in-process stand-in for the kvq service, for client tests
// that need no server. Sequences are LocalSequence objects (the same kernels
// the server uses); tests can make the next calls of a method fail, hang
// until cancelled, or lose a Release reply. Raw fetches follow the service's
// rules: quantized tokens only, from a page boundary, whole pages per
// message.
#ifndef KVQ_TESTS_CLIENT_FAKE_KV_CACHE_H_
#define KVQ_TESTS_CLIENT_FAKE_KV_CACHE_H_

#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/local_sequence.h"
#include "client/sequence_config.h"
#include "kvq/v1/kvq.grpc.pb.h"

namespace kvq {
namespace testing_fake {

class FakeKvCache final : public v1::KvCache::Service {
 public:
  // The next `n` calls of `method` (e.g. "Stats") fail with `status` first.
  void FailNext(const std::string& method, int n, grpc::Status status);
  // The next `n` calls of `method` wait until the client gives up.
  void HangNext(const std::string& method, int n);
  // The next Release releases the sequence, then reports UNAVAILABLE.
  void LoseNextReleaseReply();

  int calls(const std::string& method) const;
  // Time left until the deadline of the last call of `method`, as the
  // server saw it when the call arrived.
  absl::Duration last_deadline_left(const std::string& method) const;
  int append_messages() const;
  // Tokens of a stored sequence; -1 when there is none.
  int num_tokens(const std::string& ns, const std::string& id) const;
  // Reads a stored sequence (fp32, keys as attention sees them).
  absl::StatusOr<FetchedKv> Read(const std::string& ns, const std::string& id) const;

  grpc::Status GetServerInfo(grpc::ServerContext* context, const v1::GetServerInfoRequest* request,
                             v1::ServerInfo* response) override;
  grpc::Status CreateSequence(grpc::ServerContext* context,
                              const v1::CreateSequenceRequest* request,
                              v1::CreateSequenceResponse* response) override;
  grpc::Status Append(grpc::ServerContext* context, grpc::ServerReader<v1::AppendRequest>* reader,
                      v1::AppendResponse* response) override;
  grpc::Status FetchDequant(grpc::ServerContext* context, const v1::FetchRequest* request,
                            grpc::ServerWriter<v1::FetchResponse>* writer) override;
  grpc::Status Attend(grpc::ServerContext* context, const v1::AttendRequest* request,
                      v1::AttendResponse* response) override;
  grpc::Status AppendAttend(grpc::ServerContext* context, const v1::AppendAttendRequest* request,
                            v1::AttendResponse* response) override;
  grpc::Status DecodeStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) override;
  grpc::Status Fork(grpc::ServerContext* context, const v1::ForkRequest* request,
                    v1::ForkResponse* response) override;
  grpc::Status Release(grpc::ServerContext* context, const v1::ReleaseRequest* request,
                       v1::ReleaseResponse* response) override;
  grpc::Status Stats(grpc::ServerContext* context, const v1::StatsRequest* request,
                     v1::StatsResponse* response) override;

 private:
  struct Stored {
    SequenceConfig config;
    std::unique_ptr<LocalSequence> local;
  };
  // Counts the call and applies injected behaviour; a non-OK status ends
  // the call with it.
  grpc::Status Enter(const std::string& method, grpc::ServerContext* context);
  static std::string Key(const v1::SequenceRef& ref) { return ref.namespace_() + "/" + ref.sequence_id(); }

  mutable absl::Mutex mu_;
  std::map<std::string, int> calls_;
  std::map<std::string, absl::Duration> deadline_left_;
  std::map<std::string, std::pair<int, grpc::Status>> failures_;
  std::map<std::string, int> hangs_;
  bool lose_release_reply_ = false;
  int append_messages_ = 0;
  int next_id_ = 0;
  std::map<std::string, Stored> sequences_;
};

}  // namespace testing_fake
}  // namespace kvq

#endif  // KVQ_TESTS_CLIENT_FAKE_KV_CACHE_H_
