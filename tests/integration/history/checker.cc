#include "tests/integration/history/checker.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "kernels/numeric.h"

namespace kvq::history {
namespace {

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
constexpr int kMaxForkDepth = 16;

bool IsAppend(OpKind k) {
  return k == OpKind::kAppend || k == OpKind::kAppendAttend || k == OpKind::kDecodeStep;
}
bool MayHaveHappened(const Op& op) {
  return op.outcome == Outcome::kOk || op.outcome == Outcome::kIndeterminate ||
         op.outcome == Outcome::kPending;
}
// When the call was answered; never, for one still pending.
int64_t Answered(const Op& op) {
  return op.outcome == Outcome::kPending ? kNever : op.answered_ns;
}

struct Failure {
  AnomalyKind kind;
  std::string detail;
};

class Checker {
 public:
  explicit Checker(const History& h) : ops_(h.ops()) {
    for (const Op& op : ops_) {
      if (!MayHaveHappened(op)) continue;
      if (op.kind == OpKind::kCreate) creators_[op.seq].push_back(&op);
      if (op.kind == OpKind::kFork) creators_[op.fork_id].push_back(&op);
    }
    for (const Op& op : ops_) {
      if (IsAppend(op.kind)) appends_[op.seq].push_back(&op);
    }
    for (auto& [seq, list] : creators_) {
      std::sort(list.begin(), list.end(),
                [](const Op* a, const Op* b) { return Answered(*a) > Answered(*b); });
    }
  }

  // nullopt: `tokens` is a state sequence `seq` may have had at some point
  // in [lo, hi].
  std::optional<Failure> ExplainState(const std::string& seq, const std::vector<TokenRef>& tokens,
                                      int64_t lo, int64_t hi, int depth) const {
    std::optional<Failure> first;
    auto it = creators_.find(seq);
    if (it != creators_.end()) {
      for (const Op* c : it->second) {
        if (c->invoked_ns >= hi || Superseded(*c, it->second, lo)) continue;
        std::optional<Failure> f = TryCreator(seq, tokens, lo, hi, *c, depth);
        if (!f) return std::nullopt;
        if (!first) first = f;
      }
    }
    if (first) return first;
    if (tokens.empty()) return std::nullopt;
    return Failure{AnomalyKind::kPhantomToken,
                   absl::StrCat("sequence ", seq, " holds tokens but no creation of it precedes")};
  }

  // Another creation of `seq` than `c` may fall between `from` and `to`.
  bool RecreatedBetween(const std::string& seq, const Op* c, int64_t from, int64_t to) const {
    auto it = creators_.find(seq);
    if (it == creators_.end()) return false;
    for (const Op* other : it->second) {
      if (other != c && Answered(*other) > from && other->invoked_ns < to) return true;
    }
    return false;
  }

  const std::vector<Op>& ops() const { return ops_; }

 private:
  // Another creation of the same id certainly came after `c` and before
  // `lo`: a read from `lo` on cannot see what `c` made.
  static bool Superseded(const Op& c, const std::vector<const Op*>& creators, int64_t lo) {
    for (const Op* other : creators) {
      if (other->outcome == Outcome::kOk && other->invoked_ns > Answered(c) &&
          other->answered_ns < lo) {
        return true;
      }
    }
    return false;
  }

