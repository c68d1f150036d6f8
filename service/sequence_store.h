// SequenceStore: every sequence of a server, their leases, eviction and the
// prefix-reuse registry, over one PagePool.
//
// Thread-safety: all methods are thread-safe. Lock order: a sequence's mutex
// may be held while calling into the store (eviction under allocation
// pressure), never the other way round; the store never locks a sequence
// that a caller could hold (it evicts only sequences no call is using).
#ifndef KVQ_SERVICE_SEQUENCE_STORE_H_
#define KVQ_SERVICE_SEQUENCE_STORE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/page_pool.h"
#include "service/sequence.h"
#include "service/tenant_pages.h"

namespace kvq {

struct StoreOptions {
  PagePoolOptions pool;
  absl::Duration default_ttl = absl::Minutes(10);
  absl::Duration max_ttl = absl::Hours(24);  // A longer lease asked for is capped to it.
  // When the pool is full, evict released (prefix-cache) and then idle
  // sequences, least recently used first, instead of failing.
  bool evict_when_full = false;
  int max_sequences = 100000;
  // Evicted / expired ids remembered to answer NOT_FOUND with the reason.
  int tombstones = 100000;
  // Where the default tenant's pages come from instead of the pool (the
  // device page pool when serving from a GPU), made once by Create(). The
  // pool is passed in and then holds the streams' host blocks (fp16 sink
  // and tail: PageAllocator::AllocateHost). Tenants' pages stay in the pool.
  std::function<absl::StatusOr<std::shared_ptr<PageAllocator>>(PagePool* pool)> make_pages;
};

// Why a sequence left the store (for NOT_FOUND messages and metrics).
// kCorrupted: a page failed its checksum (service/page_checksum.h).
enum class GoneReason { kReleased, kExpired, kEvicted, kCorrupted };
absl::string_view GoneReasonName(GoneReason r);

// Tenants: every key, tombstone, prefix-registry entry and generated id is
// per tenant, so a tenant cannot tell another tenant's sequence from one
// that never existed. The empty tenant is the default one (no tokens file);
// its sequences draw from the pool directly, every other tenant's through
// its TenantPages (quota and used bytes).
struct CreateSequenceArgs {
  std::string tenant;
  std::string ns;
  std::string id;  // Empty: generated.
  ModelShape shape;
  std::string scheme;
  absl::Duration ttl = absl::ZeroDuration();  // Zero: default; capped to max_ttl.
  std::vector<Codebook> codebooks;
  // crq schemes: the calibration CreateSequenceRequest.calibration names
  // (service/calibrations.h), shared with the sequence.
  std::shared_ptr<const CalibrationFile> calibration;
  std::vector<int32_t> prompt_token_ids;
};

struct StoreStats {
  PagePoolStats pool;
  int64_t sequences = 0;        // Live (not released) sequences.
  int64_t cached_sequences = 0; // Released, kept as prefix cache.
  int64_t prefix_entries = 0;   // Registered prefix blocks (some of gone sequences).
  ByteBreakdown bytes;          // Referenced bytes of live sequences by component.
  // Tokens stored per canonical scheme (live sequences).
  absl::flat_hash_map<std::string, int64_t> tokens_by_scheme;
  // fp16 bytes the stored tokens would take (for the compression ratio).
  int64_t fp16_equivalent_bytes = 0;
};

// Counters the metrics layer exports.
struct StoreEvents {
  std::function<void(GoneReason)> on_gone;
  std::function<void(int tokens)> on_prefix_hit;
};

class SequenceStore {
 public:
  static absl::StatusOr<std::unique_ptr<SequenceStore>> Create(const StoreOptions& options,
                                                               const KernelBackend* backend);
  ~SequenceStore();

  void set_events(StoreEvents events) { events_ = std::move(events); }

  // A sequence in use by one call: keeps it from expiring or being evicted.
  class Handle {
   public:
    Handle() = default;
    Handle(SequenceStore* store, std::shared_ptr<Sequence> seq);
    Handle(Handle&& o) noexcept;
    Handle& operator=(Handle&& o) noexcept;
    ~Handle();
    Sequence* operator->() const { return seq_.get(); }
    Sequence& operator*() const { return *seq_; }
    const std::shared_ptr<Sequence>& shared() const { return seq_; }

