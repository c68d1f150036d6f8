#include "service/sequence_store.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/service/store_test_data.h"

namespace kvq {
namespace {

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kDim = 64;

ModelShape Shape() { return GqaShape(kLayers, kHeads, kDim); }

std::unique_ptr<SequenceStore> MakeStore(size_t capacity, bool evict) {
  StoreOptions o;
  o.pool.capacity_bytes = capacity;
  o.pool.slab_bytes = 64 << 10;
  o.evict_when_full = evict;
  o.default_ttl = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<SequenceStore>> s = SequenceStore::Create(o, &CpuBackend());
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

CreateSequenceArgs Args(const std::string& id, const std::string& scheme = "kivi2") {
  CreateSequenceArgs a;
  a.ns = "tenant";
  a.id = id;
  a.shape = Shape();
  a.scheme = scheme;
  return a;
}

// K/V of `tokens` tokens of this test's model.
Kv MakeKv(int tokens, uint64_t seed) { return RandomKv(kLayers, kHeads, kDim, tokens, seed); }

// Every K/V value of one stream; the caller holds the sequence's lock.
std::vector<float> ReadAllLocked(Sequence& s, int layer, int head) {
  const int n = s.layer_tokens(layer);
  std::vector<float> k(static_cast<size_t>(n) * kDim), v(k.size());
  EXPECT_TRUE(s.stream(layer, head).Read(0, n, {}, Floats(k.data(), n, kDim), Floats(v.data(), n, kDim)).ok());
  k.insert(k.end(), v.begin(), v.end());
  return k;
}

std::vector<float> ReadAll(Sequence& s, int layer, int head) {
  absl::ReaderMutexLock lock(&s.mu());
  return ReadAllLocked(s, layer, head);
}

TEST(SequenceStoreTest, CreateRejectsBadInputWithTheField) {
  auto store = MakeStore(4 << 20, false);
  CreateSequenceArgs a = Args("a", "kivi5");
  EXPECT_EQ(store->Create(a).status().message(),
            "scheme \"kivi5\": unknown base scheme \"kivi5\"; expected one of fp16, bf16, int8, "
            "fp8_e4m3, kivi4, kivi3, kivi2, crq<K> (K in 2, 2.5, 3, 3.5, 4)");
  a = Args("a");
  a.shape.num_q_heads = 3;
  EXPECT_EQ(store->Create(a).status().message(),
            "layout.num_q_heads = 3 must be a multiple of num_kv_heads = 2, at most 64x");
  a = Args("bad id!");
  EXPECT_EQ(store->Create(a).status().message(),
            "sequence_id may hold only letters, digits and - _ . :");
  ASSERT_TRUE(store->Create(Args("a")).ok());
  absl::StatusOr<SequenceStore::Handle> dup = store->Create(Args("a"));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(store->Get("tenant", "zzz").status().message(),
            "sequence \"zzz\" in namespace \"tenant\" does not exist");
  EXPECT_EQ(store->Get("other", "a").status().code(), absl::StatusCode::kNotFound)
      << "namespaces are isolated";
}

TEST(SequenceStoreTest, FullPoolFailsCleanlyAndKeepsData) {
  auto store = MakeStore(1 << 20, /*evict=*/false);
  absl::StatusOr<SequenceStore::Handle> h = store->Create(Args("a", "fp16"));
  ASSERT_TRUE(h.ok());
  Kv small = MakeKv(64, 1);
  {
    absl::MutexLock lock(&(*h)->mu());
    ASSERT_TRUE((*h)->AppendDense(small.view(64)).ok());
  }
  const std::vector<float> before = ReadAll(**h, 1, 1);
  const size_t used = store->pool().Stats().used_bytes;
  Kv big = MakeKv(2048, 2);  // fp16: 2048 tokens x 2 x 2 x 2 x 64 x 2 bytes = 2 MiB > pool.
  absl::Status st;
  {
    absl::MutexLock lock(&(*h)->mu());
    st = store->WithEviction(&**h, [&] { return (*h)->AppendDense(big.view(2048)); });
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_EQ(ReadAll(**h, 1, 1), before) << "a failed append must not change stored data";
  EXPECT_EQ(store->pool().Stats().used_bytes, used) << "a failed append must not leak pages";
}

TEST(SequenceStoreTest, EvictionTakesTheLeastRecentlyUsedIdleSequence) {
  auto store = MakeStore(1 << 20, /*evict=*/true);
  Kv kv = MakeKv(512, 3);  // fp16, 512 KiB per sequence.
  for (const char* id : {"old", "new"}) {
    absl::StatusOr<SequenceStore::Handle> h = store->Create(Args(id, "fp16"));
    ASSERT_TRUE(h.ok());
    absl::MutexLock lock(&(*h)->mu());
    ASSERT_TRUE(store->WithEviction(&**h, [&] { return (*h)->AppendDense(kv.view(512)); }).ok());
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_TRUE(store->Get("tenant", "old").ok());  // Still there: the pool had room for both?
  absl::StatusOr<SequenceStore::Handle> third = store->Create(Args("third", "fp16"));
  ASSERT_TRUE(third.ok()) << third.status();
  {
    absl::MutexLock lock(&(*third)->mu());
    absl::Status st =
        store->WithEviction(&**third, [&] { return (*third)->AppendDense(kv.view(512)); });
    ASSERT_TRUE(st.ok()) << st;
  }
  // "old" was touched by the Get above, so "new" was the least recently used.
  absl::StatusOr<SequenceStore::Handle> gone = store->Get("tenant", "new");
  ASSERT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(),
            "sequence \"new\" in namespace \"tenant\" was evicted to free memory; recompute it");
}

TEST(SequenceStoreTest, IdleLeasesExpireAndReturnTheirPages) {
  auto store = MakeStore(4 << 20, false);
  const size_t empty = store->pool().Stats().used_bytes;
  CreateSequenceArgs a = Args("a");
  a.ttl = absl::Seconds(5);
  {
    absl::StatusOr<SequenceStore::Handle> h = store->Create(a);
    ASSERT_TRUE(h.ok());
    Kv kv = MakeKv(300, 4);
    absl::MutexLock lock(&(*h)->mu());
    ASSERT_TRUE((*h)->AppendDense(kv.view(300)).ok());
    EXPECT_EQ(store->ExpireIdle(absl::Now() + absl::Hours(1)), 0) << "in use: no expiry";
  }
  EXPECT_EQ(store->ExpireIdle(absl::Now() + absl::Seconds(1)), 0);
  EXPECT_EQ(store->ExpireIdle(absl::Now() + absl::Seconds(6)), 1);
  EXPECT_EQ(store->pool().Stats().used_bytes, empty);
  EXPECT_EQ(store->Get("tenant", "a").status().message(),
            "sequence \"a\" in namespace \"tenant\" expired: its lease ran out while idle");
}

TEST(SequenceStoreTest, TransactionRollbackRestoresEverything) {
  auto store = MakeStore(8 << 20, false);
  absl::StatusOr<SequenceStore::Handle> h = store->Create(Args("a"));
  ASSERT_TRUE(h.ok());
  Kv kv = MakeKv(300, 5);
  {
    absl::MutexLock lock(&(*h)->mu());
    ASSERT_TRUE((*h)->AppendDense(kv.view(200)).ok());
  }
  const std::vector<float> before = ReadAll(**h, 0, 1);
  const size_t used = store->pool().Stats().used_bytes;
  {
    absl::MutexLock lock(&(*h)->mu());
    (*h)->token_ids().assign(200, 7);
    absl::StatusOr<TransactionToken> txn = (*h)->BeginTransaction();
    ASSERT_TRUE(txn.ok()) << txn.status();
    ASSERT_TRUE((*h)->AppendDense(kv.view(300)).ok());
    (*h)->token_ids().resize(500, 8);
    EXPECT_EQ((*h)->committed_tokens(0), 200);
    EXPECT_EQ((*h)->committed_num_tokens(), 200);
    ASSERT_TRUE((*h)->Rollback(*txn).ok());
    EXPECT_FALSE(txn->held());
    // The undone append's token ids are gone with its tokens.
    EXPECT_EQ((*h)->token_ids(), std::vector<int32_t>(200, 7));
  }
  EXPECT_EQ(ReadAll(**h, 0, 1), before);
  EXPECT_EQ(store->pool().Stats().used_bytes, used);
}

// A writer refused while another holds the transaction owns nothing: it can
// neither roll back nor commit the holder's appends, and a token cannot end
// a transaction twice.
TEST(SequenceStoreTest, OnlyTheTransactionsOwnerEndsIt) {
  auto store = MakeStore(8 << 20, false);
  absl::StatusOr<SequenceStore::Handle> h = store->Create(Args("a", "fp16"));
  ASSERT_TRUE(h.ok());
  Kv kv = MakeKv(40, 9);
  absl::MutexLock lock(&(*h)->mu());
  absl::StatusOr<TransactionToken> first = (*h)->BeginTransaction();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*h)->AppendDense(kv.view(40)).ok());

  absl::StatusOr<TransactionToken> second = (*h)->BeginTransaction();
  EXPECT_EQ(second.status(), absl::AbortedError("another append stream is in progress"));
  TransactionToken none;
  EXPECT_EQ((*h)->Rollback(none).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*h)->Commit(none).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*h)->in_transaction());
  EXPECT_EQ((*h)->num_tokens(), 40);
  EXPECT_EQ((*h)->committed_num_tokens(), 0);

