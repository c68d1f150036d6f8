#include "service/sequence_store.h"

#include <algorithm>
#include <random>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/quoted.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

absl::Status CheckName(absl::string_view field, absl::string_view name, bool allow_empty) {
  if (name.empty() && allow_empty) return absl::OkStatus();
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must have 1 to 128 characters, got ", name.size()));
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == ':')) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " may hold only letters, digits and - _ . :"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view GoneReasonName(GoneReason r) {
  switch (r) {
    case GoneReason::kReleased: return "released";
    case GoneReason::kExpired: return "expired";
    case GoneReason::kEvicted: return "evicted";
    case GoneReason::kCorrupted: return "corrupted";
  }
  return "gone";
}

// ------------------------------------------------------------------ Handle

SequenceStore::Handle::Handle(SequenceStore* store, std::shared_ptr<Sequence> seq)
    : store_(store), seq_(std::move(seq)) {}

SequenceStore::Handle::Handle(Handle&& o) noexcept
    : store_(std::exchange(o.store_, nullptr)), seq_(std::move(o.seq_)) {}

SequenceStore::Handle& SequenceStore::Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    if (store_ != nullptr && seq_) store_->Unuse(seq_.get());
    store_ = std::exchange(o.store_, nullptr);
    seq_ = std::move(o.seq_);
  }
  return *this;
}

SequenceStore::Handle::~Handle() {
  if (store_ != nullptr && seq_) store_->Unuse(seq_.get());
}

// ------------------------------------------------------------------- Store

absl::StatusOr<std::unique_ptr<SequenceStore>> SequenceStore::Create(const StoreOptions& options,
                                                                     const KernelBackend* backend) {
  KVQ_ASSIGN_OR_RETURN(std::unique_ptr<PagePool> pool, PagePool::Create(options.pool));
  std::unique_ptr<SequenceStore> store(new SequenceStore(options, backend, std::move(pool)));
  if (options.make_pages) {
    KVQ_ASSIGN_OR_RETURN(store->pages_, options.make_pages(store->pool_.get()));
  }
  return store;
}

SequenceStore::SequenceStore(const StoreOptions& options, const KernelBackend* backend,
                             std::unique_ptr<PagePool> pool)
    : options_(options), backend_(backend), pool_(std::move(pool)) {}

SequenceStore::~SequenceStore() {
  // Sequences free their pages into the pool: drop them before the pool.
  absl::MutexLock lock(&mu_);
  live_.clear();
  cached_.clear();
}

std::string SequenceStore::Key(absl::string_view tenant, absl::string_view ns,
                               absl::string_view id) {
  // Names hold no '/' (CheckName, tokens file), so the key is unambiguous.
  return absl::StrCat(tenant, "/", ns, "/", id);
}

std::shared_ptr<TenantPages> SequenceStore::TenantPagesFor(absl::string_view tenant) {
  std::shared_ptr<TenantPages>& p = tenant_pages_[tenant];
  if (p == nullptr) p = std::make_shared<TenantPages>(std::string(tenant), pool_);
  return p;
}

PageAllocator* SequenceStore::PagesFor(absl::string_view tenant) {
  if (tenant.empty()) return pages();
  absl::MutexLock lock(&mu_);
  return TenantPagesFor(tenant).get();  // Kept by tenant_pages_ for the store's life.
}

void SequenceStore::SetTenantQuota(absl::string_view tenant, int64_t quota_bytes) {
  if (tenant.empty()) return;
  absl::MutexLock lock(&mu_);
  TenantPagesFor(tenant)->set_quota_bytes(quota_bytes);
}

std::vector<SequenceStore::TenantUsage> SequenceStore::TenantUsages() const {
  absl::MutexLock lock(&mu_);
  std::vector<TenantUsage> out;
  for (const auto& [name, p] : tenant_pages_) {
    out.push_back({name, p->used_bytes(), p->quota_bytes()});
  }
  std::sort(out.begin(), out.end(),
            [](const TenantUsage& a, const TenantUsage& b) { return a.tenant < b.tenant; });
  return out;
}

std::shared_ptr<PageAllocator> SequenceStore::SharedAllocator(const PageAllocator* a) const {
  if (a == pool_.get()) return pool_;
  if (pages_ != nullptr && a == pages_.get()) return pages_;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, p] : tenant_pages_) {
    if (p.get() == a) return p;
  }
  return nullptr;
}

