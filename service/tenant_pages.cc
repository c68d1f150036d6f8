#include "service/tenant_pages.h"

#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace kvq {

std::optional<std::string> QuotaTenant(const absl::Status& st) {
  if (st.code() != absl::StatusCode::kResourceExhausted) return std::nullopt;
  auto tenant = st.GetPayload(kQuotaPayload);  // absl::optional<absl::Cord>
  if (!tenant.has_value()) return std::nullopt;
  return std::string(*tenant);
}

TenantPages::TenantPages(std::string tenant, std::shared_ptr<PagePool> pool)
    : tenant_(std::move(tenant)), pool_(std::move(pool)) {}

absl::Status TenantPages::QuotaError(int64_t used, int64_t more) const {
  absl::Status st = absl::ResourceExhaustedError(
      absl::StrCat("tenant \"", tenant_, "\" is over its quota: quota_bytes = ", quota_bytes(),
                   ", used ", used, " bytes, this needs ", more, " more"));
  st.SetPayload(kQuotaPayload, absl::Cord(tenant_));
  return st;
}

absl::StatusOr<uint8_t*> TenantPages::Allocate(size_t bytes) {
  const int64_t n = static_cast<int64_t>(bytes);
  // Reserve first, so that concurrent allocations never pass the quota
  // together.
  const int64_t before = used_.fetch_add(n, std::memory_order_relaxed);
  const int64_t quota = quota_bytes();
  if (quota > 0 && before + n > quota) {
    used_.fetch_sub(n, std::memory_order_relaxed);
    return QuotaError(before, n);
  }
  absl::StatusOr<uint8_t*> block = pool_->Allocate(bytes);
  if (!block.ok()) used_.fetch_sub(n, std::memory_order_relaxed);
  return block;
}

void TenantPages::Retain(uint8_t* block, size_t bytes) { pool_->Retain(block, bytes); }

void TenantPages::Free(uint8_t* block, size_t bytes) {
  if (pool_->FreeLast(block, bytes))
    used_.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
}

}  // namespace kvq