  ASSERT_TRUE((*h)->Commit(*first).ok());
  EXPECT_FALSE((*h)->in_transaction());
  EXPECT_EQ((*h)->committed_num_tokens(), 40);
  EXPECT_EQ((*h)->Rollback(*first).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*h)->num_tokens(), 40);
}

// Readers read the committed streams: the open append quantized the
// committed fp16 tail of this kivi sequence (a flush), but a read during the
// transaction still returns the committed tokens as they were, which is
// also what a rollback leaves.
TEST(SequenceStoreTest, ReadsDuringATransactionReturnTheCommittedValues) {
  auto store = MakeStore(8 << 20, false);
  absl::StatusOr<SequenceStore::Handle> h = store->Create(Args("a", "kivi2:g32:r128"));
  ASSERT_TRUE(h.ok());
  Kv kv = MakeKv(200, 11);
  auto read = [&](const KvStream& s) {
    std::vector<float> k(100 * kDim), v(k.size());
    EXPECT_TRUE(s.Read(0, 100, {}, Floats(k.data(), 100, kDim), Floats(v.data(), 100, kDim)).ok());
    k.insert(k.end(), v.begin(), v.end());
    return k;
  };
  absl::MutexLock lock(&(*h)->mu());
  ASSERT_TRUE((*h)->AppendDense(kv.view(100)).ok());
  const std::vector<float> committed = read((*h)->committed_stream(1, 1));
  absl::StatusOr<TransactionToken> txn = (*h)->BeginTransaction();
  ASSERT_TRUE(txn.ok()) << txn.status();
  ASSERT_TRUE((*h)->AppendDense(kv.view(200)).ok());
  // The open append flushed the tail: tokens [0, 100) are quantized there.
  ASSERT_NE(read((*h)->stream(1, 1)), committed);
  EXPECT_EQ(read((*h)->committed_stream(1, 1)), committed);
  ASSERT_TRUE((*h)->Rollback(*txn).ok());
  EXPECT_EQ(read((*h)->committed_stream(1, 1)), committed);
}