   private:
    SequenceStore* store_ = nullptr;
    std::shared_ptr<Sequence> seq_;
  };

  // ALREADY_EXISTS, INVALID_ARGUMENT (scheme, layout, codebooks),
  // RESOURCE_EXHAUSTED. The handle's sequence may start with a reused prefix.
  absl::StatusOr<Handle> Create(const CreateSequenceArgs& args);
  // Read-only: the prompt tokens (whole blocks, with the sink) that Create
  // with `args` would reuse now, 0 if none; `block_tokens` gets the reuse
  // granularity. Validates like Create (INVALID_ARGUMENT) but allocates
  // nothing from the pool, forks nothing and touches no lease, prefix entry
  // or counter. Only `args.tenant`'s prefixes count.
  absl::StatusOr<int> MatchPrefix(const CreateSequenceArgs& args, int* block_tokens);
  // NOT_FOUND naming whether the id was never known, released, expired or
  // evicted. Refreshes the lease.
  absl::StatusOr<Handle> Get(absl::string_view ns, absl::string_view id,
                             absl::string_view tenant = {});
  // OK while `seq` (a handle's) is the live sequence of its key; else the
  // NOT_FOUND that Get would answer (released, removed as corrupted). Lock
  // order allows calling it with the sequence locked.
  absl::Status CheckLive(const Sequence& seq) const;
  // Removes the sequence; returns the bytes it referenced. With eviction
  // enabled its pages stay as prefix cache until evicted.
  absl::StatusOr<int64_t> Release(absl::string_view ns, absl::string_view id,
                                  absl::string_view tenant = {});
  absl::StatusOr<Handle> Fork(absl::string_view ns, absl::string_view source,
                              absl::string_view new_id, int tokens, absl::Duration ttl,
                              absl::string_view tenant = {});

  // Runs `fn` (which allocates from the pool while the caller holds the
  // sequence's lock); on RESOURCE_EXHAUSTED with eviction enabled, evicts
  // and retries. `fn` must be all-or-nothing.
  absl::Status WithEviction(const Sequence* user, const std::function<absl::Status()>& fn);

  // Registers blocks that became complete (call with the sequence locked).
  void RegisterPrefixBlocks(const std::shared_ptr<Sequence>& seq);

  // Removes `seq` after one of its pages failed its checksum: it leaves the
  // store and the prefix registry (nothing reuses its pages), never stays
  // as prefix cache, and later calls get NOT_FOUND saying why. Its pages
  // are freed when the last call using it ends. False if it had already
  // left the store.
  bool RemoveCorrupted(const Sequence& seq);

  // Drops sequences whose lease ran out; returns how many.
  int ExpireIdle(absl::Time now);

  StoreStats Stats() const;
  // The figures of one tenant's sequences only; `pool` holds the tenant's
  // quota as capacity_bytes (0: none) and its used bytes, nothing else.
  StoreStats TenantStats(absl::string_view tenant) const;

  // Quota of a (non-default) tenant in bytes, 0 for none; applies to the
  // next allocation.
  void SetTenantQuota(absl::string_view tenant, int64_t quota_bytes);
  struct TenantUsage {
    std::string tenant;
    int64_t used_bytes = 0;
    int64_t quota_bytes = 0;
  };
  // Every tenant that has stored something since start-up.
  std::vector<TenantUsage> TenantUsages() const;
  // The owner of `allocator` (a sequence's streams' allocator) as a
  // shared_ptr, for readers that keep its pages referenced (raw fetch
  // messages); null when the store does not know it.
  std::shared_ptr<PageAllocator> SharedAllocator(const PageAllocator* allocator) const;
  PagePool& pool() { return *pool_; }
  // The default tenant's page allocator: StoreOptions::make_pages' or the pool.
  PageAllocator* pages() const { return pages_ ? pages_.get() : pool_.get(); }
  // The pool, for a reader that keeps pages past the store's lifetime
  // (FetchDequant's messages hold references until gRPC drops them, which
  // may be after the server and the store are gone).
  const std::shared_ptr<PagePool>& shared_pool() const { return pool_; }
  const KernelBackend* backend() const { return backend_; }
  const StoreOptions& options() const { return options_; }

