// Page checksums below the service: the hash, the pool's checksum words,
// sealing full pages, verifying them, the read sampler and removing a
// corrupted sequence from the store.
#include "service/page_checksum.h"

#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "service/sequence_store.h"
#include "tests/service/store_test_data.h"
#include "xxhash.h"

namespace kvq {
namespace {

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kDim = 64;

TEST(PageChecksumTest, IsXxh3OfThePageBytes) {
  // XXH3-64 of the empty input, from the xxHash reference.
  EXPECT_EQ(PageChecksum(nullptr, 0), 0x2D06800538D394C2ull);
  std::vector<uint8_t> page(1024);
  for (size_t i = 0; i < page.size(); ++i) page[i] = static_cast<uint8_t>(i * 7 + 3);
  const uint64_t sum = PageChecksum(page.data(), page.size());
  EXPECT_EQ(sum, XXH3_64bits(page.data(), page.size()));
  EXPECT_NE(sum, 0u);
  // Every single-bit flip of the page changes the checksum.
  for (size_t bit = 0; bit < page.size() * 8; ++bit) {
    page[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    ASSERT_NE(PageChecksum(page.data(), page.size()), sum) << "bit " << bit;
    page[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
  EXPECT_EQ(PageChecksum(page.data(), page.size()), sum);
}

std::unique_ptr<PagePool> MakePool() {
  PagePoolOptions o;
  o.capacity_bytes = 1 << 20;
  o.slab_bytes = 64 << 10;
  absl::StatusOr<std::unique_ptr<PagePool>> pool = PagePool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(*pool);
}

uint64_t SumOf(const PagePool& pool, const uint8_t* block) {
  uint64_t sum = 0;
  pool.GetChecksums({&block, 1}, {&sum, 1});
  return sum;
}

TEST(PagePoolChecksumTest, WordsSitBesideTheBlocksAndClearWhenTheLastReferenceGoes) {
  std::unique_ptr<PagePool> pool = MakePool();
  EXPECT_EQ(pool->Stats().checksum_bytes, 0u);
  uint8_t* a = *pool->Allocate(1000);  // 1024-byte slots: 64 in a 64 KiB slab.
  uint8_t* b = *pool->Allocate(1000);
  EXPECT_EQ(pool->Stats().checksum_bytes, 64u * 8);
  EXPECT_EQ(SumOf(*pool, a), 0u);  // Fresh blocks are unsealed.
  std::memset(a, 0xAB, 1000);       // The block's bytes are not where the word is.
  const uint8_t* blocks[] = {a, b};
  const uint64_t sums[] = {11, 22};
  pool->SetChecksums(blocks, sums);
  EXPECT_EQ(SumOf(*pool, a), 11u);
  EXPECT_EQ(SumOf(*pool, b), 22u);
  EXPECT_EQ(pool->Stats().sealed_blocks, 2u);

  pool->Retain(a, 1000);
  pool->Free(a, 1000);  // One reference left: still sealed.
  EXPECT_EQ(SumOf(*pool, a), 11u);
  pool->Free(a, 1000);
  EXPECT_EQ(pool->Stats().sealed_blocks, 1u);
  uint8_t* again = *pool->Allocate(1000);
  ASSERT_EQ(again, a);  // The freed slot is reused...
  EXPECT_EQ(SumOf(*pool, again), 0u);  // ...unsealed.

  // A block larger than a slab (a run of two) has one word.
  uint8_t* big = *pool->Allocate(100000);
  EXPECT_EQ(pool->Stats().checksum_bytes, 65u * 8);
  const uint8_t* big_block = big;
  const uint64_t big_sum = 33;
  pool->SetChecksums({&big_block, 1}, {&big_sum, 1});
  EXPECT_EQ(SumOf(*pool, big), 33u);
  pool->Free(big, 100000);
  pool->Free(again, 1000);
  pool->Free(b, 1000);
  const PagePoolStats st = pool->Stats();
  EXPECT_EQ(st.checksum_bytes, 0u);
  EXPECT_EQ(st.sealed_blocks, 0u);
}

ModelShape Shape() { return GqaShape(kLayers, kHeads, kDim); }

class SealTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    store_ = NewTestStore(8 << 20);
  }

  SequenceStore::Handle Create(const std::string& id) {
    CreateSequenceArgs a;
    a.ns = "tenant";
    a.id = id;
    a.shape = Shape();
    a.scheme = GetParam();
    absl::StatusOr<SequenceStore::Handle> h = store_->Create(a);
    EXPECT_TRUE(h.ok()) << h.status();
    return std::move(*h);
  }

  // Appends `tokens` random tokens to every layer and seals, as the
  // service's append does.
  void Append(Sequence& seq, int tokens, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n;
    std::vector<float> k(static_cast<size_t>(kLayers) * kHeads * tokens * kDim), v(k.size());
    for (float& x : k) x = n(rng);
    for (float& x : v) x = n(rng);
    absl::MutexLock lock(&seq.mu());
    ASSERT_TRUE(seq.AppendDense(DenseKv{0, kLayers, tokens, DType::kFloat32,
                                        reinterpret_cast<const uint8_t*>(k.data()),
                                        reinterpret_cast<const uint8_t*>(v.data())})
                    .ok());
    SealFullPages(seq, store_->pool(), 0, kLayers);
  }

  // Every full page carries its checksum; a partial page none.
  void ExpectSealedExactlyTheFullPages(const Sequence& seq) {
    for (int l = 0; l < kLayers; ++l) {
      for (int h = 0; h < kHeads; ++h) {
        const KvStream& s = seq.stream(l, h);
        const int full = s.quantized_tokens() / s.layout().page_tokens;
        for (int i = 0; i < s.num_pages(); ++i) {
          const uint64_t sum = SumOf(store_->pool(), s.page(i));
          if (i < full) {
            EXPECT_EQ(sum, PageChecksum(s.page(i), s.layout().page_bytes)) << l << h << i;
          } else {
            EXPECT_EQ(sum, 0u) << "partial page " << i;
          }
        }
      }
    }
  }

  std::unique_ptr<SequenceStore> store_;
};

TEST_P(SealTest, SealsEveryFullPageOnceAndNothingElse) {
  SequenceStore::Handle seq = Create("a");
  Append(*seq, 300, 1);
  const KvStream& s = seq->stream(0, 0);
  const int full = s.quantized_tokens() / s.layout().page_tokens;
  ASSERT_GE(full, 2);
  ExpectSealedExactlyTheFullPages(*seq);
  EXPECT_EQ(store_->pool().Stats().sealed_blocks, static_cast<size_t>(full) * kLayers * kHeads);
  // More tokens seal the newly full pages, leaving the earlier sums as they were.
  const uint64_t first = SumOf(store_->pool(), s.page(0));
  Append(*seq, 200, 2);
  ExpectSealedExactlyTheFullPages(*seq);
  EXPECT_EQ(SumOf(store_->pool(), s.page(0)), first);
}

TEST_P(SealTest, AFlippedBitInASealedPageIsDataLossNamingTheSequenceLayerHeadAndPage) {
  SequenceStore::Handle seq = Create("a");
  Append(*seq, 300, 3);
  absl::ReaderMutexLock lock(&seq->mu());
  const KvStream& s = seq->stream(1, 1);
  const int pt = s.layout().page_tokens;
  const int base = s.page_base();
  ASSERT_TRUE(VerifyPages(*seq, store_->pool(), 1, 0, seq->layer_tokens(1)).ok());
  uint8_t* page = const_cast<uint8_t*>(s.page(1));
  page[s.layout().value.codes_offset + 5] ^= 0x10;
  const absl::Status st = VerifyPages(*seq, store_->pool(), 1, 0, seq->layer_tokens(1));
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(),
            absl::StrCat("page checksum mismatch in sequence \"a\" in namespace \"tenant\" layer 1 "
                         "kv_head 1 page 1 (tokens [", base + pt, ", ", base + 2 * pt,
                         ")): the sequence is removed; append it again"));
  // A read that does not cover the page, or another layer, does not see it.
  EXPECT_TRUE(VerifyPages(*seq, store_->pool(), 1, 0, base + pt).ok());
  EXPECT_TRUE(VerifyPages(*seq, store_->pool(), 1, base + 2 * pt, seq->layer_tokens(1)).ok());
  EXPECT_TRUE(VerifyPages(*seq, store_->pool(), 0, 0, seq->layer_tokens(0)).ok());
  // One token of the page is enough.
  EXPECT_EQ(VerifyPages(*seq, store_->pool(), 1, base + 2 * pt - 1, base + 2 * pt).code(),
            absl::StatusCode::kDataLoss);
  page[s.layout().value.codes_offset + 5] ^= 0x10;
  EXPECT_TRUE(VerifyPages(*seq, store_->pool(), 1, 0, seq->layer_tokens(1)).ok());
}

TEST_P(SealTest, ForksShareTheSealedPagesAndTheirChecksums) {
  SequenceStore::Handle seq = Create("a");
  Append(*seq, 300, 4);
  absl::StatusOr<SequenceStore::Handle> fork = store_->Fork("tenant", "a", "b", 0, absl::ZeroDuration());
  ASSERT_TRUE(fork.ok()) << fork.status();
  absl::ReaderMutexLock lock(&seq->mu());
  absl::ReaderMutexLock fork_lock(&(*fork)->mu());
  ASSERT_EQ((*fork)->stream(0, 0).page(0), seq->stream(0, 0).page(0));
  uint8_t* page = const_cast<uint8_t*>(seq->stream(0, 0).page(0));
  page[0] ^= 1;
  EXPECT_EQ(VerifyPages(**fork, store_->pool(), 0, 0, 300).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(VerifyPages(*seq, store_->pool(), 0, 0, 300).code(), absl::StatusCode::kDataLoss);
  page[0] ^= 1;
}

// kivi2 fills pages a 128-token flush at a time (no partial page); int8
// one token at a time, so the last page is partial and unsealed.
INSTANTIATE_TEST_SUITE_P(Schemes, SealTest, ::testing::Values("kivi2", "int8"));

TEST(PartialPageTest, IsNotProtected) {
  std::unique_ptr<SequenceStore> store = NewTestStore(8 << 20);
  CreateSequenceArgs a;
  a.id = "p";
  a.shape = Shape();
  a.scheme = "int8";
  SequenceStore::Handle seq = std::move(*store->Create(a));
  std::vector<float> kv(static_cast<size_t>(kLayers) * kHeads * 40 * kDim, 0.5f);
  absl::MutexLock lock(&seq->mu());
  ASSERT_TRUE(seq->AppendDense(DenseKv{0, kLayers, 40, DType::kFloat32,
                                       reinterpret_cast<const uint8_t*>(kv.data()),
                                       reinterpret_cast<const uint8_t*>(kv.data())})
                  .ok());
  SealFullPages(*seq, store->pool(), 0, kLayers);
  const KvStream& s = seq->stream(0, 0);
  ASSERT_EQ(s.num_pages(), 2);  // 32 + 8 tokens.
  const_cast<uint8_t*>(s.page(1))[0] ^= 1;
  EXPECT_TRUE(VerifyPages(*seq, store->pool(), 0, 0, 40).ok());
  const_cast<uint8_t*>(s.page(0))[0] ^= 1;
  EXPECT_EQ(VerifyPages(*seq, store->pool(), 0, 0, 40).code(), absl::StatusCode::kDataLoss);
}

TEST(VerifySamplerTest, VerifiesAnEvenlySpreadDeterministicShareOfReads) {
  VerifySampler all(1.0), none(0.0), quarter(0.25), third(1.0 / 3);
  int a = 0, n = 0, q = 0, t = 0;
  std::vector<int> quarter_reads;
  for (int i = 0; i < 120; ++i) {
    a += all.Next();
    n += none.Next();
    if (quarter.Next()) {
      ++q;
      quarter_reads.push_back(i);
    }
    t += third.Next();
  }
  EXPECT_EQ(a, 120);
  EXPECT_EQ(n, 0);
  EXPECT_EQ(q, 30);
  EXPECT_EQ(t, 40);
  EXPECT_EQ(std::vector<int>(quarter_reads.begin(), quarter_reads.begin() + 3),
            (std::vector<int>{3, 7, 11}));
}

TEST(RemoveCorruptedTest, TheSequenceLeavesTheStoreAndSaysWhy) {
  // Evicting: released sequences would stay as prefix cache.
  std::unique_ptr<SequenceStore> store = NewTestStore(8 << 20, /*evict_when_full=*/true);
  CreateSequenceArgs a;
  a.ns = "t";
  a.id = "x";
  a.shape = Shape();
  a.scheme = "kivi2";
  const size_t before = store->pool().Stats().used_bytes;
  {
    SequenceStore::Handle seq = std::move(*store->Create(a));
    EXPECT_TRUE(store->RemoveCorrupted(*seq));
    EXPECT_FALSE(store->RemoveCorrupted(*seq));  // Already gone.
  }
  EXPECT_EQ(store->pool().Stats().used_bytes, before);  // Freed with the last handle.
  EXPECT_EQ(store->Stats().cached_sequences, 0);
  const absl::StatusOr<SequenceStore::Handle> gone = store->Get("t", "x");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(),
            "sequence \"x\" in namespace \"t\" was removed: a page failed its checksum; append "
            "it again");
}

}  // namespace
}  // namespace kvq