  std::optional<Failure> TryCreator(const std::string& seq, const std::vector<TokenRef>& tokens,
                                    int64_t lo, int64_t hi, const Op& c, int depth) const {
    size_t base = 0;
    std::set<int64_t> seen;
    if (c.kind == OpKind::kFork) {
      if (c.outcome == Outcome::kOk) {
        base = static_cast<size_t>(std::max(0, c.answered_tokens));
      } else {  // Unknown length: the tokens not written on `seq` itself.
        while (base < tokens.size() && tokens[base].op < static_cast<int64_t>(ops_.size()) &&
               ops_[tokens[base].op].seq != seq) {
          ++base;
        }
      }
      if (tokens.size() < base) {
        return Failure{AnomalyKind::kForkMismatch,
                       absl::StrCat("fork ", c.id, " of ", c.seq, " counted ", base,
                                    " tokens; a read of ", seq, " has ", tokens.size())};
      }
      if (depth < kMaxForkDepth) {
        std::vector<TokenRef> parent(tokens.begin(), tokens.begin() + base);
        if (std::optional<Failure> f =
                ExplainState(c.seq, parent, c.invoked_ns, Answered(c), depth + 1)) {
          return Failure{AnomalyKind::kForkMismatch,
                         absl::StrCat("the first ", base, " tokens of ", seq, " (fork ", c.id,
                                      " of ", c.seq, ") are no state of the parent: ", f->detail)};
        }
      }
      for (size_t i = 0; i < base; ++i) seen.insert(tokens[i].op);
    }
    std::vector<const Op*> order;
    for (size_t i = base; i < tokens.size();) {
      const TokenRef& t = tokens[i];
      if (t.op < 0 || t.op >= static_cast<int64_t>(ops_.size()) || !IsAppend(ops_[t.op].kind) ||
          ops_[t.op].seq != seq) {
        return Failure{AnomalyKind::kPhantomToken,
                       absl::StrCat("token ", i, " of ", seq, " names op ", t.op,
                                    ", no append on this sequence")};
      }
      const Op& a = ops_[t.op];
      if (a.invoked_ns >= hi) {
        return Failure{AnomalyKind::kPhantomToken,
                       absl::StrCat("token ", i, " of ", seq, " is of ", KindName(a.kind), " ",
                                    a.id, ", invoked after the read was answered")};
      }
      if (a.outcome == Outcome::kFailed) {
        return Failure{AnomalyKind::kFailedVisible,
                       absl::StrCat("token ", i, " of ", seq, " is of ", KindName(a.kind), " ",
                                    a.id, ", answered code ", a.code, " \"", a.message, "\"")};
      }
      if (Answered(a) < c.invoked_ns) {
        return Failure{AnomalyKind::kStaleToken,
                       absl::StrCat("token ", i, " of ", seq, " is of ", KindName(a.kind), " ",
                                    a.id, ", which ended before ", KindName(c.kind), " ", c.id,
                                    " created the sequence")};
      }
      if (seen.count(a.id) != 0) {
        return Failure{AnomalyKind::kTornAppend,
                       absl::StrCat(KindName(a.kind), " ", a.id, " appears twice in ", seq)};
      }
      for (int k = 0; k < a.tokens; ++k) {
        if (i + k >= tokens.size() || tokens[i + k] != TokenRef{a.id, k}) {
          return Failure{AnomalyKind::kTornAppend,
                         absl::StrCat(KindName(a.kind), " ", a.id, " of ", a.tokens,
                                      " tokens is not whole at token ", i + k, " of ", seq)};
        }
      }
      seen.insert(a.id);
      order.push_back(&a);
      i += std::max(1, a.tokens);
    }
    for (size_t x = 0; x < order.size(); ++x) {
      for (size_t y = x + 1; y < order.size(); ++y) {
        if (Answered(*order[y]) < order[x]->invoked_ns) {
          return Failure{AnomalyKind::kOrder,
                         absl::StrCat(KindName(order[y]->kind), " ", order[y]->id,
                                      " was acknowledged before ", KindName(order[x]->kind), " ",
                                      order[x]->id, " began, but comes after it in ", seq)};
        }
      }
    }
    auto it = appends_.find(seq);
    if (it != appends_.end()) {
      for (const Op* a : it->second) {
        if (a->outcome != Outcome::kOk || a->answered_ns >= lo || a->invoked_ns <= Answered(c) ||
            seen.count(a->id) != 0 || RecreatedBetween(seq, &c, a->invoked_ns, hi)) {
          continue;
        }
        return Failure{AnomalyKind::kLostAppend,
                       absl::StrCat(KindName(a->kind), " ", a->id, " of ", a->tokens,
                                    " tokens was acknowledged before the read began, but ", seq,
                                    " holds ", tokens.size(), " tokens without it")};
      }
    }
    return std::nullopt;
  }

  const std::vector<Op>& ops_;
  std::map<std::string, std::vector<const Op*>> creators_;
  std::map<std::string, std::vector<const Op*>> appends_;
};

bool Close(const std::vector<float>& got, const std::vector<float>& want, std::string* why) {
  if (got.size() != want.size()) {
    *why = absl::StrCat(got.size(), " values, expected ", want.size());
    return false;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 1e-3f + 1e-3f * std::fabs(want[i]))) {
      *why = absl::StrCat("element ", i, " = ", got[i], ", reference ", want[i]);
      return false;
    }
  }
  return true;
}

// The tokens of a read, or nullopt when any could not be attributed.
std::optional<std::vector<TokenRef>> Attributed(const Op& read) {
  std::vector<TokenRef> out;
  for (const std::optional<TokenRef>& t : read.read) {
    if (!t) return std::nullopt;
    out.push_back(*t);
  }
  return out;
}

}  // namespace

const char* AnomalyName(AnomalyKind kind) {
  switch (kind) {
    case AnomalyKind::kLostAppend: return "lost acknowledged append";
    case AnomalyKind::kFailedVisible: return "failed append visible";
    case AnomalyKind::kTornAppend: return "torn append";
    case AnomalyKind::kPhantomToken: return "phantom token";
    case AnomalyKind::kStaleToken: return "stale token";
    case AnomalyKind::kOrder: return "real-time order violated";
    case AnomalyKind::kForkMismatch: return "fork differs from its parent";
    case AnomalyKind::kAckCount: return "acknowledgement miscounts";
    case AnomalyKind::kAttention: return "attention differs from the fetched K/V";
    case AnomalyKind::kPoolLeak: return "pool bytes not returned";
  }
  return "?";
}

