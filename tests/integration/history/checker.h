// The checker of a finished History (history.h): per sequence, what every
// read returned must be a state the sequence could have had at some point
// while the read was in flight, given what every other call was answered.
//
// A read (FetchDequant) of sequence S, answered OK, is explained by one call
// that created S (CreateSequence, or a Fork into S) that may precede it:
// - a fork's first tokens are exactly its parent's state at the fork (the
//   same rules, over the fork's interval), as many as ForkResponse counted;
// - after them, the tokens are whole appends on S, each at most once, in
//   an order that does not contradict real time (an append acknowledged
//   before another was invoked comes first);
// - each was acknowledged or is indeterminate (never a failed, refused or
//   cancelled one), was invoked before the read was answered, and had not
//   ended before S was created;
// - every append on S acknowledged before the read was invoked, and invoked
//   after the creation was answered, is there, unless another creation of S
//   may fall between them.
// Attention answers must match attention computed here over the K/V a
// fetch returned (Attend: the client's fetch just before; AppendAttend /
// DecodeStream step: any read holding the appended token, over the tokens
// up to it). An acknowledged Append must count its own tokens; the pool's
// bytes must return to the baseline.
#ifndef KVQ_TESTS_INTEGRATION_HISTORY_CHECKER_H_
#define KVQ_TESTS_INTEGRATION_HISTORY_CHECKER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tests/integration/history/history.h"

namespace kvq::history {

enum class AnomalyKind {
  kLostAppend,      // An acknowledged append missing from a later read.
  kFailedVisible,   // Tokens of a failed, refused or cancelled append.
  kTornAppend,      // Part of an append, or one append twice.
  kPhantomToken,    // Tokens no append on the sequence (begun in time) wrote.
  kStaleToken,      // Tokens of an append that ended before the sequence's creation.
  kOrder,           // Two appends against their real-time order.
  kForkMismatch,    // A fork's tokens are not its parent's state at the fork.
  kAckCount,        // An acknowledged Append that does not count its own tokens.
  kAttention,       // Attention unlike the reference over the fetched K/V.
  kPoolLeak,        // Pool bytes not back to the baseline at the end.
};
const char* AnomalyName(AnomalyKind kind);

struct Anomaly {
  AnomalyKind kind;
  int64_t op = -1;  // The call that showed it.
  std::string detail;
};

struct CheckReport {
  std::vector<Anomaly> anomalies;
  int64_t reads_checked = 0;
  int64_t attention_checked = 0;
  // AppendAttend / DecodeStream answers no checked read could place.
  int64_t attention_unplaced = 0;
};

CheckReport Check(const History& history);

// Attention of `q` [q_heads, head_dim] over `keys` (their K/V from
// payload.h), softmax scale 1/sqrt(head_dim): out [q_heads, head_dim].
std::vector<float> ReferenceAttention(const std::vector<float>& q,
                                      const std::vector<TokenRef>& keys);

}  // namespace kvq::history

#endif  // KVQ_TESTS_INTEGRATION_HISTORY_CHECKER_H_
