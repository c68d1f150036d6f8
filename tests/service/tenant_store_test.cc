// The store's tenant boundary: keys, tombstones, generated ids and the
// prefix registry per tenant (a foreign id answers exactly like a
// never-known one), and the per-tenant quota of TenantPages.
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "service/sequence_store.h"
#include "service/tenant_pages.h"
#include "tests/service/store_test_data.h"

namespace kvq {
namespace {

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kDim = 64;

std::unique_ptr<SequenceStore> MakeStore(bool evict = false) {
  return NewTestStore(16 << 20, evict);
}

CreateSequenceArgs Args(const std::string& tenant, const std::string& id) {
  CreateSequenceArgs a;
  a.tenant = tenant;
  a.ns = "ns";
  a.id = id;
  a.shape = GqaShape(kLayers, kHeads, kDim);
  a.scheme = "kivi2:g32:r128";
  return a;
}

// K/V of `tokens` tokens of this test's model.
Kv MakeKv(int tokens, uint64_t seed) { return RandomKv(kLayers, kHeads, kDim, tokens, seed); }

absl::Status Append(SequenceStore& store, SequenceStore::Handle& h, const Kv& kv, int tokens) {
  absl::MutexLock lock(&h->mu());
  return store.WithEviction(&*h, [&] { return h->AppendDense(kv.view(tokens)); });
}

TEST(TenantStoreTest, AForeignIdAnswersExactlyLikeANeverKnownOne) {
  auto store = MakeStore();
  Kv kv = MakeKv(300, 1);
  {
    absl::StatusOr<SequenceStore::Handle> a = store->Create(Args("a", "s"));
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(Append(*store, *a, kv, 300).ok());
  }
  ASSERT_TRUE(store->Create(Args("a", "gone")).ok());
  ASSERT_TRUE(store->Release("ns", "gone", "a").ok());

  for (const char* id : {"s", "gone"}) {
    SCOPED_TRACE(id);
    const absl::Status never = store->Get("ns", "never", "b").status();
    const std::string want =
        absl::StrCat("sequence \"", id, "\" in namespace \"ns\" does not exist");
    EXPECT_EQ(never.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(store->Get("ns", id, "b").status(), absl::NotFoundError(want));
    EXPECT_EQ(store->Release("ns", id, "b").status(), absl::NotFoundError(want));
    EXPECT_EQ(store->Fork("ns", id, "copy", 0, absl::ZeroDuration(), "b").status(),
              absl::NotFoundError(want));
    // The default tenant is a tenant like any other.
    EXPECT_EQ(store->Get("ns", id).status(), absl::NotFoundError(want));
  }
  // B's own sequence of the same id lives beside A's.
  ASSERT_TRUE(store->Create(Args("b", "s")).ok());
  absl::StatusOr<SequenceStore::Handle> a = store->Get("ns", "s", "a");
  ASSERT_TRUE(a.ok());
  absl::ReaderMutexLock lock(&(*a)->mu());
  EXPECT_EQ((*a)->num_tokens(), 300);
  EXPECT_EQ(store->Get("ns", "gone", "a").status().message(),
            "sequence \"gone\" in namespace \"ns\" was released");
}

TEST(TenantStoreTest, GeneratedIdsCountPerTenant) {
  auto store = MakeStore();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(store->Create(Args("a", "")).ok());
  absl::StatusOr<SequenceStore::Handle> b = store->Create(Args("b", ""));
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(absl::StartsWith((*b)->id(), "seq-1-")) << (*b)->id();
}

TEST(TenantStoreTest, PrefixReuseStaysInsideATenant) {
  auto store = MakeStore();
  std::vector<int32_t> ids(600);
  for (int i = 0; i < 600; ++i) ids[i] = 1000 + i;
  Kv kv = MakeKv(600, 2);
  {
    absl::StatusOr<SequenceStore::Handle> first = store->Create(Args("a", "first"));
    ASSERT_TRUE(first.ok());
    absl::MutexLock lock(&(*first)->mu());
    ASSERT_TRUE((*first)->AppendDense(kv.view(600)).ok());
    (*first)->token_ids() = ids;
    store->RegisterPrefixBlocks(first->shared());
  }
  CreateSequenceArgs b = Args("b", "second");
  b.prompt_token_ids = ids;
  absl::StatusOr<SequenceStore::Handle> other = store->Create(b);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*other)->num_tokens(), 0) << "another tenant's prefix was reused";
  CreateSequenceArgs a = Args("a", "second");
  a.prompt_token_ids = ids;
  absl::StatusOr<SequenceStore::Handle> same = store->Create(a);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ((*same)->num_tokens(), 512) << "the tenant's own prefix is reused";
}

TEST(TenantStoreTest, QuotaRefusesAnAppendWholeAndCountsSharedPagesOnce) {
  auto store = MakeStore();
  Kv kv = MakeKv(1024, 3);
  absl::StatusOr<SequenceStore::Handle> h = store->Create(Args("a", "s"));
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(Append(*store, *h, kv, 512).ok());
  const std::vector<SequenceStore::TenantUsage> usage = store->TenantUsages();
  ASSERT_EQ(usage.size(), 1u);
  const int64_t used = usage[0].used_bytes;
  EXPECT_GT(used, 0);
  EXPECT_EQ(store->TenantStats("a").pool.used_bytes, static_cast<size_t>(used));
  EXPECT_EQ(store->TenantStats("b").pool.used_bytes, 0u);
  EXPECT_EQ(store->TenantStats("b").sequences, 0);

  // Counted like the pool's used_bytes: a block once, however many
  // sequences share it. A fork shares the full pages and copies the rest.
  EXPECT_EQ(static_cast<size_t>(used), store->pool().Stats().used_bytes);
  {
    absl::StatusOr<SequenceStore::Handle> f =
        store->Fork("ns", "s", "fork", 0, absl::ZeroDuration(), "a");
    ASSERT_TRUE(f.ok()) << f.status();
    const int64_t with_fork = store->TenantUsages()[0].used_bytes;
    EXPECT_EQ(static_cast<size_t>(with_fork), store->pool().Stats().used_bytes);
    EXPECT_GT(store->pool().Stats().shared_blocks, 0u);
    EXPECT_LT(with_fork, 2 * used);
  }
  ASSERT_TRUE(store->Release("ns", "fork", "a").ok());
  EXPECT_EQ(store->TenantUsages()[0].used_bytes, used);

  // Quota just above the use: the next 512 tokens need more; nothing is stored.
  store->SetTenantQuota("a", used + 1);
  const absl::Status st = Append(*store, *h, kv, 512);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(absl::StartsWith(
      st.message(),
      absl::StrCat("tenant \"a\" is over its quota: quota_bytes = ", used + 1, ", used ")))
      << st;
  EXPECT_EQ(QuotaTenant(st), "a");
  {
    absl::ReaderMutexLock lock(&(*h)->mu());
    EXPECT_EQ((*h)->num_tokens(), 512);
  }
  EXPECT_EQ(store->TenantUsages()[0].used_bytes, used);
  // Another tenant is not limited by a's quota.
  absl::StatusOr<SequenceStore::Handle> b = store->Create(Args("b", "s"));
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(Append(*store, *b, kv, 1024).ok());
  // Lifting the quota lets a append again.
  store->SetTenantQuota("a", 0);
  EXPECT_TRUE(Append(*store, *h, kv, 512).ok());
  // Releasing everything gives every byte back.
  h = absl::StatusOr<SequenceStore::Handle>(SequenceStore::Handle());
  b = absl::StatusOr<SequenceStore::Handle>(SequenceStore::Handle());
  ASSERT_TRUE(store->Release("ns", "s", "a").ok());
  ASSERT_TRUE(store->Release("ns", "s", "b").ok());
  for (const SequenceStore::TenantUsage& u : store->TenantUsages()) {
    EXPECT_EQ(u.used_bytes, 0) << u.tenant;
  }
  EXPECT_EQ(store->pool().Stats().used_bytes, 0u);
}

TEST(TenantStoreTest, ForkAndCreateOverQuotaLeaveNothingBehind) {
  auto store = MakeStore();
  Kv kv = MakeKv(300, 5);
  absl::StatusOr<SequenceStore::Handle> h = store->Create(Args("a", "s"));
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(Append(*store, *h, kv, 300).ok());
  const int64_t used = store->TenantUsages()[0].used_bytes;
  store->SetTenantQuota("a", used);
  // A fork copies the fp16 blocks and the partial page: more bytes.
  const absl::Status fork = store->Fork("ns", "s", "f", 0, absl::ZeroDuration(), "a").status();
  EXPECT_EQ(fork.code(), absl::StatusCode::kResourceExhausted) << fork;
  EXPECT_TRUE(absl::StartsWith(fork.message(), "tenant \"a\" is over its quota")) << fork;
  EXPECT_EQ(store->Get("ns", "f", "a").status().message(),
            "sequence \"f\" in namespace \"ns\" does not exist");
  const absl::Status create = store->Create(Args("a", "c")).status();
  EXPECT_EQ(create.code(), absl::StatusCode::kResourceExhausted) << create;
  EXPECT_EQ(store->Get("ns", "c", "a").status().message(),
            "sequence \"c\" in namespace \"ns\" does not exist");
  EXPECT_EQ(store->TenantUsages()[0].used_bytes, used);
  EXPECT_EQ(store->TenantStats("a").sequences, 1);
}

TEST(TenantStoreTest, QuotaNeverEvictsAnotherTenant) {
  auto store = MakeStore(/*evict=*/true);
  Kv kv = MakeKv(512, 4);
  {
    absl::StatusOr<SequenceStore::Handle> b = store->Create(Args("b", "idle"));
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE(Append(*store, *b, kv, 512).ok());
  }
  // Room for the sequence's fp16 blocks (4 x 32832 bytes), not its pages.
  store->SetTenantQuota("a", 4 * 32832 + 4096);
  absl::StatusOr<SequenceStore::Handle> a = store->Create(Args("a", "s"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(Append(*store, *a, kv, 512).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store->Get("ns", "idle", "b").ok()) << "b's idle sequence was evicted for a's quota";
}

TEST(TenantPagesTest, ChargesOnAllocateAndUnchargesOnTheLastFree) {
  PagePoolOptions o;
  o.capacity_bytes = 1 << 20;
  o.slab_bytes = 64 << 10;
  std::shared_ptr<PagePool> pool = std::move(*PagePool::Create(o));
  TenantPages pages("t", pool);
  pages.set_quota_bytes(2048);
  absl::StatusOr<uint8_t*> a = pages.Allocate(1024);
  ASSERT_TRUE(a.ok());
  pages.Retain(*a, 1024);
  EXPECT_EQ(pages.used_bytes(), 1024);
  absl::StatusOr<uint8_t*> b = pages.Allocate(1024);
  ASSERT_TRUE(b.ok());
  const absl::Status over = pages.Allocate(64).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.message(),
            "tenant \"t\" is over its quota: quota_bytes = 2048, used 2048 bytes, this needs 64 "
            "more");
  EXPECT_EQ(pages.used_bytes(), 2048);
  pages.Free(*a, 1024);
  EXPECT_EQ(pages.used_bytes(), 2048) << "a reference is left";
  pages.Free(*a, 1024);
  pages.Free(*b, 1024);
  EXPECT_EQ(pages.used_bytes(), 0);
  EXPECT_EQ(pool->Stats().used_bytes, 0u);
  EXPECT_EQ(QuotaTenant(absl::ResourceExhaustedError("page pool exhausted")), std::nullopt);
}

}  // namespace
}  // namespace kvq