// A fork taken while an append stream is open holds the committed tokens
// only, and the stream's later commit does not reach it.
TEST(SequenceStoreTest, ForkDuringATransactionSeesTheCommittedTokens) {
  auto store = MakeStore(8 << 20, false);
  absl::StatusOr<SequenceStore::Handle> h = store->Create(Args("a", "fp16"));
  ASSERT_TRUE(h.ok());
  Kv kv = MakeKv(60, 10);
  {
    absl::MutexLock lock(&(*h)->mu());
    ASSERT_TRUE((*h)->AppendDense(kv.view(20)).ok());
  }
  const std::vector<float> committed = ReadAll(**h, 1, 1);
  absl::StatusOr<TransactionToken> txn;
  {
    absl::MutexLock lock(&(*h)->mu());
    txn = (*h)->BeginTransaction();
    ASSERT_TRUE(txn.ok()) << txn.status();
    ASSERT_TRUE((*h)->AppendDense(kv.view(40)).ok());
  }
  absl::StatusOr<SequenceStore::Handle> f = store->Fork("tenant", "a", "f", 0, {});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(store->Fork("tenant", "a", "g", 21, {}).status().message(),
            "num_tokens = 21 is not in [0, 20]");
  {
    absl::MutexLock lock(&(*h)->mu());
    ASSERT_TRUE((*h)->Commit(*txn).ok());
    EXPECT_EQ((*h)->num_tokens(), 60);
  }
  {
    absl::ReaderMutexLock lock(&(*f)->mu());
    EXPECT_EQ((*f)->num_tokens(), 20);
  }
  EXPECT_EQ(ReadAll(**f, 1, 1), committed);
}

