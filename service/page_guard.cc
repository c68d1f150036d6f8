#include "service/page_guard.h"

#include <cstdio>
#include <string>

namespace kvq {

absl::Status PageGuard::Verify(const Sequence& seq, int layer, int begin, int end) {
  if (!sampler_.Next()) return absl::OkStatus();
  absl::Status st = VerifyPages(seq, store_->pool(), layer, begin, end);
  if (!st.ok()) {
    // Rare and a sign of bad memory on this node: worth a line in the log
    // besides the counter.
    std::fprintf(stderr, "kvq-server: %s\n", std::string(st.message()).c_str());
    if (metrics_ != nullptr) metrics_->RecordChecksumFailure();
  }
  return st;
}

}  // namespace kvq
