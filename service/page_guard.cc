#include "service/page_guard.h"

#include <cstdio>
#include <string>

namespace kvq {

absl::Status PageGuard::Verify(const Sequence& seq, int layer, int begin, int end) {
  std::unique_ptr<PageReadCheck> check = StartRead();
  if (check == nullptr) return absl::OkStatus();
  check->Add(seq, layer, begin, end);
  check->CheckAll();
  return Finish(*check);
}

std::unique_ptr<PageReadCheck> PageGuard::StartRead() {
  if (!sampler_.Next()) return nullptr;
  return std::make_unique<PageReadCheck>(store_->pool());
}

absl::Status PageGuard::Finish(const PageReadCheck& check) {
  absl::Status st = check.status();
  if (!st.ok()) {
    // Rare and a sign of bad memory on this node: worth a line in the log
    // besides the counter.
    std::fprintf(stderr, "kvq-server: %s\n", std::string(st.message()).c_str());
    if (metrics_ != nullptr) metrics_->RecordChecksumFailure();
  }
  return st;
}

}  // namespace kvq