void SequenceStore::Unuse(Sequence* seq) {
  absl::MutexLock lock(&mu_);
  --seq->active_calls;
  seq->last_used = absl::Now();
}

void SequenceStore::Tombstone(const std::string& key, GoneReason reason) {
  if (gone_.insert_or_assign(key, reason).second) gone_order_.push_back(key);
  while (static_cast<int>(gone_order_.size()) > options_.tombstones) {
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
  if (events_.on_gone) events_.on_gone(reason);
}

absl::StatusOr<StreamConfig> SequenceStore::ConfigFor(const CreateSequenceArgs& args) const {
  KVQ_RETURN_IF_ERROR(CheckName("namespace", args.ns, /*allow_empty=*/true));
  KVQ_ASSIGN_OR_RETURN(QuantSpec spec, QuantSpec::Parse(args.scheme));
  KVQ_RETURN_IF_ERROR(args.shape.Validate());
  StreamConfig config;
  config.spec = spec;
  config.head_dim = args.shape.head_dim;
  config.rope = args.shape.rope;
  if (absl::Status st = config.Validate(); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("scheme ", Quoted(args.scheme),
                                                   " with head_dim ", args.shape.head_dim, ": ",
                                                   st.message()));
  }
  return config;
}

absl::StatusOr<SequenceStore::Handle> SequenceStore::Create(const CreateSequenceArgs& args) {
  KVQ_RETURN_IF_ERROR(CheckName("sequence_id", args.id, /*allow_empty=*/true));
  KVQ_ASSIGN_OR_RETURN(StreamConfig config, ConfigFor(args));
  if (args.ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl_seconds = ", absl::ToInt64Seconds(args.ttl), " must be >= 0"));
  }
  std::string id = args.id;
  {
    absl::MutexLock lock(&mu_);
    if (!id.empty() && live_.contains(Key(args.tenant, args.ns, id))) {
      return absl::AlreadyExistsError(
          absl::StrCat(DescribeSequence(args.ns, id), " already exists"));
    }
    if (static_cast<int>(live_.size()) >= options_.max_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the server holds its maximum of ", options_.max_sequences, " sequences"));
    }
    if (id.empty()) {
      static thread_local std::mt19937_64 rng(std::random_device{}());
      id = absl::StrFormat("seq-%d-%016x", ++next_id_[args.tenant], rng());
    }
  }
  std::unique_ptr<Sequence> seq;
  PageAllocator* pages = PagesFor(args.tenant);
  KVQ_RETURN_IF_ERROR(WithEviction(nullptr, [&]() -> absl::Status {
    KVQ_ASSIGN_OR_RETURN(seq, Sequence::Create(args.ns, id, args.shape, config, args.codebooks,
                                               backend_, pages, args.calibration));
    return absl::OkStatus();
  }));
  seq->tenant = args.tenant;
  if (!args.prompt_token_ids.empty()) {
    absl::StatusOr<std::unique_ptr<Sequence>> reused = ReusePrefix(args, *seq);
    if (reused.ok() && *reused != nullptr) {
      seq = std::move(*reused);
      seq->tenant = args.tenant;
    }
  }
  // A lease above the maximum is capped to it, as the proto promises; the
  // response reports the lease granted.
  seq->ttl = args.ttl == absl::ZeroDuration() ? options_.default_ttl
                                              : std::min(args.ttl, options_.max_ttl);
  seq->last_used = absl::Now();
  std::shared_ptr<Sequence> shared(std::move(seq));
  absl::MutexLock lock(&mu_);
  const std::string key = Key(args.tenant, args.ns, id);
  if (live_.contains(key)) {
    return absl::AlreadyExistsError(absl::StrCat(DescribeSequence(args.ns, id), " already exists"));
  }
  gone_.erase(key);
  live_[key] = Entry{shared};
  ++shared->active_calls;
  return Handle(this, shared);
}

absl::Status SequenceStore::GoneError(const std::string& key, absl::string_view ns,
                                      absl::string_view id) const {
  if (auto g = gone_.find(key); g != gone_.end()) {
    switch (g->second) {
      case GoneReason::kEvicted:
        return absl::NotFoundError(
            absl::StrCat(DescribeSequence(ns, id), " was evicted to free memory; recompute it"));
      case GoneReason::kExpired:
        return absl::NotFoundError(
            absl::StrCat(DescribeSequence(ns, id), " expired: its lease ran out while idle"));
      case GoneReason::kReleased:
        return absl::NotFoundError(absl::StrCat(DescribeSequence(ns, id), " was released"));
      case GoneReason::kCorrupted:
        return absl::NotFoundError(absl::StrCat(
            DescribeSequence(ns, id), " was removed: a page failed its checksum; append it again"));
    }
  }
  return absl::NotFoundError(absl::StrCat(DescribeSequence(ns, id), " does not exist"));
}

