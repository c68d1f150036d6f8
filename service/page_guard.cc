#include "service/page_guard.h"

namespace kvq {

absl::Status PageGuard::Verify(const Sequence& seq, int layer, int begin, int end) {
  if (!sampler_.Next()) return absl::OkStatus();
  absl::Status st = VerifyPages(seq, store_->pool(), layer, begin, end);
  if (!st.ok() && metrics_ != nullptr) metrics_->RecordChecksumFailure();
  return st;
}

}  // namespace kvq