TEST(SequenceStoreTest, PrefixReuseSharesPagesOfTheSameTokens) {
  auto store = MakeStore(16 << 20, false);
  std::vector<int32_t> ids(600);
  for (int i = 0; i < 600; ++i) ids[i] = 1000 + i;
  Kv kv = MakeKv(600, 6);
  CreateSequenceArgs a = Args("first");
  absl::StatusOr<SequenceStore::Handle> first = store->Create(a);
  ASSERT_TRUE(first.ok());
  {
    absl::MutexLock lock(&(*first)->mu());
    ASSERT_TRUE((*first)->AppendDense(kv.view(600)).ok());
    (*first)->token_ids() = ids;
    store->RegisterPrefixBlocks(first->shared());
  }
  const size_t used = store->pool().Stats().used_bytes;
  CreateSequenceArgs b = Args("second");
  b.prompt_token_ids = ids;
  b.prompt_token_ids[590] = 7;  // Differs after 4 full blocks of 128.
  absl::StatusOr<SequenceStore::Handle> second = store->Create(b);
  ASSERT_TRUE(second.ok());
  {
    absl::ReaderMutexLock lock(&(*second)->mu());
    EXPECT_EQ((*second)->num_tokens(), 512);
    // The new sequence owns only its fp16 blocks (sink/tail); its pages are shared.
    EXPECT_EQ(store->pool().Stats().used_bytes - used,
              kLayers * kHeads * AuxBytes((*second)->stream(0, 0).config()))
        << "the prefix pages are shared";
  }
  std::vector<float> a0 = ReadAll(**first, 1, 0);
  std::vector<float> b0 = ReadAll(**second, 1, 0);
  EXPECT_TRUE(std::equal(b0.begin(), b0.begin() + 512 * kDim, a0.begin()));

  CreateSequenceArgs c = Args("third");
  c.prompt_token_ids = ids;
  c.prompt_token_ids[3] = 9;  // Differs in the first block: nothing to reuse.
  c.ns = "tenant";
  absl::StatusOr<SequenceStore::Handle> third = store->Create(c);
  ASSERT_TRUE(third.ok());
  absl::ReaderMutexLock lock3(&(*third)->mu());
  EXPECT_EQ((*third)->num_tokens(), 0);
  EXPECT_TRUE((*third)->token_ids().empty());
}

// MatchPrefix answers what Create would reuse and changes nothing: no
// sequence, no pool byte, no registry entry (not even a dead one dropped).
TEST(SequenceStoreTest, MatchPrefixIsReadOnlyAndAgreesWithCreate) {
  auto store = MakeStore(16 << 20, false);
  std::vector<int32_t> ids(600);
  for (int i = 0; i < 600; ++i) ids[i] = 1000 + i;
  {
    absl::StatusOr<SequenceStore::Handle> first = store->Create(Args("first"));
    ASSERT_TRUE(first.ok());
    absl::MutexLock lock(&(*first)->mu());
    ASSERT_TRUE((*first)->AppendDense(MakeKv(600, 6).view(600)).ok());
    (*first)->token_ids() = ids;
    store->RegisterPrefixBlocks(first->shared());
  }
  CreateSequenceArgs probe = Args("");
  probe.prompt_token_ids = ids;
  probe.prompt_token_ids[590] = 7;  // Differs after 4 full blocks of 128.
  const StoreStats before = store->Stats();
  int block = 0;
  EXPECT_EQ(store->MatchPrefix(probe, &block).value_or(-1), 512);
  EXPECT_EQ(block, 128);
  CreateSequenceArgs foreign = probe;
  foreign.tenant = "someone-else";
  EXPECT_EQ(store->MatchPrefix(foreign, &block).value_or(-1), 0);
  CreateSequenceArgs other_scheme = probe;
  other_scheme.scheme = "kivi4";
  EXPECT_EQ(store->MatchPrefix(other_scheme, &block).value_or(-1), 0);
  CreateSequenceArgs bad = Args("", "kivi5");
  EXPECT_EQ(store->MatchPrefix(bad, &block).status(), store->Create(bad).status());
  const StoreStats after = store->Stats();
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(after.prefix_entries, before.prefix_entries);
  EXPECT_EQ(after.pool.used_bytes, before.pool.used_bytes);

  CreateSequenceArgs create = probe;
  create.id = "second";
  absl::StatusOr<SequenceStore::Handle> second = store->Create(create);
  ASSERT_TRUE(second.ok());
  {
    absl::ReaderMutexLock lock(&(*second)->mu());
    EXPECT_EQ((*second)->num_tokens(), 512);
  }
  *second = SequenceStore::Handle();
  // Released (no eviction: gone): nothing to match, and the probe leaves
  // its dead registry entries for Create or the sweep.
  ASSERT_TRUE(store->Release("tenant", "first").ok());
  ASSERT_TRUE(store->Release("tenant", "second").ok());
  const int64_t entries = store->Stats().prefix_entries;
  EXPECT_GT(entries, 0);
  EXPECT_EQ(store->MatchPrefix(probe, &block).value_or(-1), 0);
  EXPECT_EQ(store->Stats().prefix_entries, entries);
}