absl::Status SequenceStore::CheckLive(const Sequence& seq) const {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(seq.tenant, seq.ns(), seq.id());
  auto it = live_.find(key);
  if (it != live_.end() && it->second.seq.get() == &seq) return absl::OkStatus();
  if (it != live_.end()) {  // Released, then created again under the same id.
    return absl::NotFoundError(absl::StrCat(DescribeSequence(seq.ns(), seq.id()), " was released"));
  }
  return GoneError(key, seq.ns(), seq.id());
}

absl::StatusOr<SequenceStore::Handle> SequenceStore::Get(absl::string_view ns, absl::string_view id,
                                                         absl::string_view tenant) {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(tenant, ns, id);
  auto it = live_.find(key);
  if (it == live_.end()) return GoneError(key, ns, id);
  std::shared_ptr<Sequence> seq = it->second.seq;
  ++seq->active_calls;
  seq->last_used = absl::Now();
  return Handle(this, std::move(seq));
}

absl::StatusOr<int64_t> SequenceStore::Release(absl::string_view ns, absl::string_view id,
                                               absl::string_view tenant) {
  std::shared_ptr<Sequence> seq;
  {
    absl::MutexLock lock(&mu_);
    const std::string key = Key(tenant, ns, id);
    auto it = live_.find(key);
    if (it == live_.end()) {
      if (gone_.contains(key)) {
        return absl::NotFoundError(
            absl::StrCat(DescribeSequence(ns, id), " was already ", GoneReasonName(gone_[key])));
      }
      return absl::NotFoundError(absl::StrCat(DescribeSequence(ns, id), " does not exist"));
    }
    seq = std::move(it->second.seq);
    live_.erase(it);
    Tombstone(key, GoneReason::kReleased);
    seq->released = true;
    seq->last_used = absl::Now();
    if (options_.evict_when_full && registered_blocks_.contains(seq.get())) {
      cached_.push_back(seq);  // Its blocks stay reusable until evicted.
    } else {
      registered_blocks_.erase(seq.get());
    }
  }
  absl::ReaderMutexLock lock(&seq->mu());
  return static_cast<int64_t>(seq->Bytes().total());
}

absl::StatusOr<SequenceStore::Handle> SequenceStore::Fork(absl::string_view ns,
                                                          absl::string_view source,
                                                          absl::string_view new_id, int tokens,
                                                          absl::Duration ttl,
                                                          absl::string_view tenant) {
  KVQ_RETURN_IF_ERROR(CheckName("new_sequence_id", new_id, /*allow_empty=*/true));
  if (ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl_seconds = ", absl::ToInt64Seconds(ttl), " must be >= 0"));
  }
  KVQ_ASSIGN_OR_RETURN(Handle src, Get(ns, source, tenant));
  std::string id(new_id);
  {
    absl::MutexLock lock(&mu_);
    if (id.empty()) id = absl::StrFormat("seq-%d-fork", ++next_id_[tenant]);
    if (live_.contains(Key(tenant, ns, id))) {
      return absl::AlreadyExistsError(absl::StrCat(DescribeSequence(ns, id), " already exists"));
    }
  }
  std::unique_ptr<Sequence> fork;
  {
    // A fork sees what a read would: the committed tokens, without those
    // of an append stream still open on the source.
    absl::MutexLock lock(&src->mu());
    const int committed = src->committed_num_tokens();
    const int n = tokens == 0 ? committed : tokens;
    if (n < 0 || n > committed) {
      return absl::OutOfRangeError(
          absl::StrCat("num_tokens = ", tokens, " is not in [0, ", committed, "]"));
    }
    KVQ_RETURN_IF_ERROR(WithEviction(&*src, [&]() -> absl::Status {
      KVQ_ASSIGN_OR_RETURN(fork, src->Fork(std::string(ns), id, n));
      return absl::OkStatus();
    }));
  }
  fork->ttl = ttl == absl::ZeroDuration() ? src->ttl : std::min(ttl, options_.max_ttl);
  fork->last_used = absl::Now();
  fork->tenant = std::string(tenant);
  std::shared_ptr<Sequence> shared(std::move(fork));
  absl::MutexLock lock(&mu_);
  const std::string key = Key(tenant, ns, id);
  if (live_.contains(key)) {
    return absl::AlreadyExistsError(absl::StrCat(DescribeSequence(ns, id), " already exists"));
  }
  gone_.erase(key);
  live_[key] = Entry{shared};
  ++shared->active_calls;
  return Handle(this, shared);
}

