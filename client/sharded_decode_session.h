// ShardedDecodeSession: DecodeStream over several replicas. A step's items
// are split by replica (ShardedKvqClient::ReplicaOf), each part written to
// that replica's stream (opened on first use) and the results merged back
// in the caller's order.
//
// A stream ends at its first failed step (the server's rule), so when a
// replica fails, its items get that error (naming the replica) and its
// stream is dropped; the other replicas' streams go on, and the replica's
// next items open a fresh stream. The *Each forms return every item's
// status; the plain forms return the first failure, after which the other
// replicas' parts of that step have been applied (so use *Each to go on
// with them). Steps may be pipelined (several Writes before the Reads).
// Sequences found off their winner (a replica added since) are not looked
// for: decode through AppendAttend*Each, or recreate them. Not
// thread-safe.
#ifndef KVQ_CLIENT_SHARDED_DECODE_SESSION_H_
#define KVQ_CLIENT_SHARDED_DECODE_SESSION_H_

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/kvq_client.h"
#include "client/sharded_client.h"

namespace kvq {

class ShardedDecodeSession {
 public:
  // `deadline` covers each replica's stream from its opening.
  ShardedDecodeSession(ShardedKvqClient* client, absl::Duration deadline);
  ~ShardedDecodeSession();  // Cancels the streams not closed.
  ShardedDecodeSession(const ShardedDecodeSession&) = delete;
  ShardedDecodeSession& operator=(const ShardedDecodeSession&) = delete;

  // INVALID_ARGUMENT for an empty step; a part that cannot be written fails
  // its items in the matching Read.
  absl::Status Write(int layer, absl::Span<const AppendAttendItem> items,
                     float softmax_scale = 0.0f);
  std::vector<absl::StatusOr<AttendOutput>> ReadEach();
  absl::StatusOr<std::vector<AttendOutput>> Read();
  std::vector<absl::StatusOr<AttendOutput>> StepEach(int layer,
                                                     absl::Span<const AppendAttendItem> items,
                                                     float softmax_scale = 0.0f);
  absl::StatusOr<std::vector<AttendOutput>> Step(int layer,
                                                 absl::Span<const AppendAttendItem> items,
                                                 float softmax_scale = 0.0f);

  // The packed form (DecodeBatch: one row per sequence).
  absl::Status WriteBatch(int layer, const DecodeBatch& batch, float softmax_scale = 0.0f);
  absl::StatusOr<PartialBatchOutput> ReadBatchEach();
  absl::StatusOr<AttendOutput> ReadBatch();
  absl::StatusOr<PartialBatchOutput> StepBatchEach(int layer, const DecodeBatch& batch,
                                                   float softmax_scale = 0.0f);
  absl::StatusOr<AttendOutput> StepBatch(int layer, const DecodeBatch& batch,
                                         float softmax_scale = 0.0f);

  // Closes every stream; the first failure.
  absl::Status Close();

 private:
  struct Part {
    std::string replica;
    std::vector<int> indexes;
    std::shared_ptr<DecodeSession> session;  // Null when the write failed.
    absl::Status status;
  };
  struct Pending {
    bool packed = false;
    int n = 0;
    std::vector<Part> parts;
  };
  // Item indexes per replica, in order of first appearance; ids whose
  // replica cannot be found get a part without a session.
  std::vector<Part> Split(absl::Span<const std::string> ids);
  absl::StatusOr<std::shared_ptr<DecodeSession>> SessionFor(const std::string& replica);
  // Forgets a replica's stream after it failed (a later step opens anew).
  void Drop(const Part& part);
  absl::StatusOr<Pending> Next(bool packed);
  // Writes each part of `pending` that has a replica with write(stream,
  // its item indexes) and queues the step. A part that fails keeps the
  // status (its replica named, its items renumbered to the caller's batch)
  // and its replica's stream is dropped.
  void WriteParts(Pending pending,
                  absl::FunctionRef<absl::Status(DecodeSession&, const std::vector<int>&)> write);
  // Reads each written part of `pending` with read(part), which stores its
  // results; for each item of a part that failed, now or at Write,
  // fail(item index, status) (status as in WriteParts).
  void ReadParts(Pending& pending, absl::FunctionRef<absl::Status(const Part&)> read,
                 absl::FunctionRef<void(int, const absl::Status&)> fail);

  ShardedKvqClient* client_;
  absl::Duration deadline_;
  std::map<std::string, std::shared_ptr<DecodeSession>> sessions_;
  std::deque<Pending> pending_;
};

}  // namespace kvq

#endif  // KVQ_CLIENT_SHARDED_DECODE_SESSION_H_
