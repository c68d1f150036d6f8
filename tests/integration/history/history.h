// A history of concurrent calls on kvq sequences: for every call, who made
// it, when it was invoked and answered (one steady clock), what it asked and
// what came back, with read payloads attributed to the appends that wrote
// them (payload.h). The recorder is thread-safe; the checker (checker.h)
// reads the finished history.
#ifndef KVQ_TESTS_INTEGRATION_HISTORY_HISTORY_H_
#define KVQ_TESTS_INTEGRATION_HISTORY_HISTORY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "tests/integration/history/payload.h"

namespace kvq::history {

enum class OpKind {
  kCreate,        // seq: the id created.
  kAppend,        // A streamed, chunked Append of `tokens` tokens.
  kAppendAttend,  // One token appended, attention of its query.
  kDecodeStep,    // The same as one step of a DecodeStream.
  kFork,          // seq: the source, fork_id: the new sequence.
  kRelease,
  kFetch,         // FetchDequant of every token (fp16).
  kAttend,        // Attention over keys [0, key_end) after fetch `read_op`.
  kStats,
};
const char* KindName(OpKind kind);

// What a call's answer says about its effect.
enum class Outcome {
  kPending,        // Not answered (yet).
  kOk,
  kFailed,         // Refused or failed before committing: no effect allowed.
  kIndeterminate,  // May or may not have taken effect (deadline after the
                   // request was complete, a lost connection).
};

struct Op {
  int64_t id = 0;  // Also the payload tag of an append's tokens.
  int thread = 0;
  OpKind kind = OpKind::kStats;
  std::string seq;
  std::string fork_id;
  int64_t invoked_ns = 0;
  int64_t answered_ns = 0;
  Outcome outcome = Outcome::kPending;
  int code = -1;  // grpc::StatusCode of the answer.
  std::string message;

  int tokens = 0;       // Appends: tokens sent.
  int answered_tokens = -1;  // AppendResponse / ForkResponse num_tokens.
  // kFetch: every token returned, attributed; nullopt for bytes that are no
  // append's rows. digest: FNV-1a of the returned K and V bytes.
  std::vector<std::optional<TokenRef>> read;
  uint64_t digest = 0;
  // kAttend / kAppendAttend / kDecodeStep: the query [q_heads, head_dim]
  // and the answer [q_heads, head_dim]; kAttend's keys are [0, key_end) of
  // the tokens fetch `read_op` (same client, just before) returned.
  std::vector<float> q;
  std::vector<float> out;
  int key_end = 0;
  int64_t read_op = -1;
  int64_t used_bytes = -1;  // kStats.
};

class History {
 public:
  // Registers a call about to be made (its id is the next op id) and
  // returns the id; the clock starts now.
  int64_t Invoke(Op op);
  // Records the answer of call `id`: `fill` completes the record.
  template <typename F>
  void Answer(int64_t id, Outcome outcome, int code, std::string message, F fill) {
    const int64_t now = NowNs();
    absl::MutexLock lock(&mu_);
    Op& op = ops_[id];
    op.answered_ns = now;
    op.outcome = outcome;
    op.code = code;
    op.message = std::move(message);
    fill(op);
  }
  void Answer(int64_t id, Outcome outcome, int code, std::string message) {
    Answer(id, outcome, code, std::move(message), [](Op&) {});
  }

  // Pool bytes in use before the first call and after the last Release.
  void set_baseline_used_bytes(int64_t b) { baseline_used_bytes_ = b; }
  void set_final_used_bytes(int64_t b) { final_used_bytes_ = b; }
  int64_t baseline_used_bytes() const { return baseline_used_bytes_; }
  int64_t final_used_bytes() const { return final_used_bytes_; }

  // The calls, indexed by id (call when every client has stopped).
  const std::vector<Op>& ops() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return ops_; }
  // For synthetic histories (the checker's tests): takes `op` as it is,
  // id = its index; mutable_op edits one added.
  void Add(Op op);
  Op& mutable_op(int64_t id) ABSL_NO_THREAD_SAFETY_ANALYSIS { return ops_[id]; }

  static int64_t NowNs();

 private:
  absl::Mutex mu_;
  std::vector<Op> ops_ ABSL_GUARDED_BY(mu_);
  int64_t baseline_used_bytes_ = -1;
  int64_t final_used_bytes_ = -1;
};

}  // namespace kvq::history

#endif  // KVQ_TESTS_INTEGRATION_HISTORY_HISTORY_H_