absl::Status SequenceStore::WithEviction(const Sequence* user,
                                         const std::function<absl::Status()>& fn) {
  while (true) {
    absl::Status st = fn();
    if (st.code() != absl::StatusCode::kResourceExhausted || !options_.evict_when_full) return st;
    // A tenant over its quota frees only its own prefix cache; another
    // tenant's sequences are not its to evict.
    if (std::optional<std::string> tenant = QuotaTenant(st)) {
      if (!EvictCachedOf(*tenant)) return st;
    } else if (!EvictOne(user)) {
      return st;
    }
  }
}

bool SequenceStore::EvictOne(const Sequence* keep) {
  std::shared_ptr<Sequence> victim;
  {
    absl::MutexLock lock(&mu_);
    if (!cached_.empty()) {
      victim = std::move(cached_.front());
      cached_.pop_front();
      registered_blocks_.erase(victim.get());
      if (events_.on_gone) events_.on_gone(GoneReason::kEvicted);
    } else {
      auto best = live_.end();
      for (auto it = live_.begin(); it != live_.end(); ++it) {
        const Sequence* s = it->second.seq.get();
        if (s == keep || s->active_calls > 0) continue;
        if (best == live_.end() || s->last_used < best->second.seq->last_used) best = it;
      }
      if (best == live_.end()) return false;
      victim = std::move(best->second.seq);
      const std::string key = best->first;
      live_.erase(best);
      registered_blocks_.erase(victim.get());
      Tombstone(key, GoneReason::kEvicted);
    }
  }
  return true;  // `victim` frees its pages here, outside the store lock.
}

bool SequenceStore::RemoveCorrupted(const Sequence& seq) {
  std::shared_ptr<Sequence> victim;  // Freed outside the store lock.
  absl::MutexLock lock(&mu_);
  const std::string key = Key(seq.tenant, seq.ns(), seq.id());
  auto it = live_.find(key);
  if (it != live_.end() && it->second.seq.get() == &seq) {
    victim = std::move(it->second.seq);
    live_.erase(it);
    Tombstone(key, GoneReason::kCorrupted);
  }
  for (auto c = cached_.begin(); c != cached_.end(); ++c) {
    if (c->get() == &seq) {
      victim = std::move(*c);
      cached_.erase(c);
      break;
    }
  }
  registered_blocks_.erase(&seq);
  for (auto p = prefixes_.begin(); p != prefixes_.end();) {
    const std::shared_ptr<Sequence> s = p->second.seq.lock();
    if (s == nullptr || s.get() == &seq) {
      prefixes_.erase(p++);
    } else {
      ++p;
    }
  }
  if (victim) victim->released = true;
  return victim != nullptr;
}

bool SequenceStore::EvictCachedOf(absl::string_view tenant) {
  std::shared_ptr<Sequence> victim;
  {
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(cached_.begin(), cached_.end(),
                           [&](const std::shared_ptr<Sequence>& s) { return s->tenant == tenant; });
    if (it == cached_.end()) return false;
    victim = std::move(*it);
    cached_.erase(it);
    registered_blocks_.erase(victim.get());
    if (events_.on_gone) events_.on_gone(GoneReason::kEvicted);
  }
  return true;  // `victim` frees its pages here, outside the store lock.
}

int SequenceStore::ExpireIdle(absl::Time now) {
  std::vector<std::shared_ptr<Sequence>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = live_.begin(); it != live_.end();) {
      Sequence* s = it->second.seq.get();
      if (s->active_calls == 0 && now - s->last_used > s->ttl) {
        expired.push_back(std::move(it->second.seq));
        registered_blocks_.erase(s);
        Tombstone(it->first, GoneReason::kExpired);
        live_.erase(it++);
      } else {
        ++it;
      }
    }
    while (!cached_.empty() && now - cached_.front()->last_used > cached_.front()->ttl) {
      registered_blocks_.erase(cached_.front().get());
      if (events_.on_gone) events_.on_gone(GoneReason::kExpired);
      expired.push_back(std::move(cached_.front()));
      cached_.pop_front();
    }
  }
  return static_cast<int>(expired.size());
}