 private:
  struct Entry {
    std::shared_ptr<Sequence> seq;
  };
  SequenceStore(const StoreOptions& options, const KernelBackend* backend,
                std::unique_ptr<PagePool> pool);
  static std::string Key(absl::string_view tenant, absl::string_view ns, absl::string_view id);
  // The pool for the default tenant, else the tenant's TenantPages.
  PageAllocator* PagesFor(absl::string_view tenant);
  std::shared_ptr<TenantPages> TenantPagesFor(absl::string_view tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stats of every sequence, or only `tenant`'s (pool figures left empty).
  StoreStats CollectStats(const absl::string_view* tenant) const;
  // Evicts `tenant`'s oldest released (prefix-cache) sequence; false if it
  // has none.
  bool EvictCachedOf(absl::string_view tenant);
  void Unuse(Sequence* seq);
  // NOT_FOUND for `key`, naming why it is gone when a tombstone says.
  absl::Status GoneError(const std::string& key, absl::string_view ns, absl::string_view id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Tombstone(const std::string& key, GoneReason reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts one sequence other than `keep`; false if none is evictable.
  bool EvictOne(const Sequence* keep);
  // Prefix registry.
  uint64_t Fingerprint(const Sequence& seq) const;
  absl::StatusOr<std::unique_ptr<Sequence>> ReusePrefix(const CreateSequenceArgs& args,
                                                        const Sequence& fresh);
  // The live sequence registered under prefix `hash` and its length in
  // `tokens`; null when none or gone (a gone entry is erased if `drop_dead`).
  std::shared_ptr<Sequence> RegisteredPrefix(uint64_t hash, bool drop_dead, int* tokens);
  // The stream config Create and MatchPrefix build from `args` (namespace,
  // scheme, layout): INVALID_ARGUMENT naming the field.
  absl::StatusOr<StreamConfig> ConfigFor(const CreateSequenceArgs& args) const;
  // Whether `source` (locked by the caller) holds `tokens` tokens equal to
  // the start of `ids`, committed, for `fresh`'s tenant and calibration
  // (name and checksum): never serve wrong KV on a hash collision or from a
  // source that changed since it registered.
  static bool ServesPrefix(Sequence& source, const Sequence& fresh, int tokens,
                           absl::Span<const int32_t> ids);

  const StoreOptions options_;
  const KernelBackend* backend_;
  std::shared_ptr<PagePool> pool_;
  // StoreOptions::make_pages' allocator (null: the pool); after pool_, so
  // that it goes first (it draws host blocks from the pool).
  std::shared_ptr<PageAllocator> pages_;
  StoreEvents events_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> live_ ABSL_GUARDED_BY(mu_);
  // Released sequences kept as prefix cache (eviction enabled), oldest first.
  std::deque<std::shared_ptr<Sequence>> cached_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, GoneReason> gone_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> gone_order_ ABSL_GUARDED_BY(mu_);
  struct PrefixEntry {
    std::weak_ptr<Sequence> seq;
    int tokens = 0;
  };
  absl::flat_hash_map<uint64_t, PrefixEntry> prefixes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<const Sequence*, int> registered_blocks_ ABSL_GUARDED_BY(mu_);
  // prefixes_ is swept of entries whose sequence is gone once it grows past
  // this (then set to twice what is left, at least kMinPrefixSweep): a
  // registered block is otherwise dropped only when a lookup finds it dead,
  // and prompts that are never repeated would grow the map without bound.
  static constexpr size_t kMinPrefixSweep = 1024;
  size_t prefix_sweep_at_ ABSL_GUARDED_BY(mu_) = kMinPrefixSweep;
  // Chain hashes of the blocks of `ids` under `seq`'s namespace, layout and
  // scheme: hash k covers tokens [0, sink + k * block).
  std::vector<uint64_t> ChainHashes(const Sequence& seq, absl::Span<const int32_t> ids) const;
  // Per tenant, so that generated ids say nothing about other tenants.
  absl::flat_hash_map<std::string, uint64_t> next_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<TenantPages>> tenant_pages_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvq

#endif  // KVQ_SERVICE_SEQUENCE_STORE_H_
