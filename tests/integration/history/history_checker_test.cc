// The checker over synthetic histories: a valid history passes, and each
// kind of anomaly, the data loss of issue 42 among them, is flagged.
#include "tests/integration/history/checker.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvq::history {
namespace {

// Builds a history with explicit times (ns), op ids in call order.
class Builder {
 public:
  int64_t Call(OpKind kind, const std::string& seq, int64_t invoked, int64_t answered,
               Outcome outcome = Outcome::kOk) {
    Op op;
    op.kind = kind;
    op.seq = seq;
    op.invoked_ns = invoked;
    op.answered_ns = answered;
    op.outcome = outcome;
    op.code = outcome == Outcome::kOk ? 0 : 10;  // ABORTED when refused.
    h_.Add(std::move(op));
    return static_cast<int64_t>(h_.ops().size()) - 1;
  }
  int64_t Create(const std::string& seq, int64_t invoked, int64_t answered) {
    return Call(OpKind::kCreate, seq, invoked, answered);
  }
  int64_t Append(const std::string& seq, int tokens, int64_t invoked, int64_t answered,
                 Outcome outcome = Outcome::kOk) {
    const int64_t id = Call(OpKind::kAppend, seq, invoked, answered, outcome);
    op(id).tokens = tokens;
    op(id).answered_tokens = outcome == Outcome::kOk ? 1000 : -1;
    return id;
  }
  int64_t Fork(const std::string& from, const std::string& to, int tokens, int64_t invoked,
               int64_t answered) {
    const int64_t id = Call(OpKind::kFork, from, invoked, answered);
    op(id).fork_id = to;
    op(id).answered_tokens = tokens;
    return id;
  }
  // A fetch of `seq` returning the whole appends `ops`, in order.
  int64_t Read(const std::string& seq, const std::vector<int64_t>& appends, int64_t invoked,
               int64_t answered) {
    const int64_t id = Call(OpKind::kFetch, seq, invoked, answered);
    for (int64_t a : appends) {
      for (int i = 0; i < op(a).tokens; ++i) op(id).read.push_back(TokenRef{a, i});
    }
    return id;
  }
  Op& op(int64_t id) { return h_.mutable_op(id); }
  History& history() { return h_; }

 private:
  History h_;
};

bool Flags(const CheckReport& r, AnomalyKind kind) {
  for (const Anomaly& a : r.anomalies) {
    if (a.kind == kind) return true;
  }
  return false;
}

std::string Describe(const CheckReport& r) {
  std::string s;
  for (const Anomaly& a : r.anomalies) {
    s += std::string(AnomalyName(a.kind)) + ": " + a.detail + "\n";
  }
  return s;
}

TEST(HistoryCheckerTest, AConcurrentValidHistoryHasNoAnomalies) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t a = b.Append("s", 3, 20, 30);
  const int64_t slow = b.Append("s", 2, 25, 200, Outcome::kIndeterminate);
  b.Append("s", 4, 40, 50, Outcome::kFailed);  // Refused: never visible.
  b.Read("s", {a}, 60, 70);                    // slow not yet in.
  b.Fork("s", "f", 3, 80, 90);
  const int64_t late = b.Read("s", {a, slow}, 210, 220);
  b.Read("f", {a}, 230, 240);
  const int64_t after = b.Append("f", 1, 250, 260);
  b.Read("f", {a, after}, 270, 280);
  const int64_t att = b.Call(OpKind::kAttend, "s", 300, 310);
  b.op(att).read_op = late;
  b.op(att).key_end = 4;
  b.op(att).q = Query(att);
  std::vector<TokenRef> keys = {{a, 0}, {a, 1}, {a, 2}, {slow, 0}};
  b.op(att).out = ReferenceAttention(b.op(att).q, keys);
  b.history().set_baseline_used_bytes(4096);
  b.history().set_final_used_bytes(4096);
  const CheckReport r = Check(b.history());
  EXPECT_TRUE(r.anomalies.empty()) << Describe(r);
  EXPECT_EQ(r.reads_checked, 4);
  EXPECT_EQ(r.attention_checked, 1);
}

// Issue 42: A's stream (40 tokens) is answered OK with num_tokens = 0 after
// B was refused, and a later read holds nothing.
TEST(HistoryCheckerTest, FlagsTheAcknowledgedAppendThatWasRolledBack) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t a = b.Append("s", 40, 20, 100);
  b.op(a).answered_tokens = 0;
  b.Append("s", 20, 30, 40, Outcome::kFailed);
  b.Read("s", {}, 110, 120);
  const CheckReport r = Check(b.history());
  EXPECT_TRUE(Flags(r, AnomalyKind::kLostAppend)) << Describe(r);
  EXPECT_TRUE(Flags(r, AnomalyKind::kAckCount)) << Describe(r);
}