// ----------------------------------------------------------- prefix reuse

uint64_t SequenceStore::Fingerprint(const Sequence& seq) const {
  const ModelShape& m = seq.shape();
  uint64_t h = absl::HashOf(seq.tenant, seq.ns(), seq.config().spec.ToString(), m.num_layers,
                            m.num_kv_heads, m.num_q_heads, m.head_dim, m.rope.theta,
                            m.rope.rotary_dim, static_cast<int>(m.rope.pairing),
                            static_cast<int>(m.rope.scaling), m.rope.factor);
  if (seq.calibration() != nullptr) {
    // Sequences centered and scaled by different statistics store different
    // codes: the name and the version (its file's checksum) must both match.
    h = absl::HashOf(h, seq.calibration()->calibration.name, seq.calibration()->checksum);
  }
  if (seq.config().spec.nuq) {
    // Sequences with different codebooks store different codes.
    for (int l = 0; l < m.num_layers; ++l) {
      for (int head = 0; head < m.num_kv_heads; ++head) {
        const KvStream& s = seq.stream(l, head);
        const int n = 1 << s.spec().bits;
        for (Side side : {Side::kKey, Side::kValue}) {
          h = absl::HashOf(h, absl::string_view(reinterpret_cast<const char*>(s.levels(side, 0)),
                                                static_cast<size_t>(s.head_dim()) * n * 2));
        }
      }
    }
  }
  return h;
}

std::vector<uint64_t> SequenceStore::ChainHashes(const Sequence& seq,
                                                 absl::Span<const int32_t> ids) const {
  std::vector<uint64_t> out;
  const int sink = seq.config().spec.sink;
  const int block = seq.block_tokens();
  uint64_t h = Fingerprint(seq);
  size_t done = 0;
  for (size_t end = sink + block; end <= ids.size(); end += block) {
    h = absl::HashOf(h, absl::string_view(reinterpret_cast<const char*>(ids.data() + done),
                                          (end - done) * sizeof(int32_t)));
    done = end;
    out.push_back(h);
  }
  return out;
}

void SequenceStore::RegisterPrefixBlocks(const std::shared_ptr<Sequence>& seq) {
  const int sink = seq->config().spec.sink;
  const int block = seq->block_tokens();
  const int complete = std::min<int>(seq->num_tokens(), seq->token_ids().size());
  if (complete < sink + block) return;
  std::vector<uint64_t> hashes =
      ChainHashes(*seq, absl::MakeConstSpan(seq->token_ids()).subspan(0, complete));
  absl::MutexLock lock(&mu_);
  int& done = registered_blocks_[seq.get()];
  for (int k = done; k < static_cast<int>(hashes.size()); ++k) {
    PrefixEntry& e = prefixes_[hashes[k]];
    if (e.seq.expired()) e = PrefixEntry{seq, sink + (k + 1) * block};
  }
  done = static_cast<int>(hashes.size());
  if (prefixes_.size() > prefix_sweep_at_) {
    for (auto it = prefixes_.begin(); it != prefixes_.end();) {
      if (it->second.seq.expired()) {
        prefixes_.erase(it++);
      } else {
        ++it;
      }
    }
    prefix_sweep_at_ = std::max(kMinPrefixSweep, 2 * prefixes_.size());
  }
}

std::shared_ptr<Sequence> SequenceStore::RegisteredPrefix(uint64_t hash, bool drop_dead,
                                                          int* tokens) {
  absl::MutexLock lock(&mu_);
  auto it = prefixes_.find(hash);
  if (it == prefixes_.end()) return nullptr;
  std::shared_ptr<Sequence> source = it->second.seq.lock();
  *tokens = it->second.tokens;
  if (!source && drop_dead) prefixes_.erase(it);
  return source;
}

