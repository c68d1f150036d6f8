// TenantPages: the page allocator of one tenant's sequences. It draws from
// the server's PagePool and counts the bytes of the blocks the tenant holds
// there, refusing an allocation that would take it past its quota.
//
// A block is charged once, when allocated, and uncharged when its last
// reference goes (PagePool::FreeLast): copy-on-write sharing (Fork, prefix
// reuse, an Append stream's snapshot) adds references, not bytes, so the
// figure is what the tenant's sequences hold in the pool, like the pool's
// own used_bytes. Sharing never crosses tenants (the store keys forks and
// the prefix registry by tenant), so every block has one tenant.
//
// Thread-safe. Held by shared_ptr: messages of a raw FetchDequant keep
// pages referenced (and so this allocator alive) after the store is gone.
#ifndef KVQ_SERVICE_TENANT_PAGES_H_
#define KVQ_SERVICE_TENANT_PAGES_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/page_allocator.h"
#include "service/page_pool.h"

namespace kvq {

// Payload type URL set on a quota RESOURCE_EXHAUSTED (its value: the
// tenant), so that the store evicts only that tenant's prefix cache for it,
// never another tenant's sequences.
inline constexpr absl::string_view kQuotaPayload = "type.kvq/tenant_quota";
// The tenant whose quota refused `st`, if any.
std::optional<std::string> QuotaTenant(const absl::Status& st);

class TenantPages final : public PageAllocator {
 public:
  TenantPages(std::string tenant, std::shared_ptr<PagePool> pool);

  // RESOURCE_EXHAUSTED naming the tenant, its quota and its use when the
  // block would take the tenant past its quota; else the pool's answer.
  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override;
  void Retain(uint8_t* block, size_t bytes) override;
  void Free(uint8_t* block, size_t bytes) override;

  const std::string& tenant() const { return tenant_; }
  // 0: no quota.
  void set_quota_bytes(int64_t bytes) { quota_.store(bytes, std::memory_order_relaxed); }
  int64_t quota_bytes() const { return quota_.load(std::memory_order_relaxed); }
  int64_t used_bytes() const { return used_.load(std::memory_order_relaxed); }
  // The quota error for an operation that needs `more` bytes now.
  absl::Status QuotaError(int64_t used, int64_t more) const;

 private:
  const std::string tenant_;
  const std::shared_ptr<PagePool> pool_;
  std::atomic<int64_t> quota_{0};
  std::atomic<int64_t> used_{0};
};

}  // namespace kvq

#endif  // KVQ_SERVICE_TENANT_PAGES_H_