TEST(HistoryCheckerTest, FlagsAFailedAppendThatLeftATrace) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t refused = b.Append("s", 5, 20, 30, Outcome::kFailed);
  b.Read("s", {refused}, 40, 50);
  EXPECT_TRUE(Flags(Check(b.history()), AnomalyKind::kFailedVisible));
}

TEST(HistoryCheckerTest, FlagsHalfAnAppend) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t a = b.Append("s", 40, 20, 30);
  const int64_t r = b.Read("s", {a}, 40, 50);
  b.op(r).read.resize(20);
  EXPECT_TRUE(Flags(Check(b.history()), AnomalyKind::kTornAppend));
}

TEST(HistoryCheckerTest, FlagsTokensNoAppendWroteInTime) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t r = b.Read("s", {}, 20, 30);
  const int64_t later = b.Append("s", 2, 40, 50);
  b.op(r).read = {TokenRef{later, 0}, TokenRef{later, 1}};
  EXPECT_TRUE(Flags(Check(b.history()), AnomalyKind::kPhantomToken));

  Builder c;
  c.Create("s", 0, 10);
  const int64_t bad = c.Read("s", {}, 20, 30);
  c.op(bad).read = {std::nullopt};  // Bytes that are no append's rows.
  EXPECT_TRUE(Flags(Check(c.history()), AnomalyKind::kPhantomToken));
}

TEST(HistoryCheckerTest, FlagsTokensFromBeforeTheSequenceWasCreatedAgain) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t a = b.Append("s", 2, 20, 30);
  b.Call(OpKind::kRelease, "s", 40, 50);
  b.Create("s", 60, 70);
  b.Read("s", {a}, 80, 90);
  EXPECT_TRUE(Flags(Check(b.history()), AnomalyKind::kStaleToken));
}

TEST(HistoryCheckerTest, FlagsAppendsAgainstRealTimeOrder) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t first = b.Append("s", 1, 20, 30);
  const int64_t second = b.Append("s", 1, 40, 50);
  b.Read("s", {second, first}, 60, 70);
  EXPECT_TRUE(Flags(Check(b.history()), AnomalyKind::kOrder));
}

TEST(HistoryCheckerTest, FlagsAForkThatIsNotItsParentAtTheFork) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t a = b.Append("s", 2, 20, 30);
  const int64_t later = b.Append("s", 2, 100, 110);
  b.Fork("s", "f", 4, 40, 50);  // Counted 4, the parent held 2 then.
  b.Read("f", {a, later}, 120, 130);
  EXPECT_TRUE(Flags(Check(b.history()), AnomalyKind::kForkMismatch));
}

TEST(HistoryCheckerTest, FlagsAttentionUnlikeTheFetchedKv) {
  Builder b;
  b.Create("s", 0, 10);
  const int64_t a = b.Append("s", 3, 20, 30);
  const int64_t r = b.Read("s", {a}, 40, 50);
  const int64_t att = b.Call(OpKind::kAttend, "s", 60, 70);
  b.op(att).read_op = r;
  b.op(att).key_end = 3;
  b.op(att).q = Query(att);
  // Attention over 2 of the 3 keys: what a stale or torn read would give.
  b.op(att).out = ReferenceAttention(b.op(att).q, {{a, 0}, {a, 1}});
  EXPECT_TRUE(Flags(Check(b.history()), AnomalyKind::kAttention));

  // An AppendAttend answer placed by a read holding its token.
  Builder c;
  c.Create("s", 0, 10);
  const int64_t pre = c.Append("s", 2, 20, 30);
  const int64_t step = c.Call(OpKind::kAppendAttend, "s", 40, 50);
  c.op(step).tokens = 1;
  c.op(step).q = Query(step);
  c.op(step).out = ReferenceAttention(c.op(step).q, {{step, 0}});  // Missed the prefix.
  c.Read("s", {pre, step}, 60, 70);
  EXPECT_TRUE(Flags(Check(c.history()), AnomalyKind::kAttention));
}

TEST(HistoryCheckerTest, FlagsPoolBytesNotReturned) {
  Builder b;
  b.history().set_baseline_used_bytes(0);
  b.history().set_final_used_bytes(65536);
  EXPECT_TRUE(Flags(Check(b.history()), AnomalyKind::kPoolLeak));
}

}  // namespace
}  // namespace kvq::history