absl::StatusOr<std::unique_ptr<Sequence>> SequenceStore::ReusePrefix(const CreateSequenceArgs& args,
                                                                      const Sequence& fresh) {
  std::vector<uint64_t> hashes = ChainHashes(fresh, args.prompt_token_ids);
  for (int k = static_cast<int>(hashes.size()) - 1; k >= 0; --k) {
    int tokens = 0;
    std::shared_ptr<Sequence> source = RegisteredPrefix(hashes[k], /*drop_dead=*/true, &tokens);
    if (!source) continue;
    absl::MutexLock lock(&source->mu());
    if (!ServesPrefix(*source, fresh, tokens, args.prompt_token_ids)) continue;
    std::unique_ptr<Sequence> fork;
    absl::Status st = WithEviction(source.get(), [&]() -> absl::Status {
      KVQ_ASSIGN_OR_RETURN(fork, source->Fork(fresh.ns(), fresh.id(), tokens));
      return absl::OkStatus();
    });
    if (!st.ok()) return st;
    if (events_.on_prefix_hit) events_.on_prefix_hit(tokens);
    return fork;
  }
  return std::unique_ptr<Sequence>();
}

bool SequenceStore::ServesPrefix(Sequence& source, const Sequence& fresh, int tokens,
                                 absl::Span<const int32_t> ids) {
  const std::vector<int32_t>& stored = source.token_ids();
  const CalibrationFile* a = source.calibration().get();
  const CalibrationFile* b = fresh.calibration().get();
  const bool same_calibration =
      (a == nullptr) == (b == nullptr) &&
      (a == nullptr || (a->calibration.name == b->calibration.name && a->checksum == b->checksum));
  return source.tenant == fresh.tenant && same_calibration && !source.in_transaction() && source.num_tokens() >= tokens &&
         static_cast<int>(stored.size()) >= tokens && static_cast<int>(ids.size()) >= tokens &&
         std::equal(stored.begin(), stored.begin() + tokens, ids.begin());
}

absl::StatusOr<int> SequenceStore::MatchPrefix(const CreateSequenceArgs& args,
                                               int* block_tokens) {
  KVQ_ASSIGN_OR_RETURN(StreamConfig config, ConfigFor(args));
  // A scratch sequence on the heap (not the pool) gives the block size and
  // the fingerprint exactly as Create computes them; it never enters the
  // store.
  KVQ_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> probe,
                       Sequence::Create(args.ns, "", args.shape, config, args.codebooks, backend_,
                                        /*allocator=*/nullptr, args.calibration));
  probe->tenant = args.tenant;
  *block_tokens = probe->block_tokens();
  std::vector<uint64_t> hashes = ChainHashes(*probe, args.prompt_token_ids);
  for (int k = static_cast<int>(hashes.size()) - 1; k >= 0; --k) {
    int tokens = 0;
    // Read-only: a dead entry is left for Create (or the sweep) to drop.
    std::shared_ptr<Sequence> source = RegisteredPrefix(hashes[k], /*drop_dead=*/false, &tokens);
    if (!source) continue;
    absl::ReaderMutexLock lock(&source->mu());
    if (ServesPrefix(*source, *probe, tokens, args.prompt_token_ids)) return tokens;
  }
  return 0;
}

// ------------------------------------------------------------------- stats

StoreStats SequenceStore::Stats() const { return CollectStats(nullptr); }

StoreStats SequenceStore::TenantStats(absl::string_view tenant) const {
  StoreStats st = CollectStats(&tenant);
  st.pool = PagePoolStats();
  absl::MutexLock lock(&mu_);
  if (auto it = tenant_pages_.find(tenant); it != tenant_pages_.end()) {
    st.pool.capacity_bytes = static_cast<size_t>(it->second->quota_bytes());
    st.pool.used_bytes = static_cast<size_t>(it->second->used_bytes());
  }
  return st;
}

StoreStats SequenceStore::CollectStats(const absl::string_view* tenant) const {
  StoreStats st;
  std::vector<std::shared_ptr<Sequence>> live;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, e] : live_) {
      if (tenant == nullptr || e.seq->tenant == *tenant) live.push_back(e.seq);
    }
    for (const auto& c : cached_) {
      if (tenant == nullptr || c->tenant == *tenant) ++st.cached_sequences;
    }
    st.prefix_entries = static_cast<int64_t>(prefixes_.size());
  }
  if (tenant == nullptr) st.pool = pool_->Stats();
  st.sequences = static_cast<int64_t>(live.size());
  for (const auto& seq : live) {
    absl::ReaderMutexLock lock(&seq->mu());
    st.bytes += seq->Bytes();
    const int64_t tokens = seq->committed_num_tokens();
    st.tokens_by_scheme[seq->config().spec.ToString()] += tokens;
    st.fp16_equivalent_bytes += tokens * seq->shape().num_layers * seq->shape().num_kv_heads *
                                seq->shape().head_dim * 2 * 2;
  }
  return st;
}

}  // namespace kvq