std::vector<float> ReferenceAttention(const std::vector<float>& q,
                                      const std::vector<TokenRef>& keys) {
  const int group = kQHeads / kKvHeads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  std::vector<float> out(static_cast<size_t>(kQHeads) * kHeadDim, 0.0f);
  for (int qh = 0; qh < kQHeads; ++qh) {
    const int h = qh / group;
    std::vector<double> logits;
    double max = -std::numeric_limits<double>::infinity();
    for (const TokenRef& t : keys) {
      const std::vector<uint16_t> k = KeyRow(t.op, t.index, h);
      double dot = 0;
      for (int d = 0; d < kHeadDim; ++d) dot += double{q[qh * kHeadDim + d]} * HalfToFloat(k[d]);
      logits.push_back(dot * scale);
      max = std::max(max, logits.back());
    }
    double sum = 0;
    for (double& l : logits) sum += (l = std::exp(l - max));
    for (size_t j = 0; j < keys.size(); ++j) {
      const std::vector<uint16_t> v = ValueRow(keys[j].op, keys[j].index, h);
      for (int d = 0; d < kHeadDim; ++d) {
        out[qh * kHeadDim + d] += static_cast<float>(logits[j] / sum * HalfToFloat(v[d]));
      }
    }
  }
  return out;
}

CheckReport Check(const History& history) {
  CheckReport report;
  const Checker checker(history);
  const std::vector<Op>& ops = checker.ops();
  auto flag = [&](AnomalyKind kind, int64_t op, std::string detail) {
    report.anomalies.push_back(Anomaly{kind, op, std::move(detail)});
  };
  // Reads that were explained, for placing attention answers.
  std::vector<const Op*> good_reads;
  for (const Op& op : ops) {
    if (op.kind == OpKind::kAppend && op.outcome == Outcome::kOk &&
        op.answered_tokens < op.tokens) {
      flag(AnomalyKind::kAckCount, op.id,
           absl::StrCat("Append ", op.id, " of ", op.tokens, " tokens to ", op.seq,
                        " was answered OK with num_tokens = ", op.answered_tokens));
    }
    if (op.kind != OpKind::kFetch || op.outcome != Outcome::kOk) continue;
    ++report.reads_checked;
    std::optional<std::vector<TokenRef>> tokens = Attributed(op);
    if (!tokens) {
      flag(AnomalyKind::kPhantomToken, op.id,
           absl::StrCat("a read of ", op.seq, " returned bytes that are no append's rows"));
      continue;
    }
    if (std::optional<Failure> f =
            checker.ExplainState(op.seq, *tokens, op.invoked_ns, op.answered_ns, 0)) {
      flag(f->kind, op.id, absl::StrCat("FetchDequant ", op.id, ": ", f->detail));
      continue;
    }
    good_reads.push_back(&op);
  }
  std::string why;
  for (const Op& op : ops) {
    if (op.outcome != Outcome::kOk) continue;
    if (op.kind == OpKind::kAttend) {
      const Op& read = ops[op.read_op];
      std::optional<std::vector<TokenRef>> tokens = Attributed(read);
      if (read.outcome != Outcome::kOk || !tokens ||
          op.key_end > static_cast<int>(tokens->size()) ||
          checker.RecreatedBetween(op.seq, nullptr, read.invoked_ns, op.answered_ns)) {
        continue;  // The sequence may have been made again in between.
      }
      tokens->resize(op.key_end);
      ++report.attention_checked;
      if (!Close(op.out, ReferenceAttention(op.q, *tokens), &why)) {
        flag(AnomalyKind::kAttention, op.id,
             absl::StrCat("Attend ", op.id, " over the ", op.key_end, " tokens FetchDequant ",
                          read.id, " returned: ", why));
      }
    } else if (op.kind == OpKind::kAppendAttend || op.kind == OpKind::kDecodeStep) {
      bool placed = false;
      for (const Op* r : good_reads) {
        if (r->seq != op.seq) continue;
        const std::optional<TokenRef> own = TokenRef{op.id, 0};
        auto at = std::find(r->read.begin(), r->read.end(), own);
        if (at == r->read.end()) continue;
        std::vector<TokenRef> keys;
        for (auto t = r->read.begin(); t <= at; ++t) keys.push_back(**t);
        placed = true;
        ++report.attention_checked;
        if (!Close(op.out, ReferenceAttention(op.q, keys), &why)) {
          flag(AnomalyKind::kAttention, op.id,
               absl::StrCat(KindName(op.kind), " ", op.id, " over the ", keys.size(),
                            " tokens up to it in FetchDequant ", r->id, ": ", why));
        }
        break;
      }
      if (!placed) ++report.attention_unplaced;
    }
  }
  if (history.baseline_used_bytes() >= 0 &&
      history.final_used_bytes() != history.baseline_used_bytes()) {
    flag(AnomalyKind::kPoolLeak, -1,
         absl::StrCat("used_bytes ", history.final_used_bytes(), " after every release, ",
                      history.baseline_used_bytes(), " before the first call"));
  }
  return report;
}

}  // namespace kvq::history
