#include "tests/integration/history/history.h"

#include <chrono>

namespace kvq::history {

const char* KindName(OpKind kind) {
  switch (kind) {
    case OpKind::kCreate: return "CreateSequence";
    case OpKind::kAppend: return "Append";
    case OpKind::kAppendAttend: return "AppendAttend";
    case OpKind::kDecodeStep: return "DecodeStream step";
    case OpKind::kFork: return "Fork";
    case OpKind::kRelease: return "Release";
    case OpKind::kFetch: return "FetchDequant";
    case OpKind::kAttend: return "Attend";
    case OpKind::kStats: return "Stats";
  }
  return "?";
}

int64_t History::NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t History::Invoke(Op op) {
  absl::MutexLock lock(&mu_);
  op.id = static_cast<int64_t>(ops_.size());
  op.invoked_ns = NowNs();
  op.outcome = Outcome::kPending;
  ops_.push_back(std::move(op));
  return ops_.back().id;
}

void History::Add(Op op) {
  absl::MutexLock lock(&mu_);
  op.id = static_cast<int64_t>(ops_.size());
  ops_.push_back(std::move(op));
}

}  // namespace kvq::history