// Prompts that are never repeated register blocks whose sequences are then
// released: the registry must not keep an entry per block ever stored (as
// kvq-bench soak's shared-prefix prompts, each with its own suffix, did:
// server memory grew with every such prompt for as long as it ran).
TEST(SequenceStoreTest, ReleasedSequencesDoNotGrowThePrefixRegistry) {
  auto store = MakeStore(16 << 20, false);
  Kv kv = MakeKv(600, 8);
  constexpr int kSequences = 400;  // 4 blocks of 128 each: 1600 registrations.
  for (int i = 0; i < kSequences; ++i) {
    absl::StatusOr<SequenceStore::Handle> h = store->Create(Args(absl::StrCat("s", i)));
    ASSERT_TRUE(h.ok()) << h.status();
    {
      absl::MutexLock lock(&(*h)->mu());
      ASSERT_TRUE((*h)->AppendDense(kv.view(600)).ok());
      std::vector<int32_t> ids(600);
      for (int t = 0; t < 600; ++t) ids[t] = i * 1000 + t;
      (*h)->token_ids() = ids;
      store->RegisterPrefixBlocks(h->shared());
    }
    if (i == 0) ASSERT_EQ(store->Stats().prefix_entries, 4);
    *h = SequenceStore::Handle();
    ASSERT_TRUE(store->Release("tenant", absl::StrCat("s", i)).ok());
  }
  EXPECT_LE(store->Stats().prefix_entries, 1024);
  EXPECT_EQ(store->Stats().pool.used_bytes, 0u);
}

}  // namespace
}  // namespace kvq

namespace kvq {
namespace {

// UndoAppend takes back an append that succeeded, byte for byte, also one
// that flushed the fp16 tail into new pages (the tail rows are restored).
TEST(SequenceStoreTest, UndoAppendRestoresTheStreamsAndThePool) {
  auto store = MakeStore(4 << 20, /*evict=*/false);
  int n = 0;
  for (const char* scheme : {"fp16", "kivi2:g32:r32", "kivi4:g32:r32:sink=4"}) {
    SCOPED_TRACE(scheme);
    absl::StatusOr<SequenceStore::Handle> h = store->Create(Args(absl::StrCat("undo", n++), scheme));
    ASSERT_TRUE(h.ok()) << h.status();
    Sequence& s = **h;
    Kv first = MakeKv(45, 7), next = MakeKv(40, 8);
    absl::MutexLock lock(&s.mu());
    ASSERT_TRUE(s.AppendDense(first.view(45)).ok());
    std::vector<std::vector<float>> before;
    for (int l = 0; l < kLayers; ++l) {
      for (int head = 0; head < kHeads; ++head) before.push_back(ReadAllLocked(s, l, head));
    }
    const size_t used = store->pool().Stats().used_bytes;
    const DenseKv kv = next.view(40);
    Sequence::AppendUndo undo = s.UndoPoint(kv);
    ASSERT_TRUE(s.AppendDense(kv).ok());
    ASSERT_EQ(s.num_tokens(), 85);
    s.UndoAppend(kv, undo);
    EXPECT_EQ(s.num_tokens(), 45);
    EXPECT_EQ(store->pool().Stats().used_bytes, used);
    int i = 0;
    for (int l = 0; l < kLayers; ++l) {
      for (int head = 0; head < kHeads; ++head) {
        EXPECT_EQ(ReadAllLocked(s, l, head), before[i++]) << "layer " << l << " head " << head;
      }
    }
    // The stream goes on as if the undone append never happened.
    ASSERT_TRUE(s.AppendDense(kv).ok());
    EXPECT_EQ(s.num_tokens(), 85);
  }
}

}  // namespace
}  // namespace kvq
