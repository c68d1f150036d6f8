#include "service/page_checksum.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace kvq {
namespace {

// The checksum of page `i` of `s`: hashed in place where the host may
// address it, else copied to a reused host buffer first (device pages).
uint64_t StreamPageChecksum(const KvStream& s, int i) {
  const size_t bytes = s.layout().page_bytes;
  PageAllocator* allocator = s.allocator();
  if (allocator->host_accessible()) return PageChecksum(s.page(i), bytes);
  thread_local std::vector<uint8_t> staged;
  staged.resize(bytes);
  // A page that cannot be read answers 0, which no checksum is: a read
  // that verifies it fails (DATA_LOSS); at seal it stays unsealed.
  if (!allocator->ReadBlock(s.page(i), 0, bytes, staged.data()).ok()) return 0;
  return PageChecksum(staged.data(), bytes);
}

// Where the checksums of `s`'s pages are kept: the pool, or a page
// allocator of its own that keeps them (the device page pool); nullptr
// when nowhere (a tenant's allocator over the pool: not sealed).
PageAllocator* Keeper(const KvStream& s, const PagePool& pool) {
  PageAllocator* a = s.allocator();
  if (a == &pool || a->keeps_checksums()) return a;
  return nullptr;
}

}  // namespace

uint64_t PageChecksum(const uint8_t* page, size_t bytes) {
  const uint64_t h = XXH3_64bits(page, bytes);
  return h == 0 ? 1 : h;
}

void SealFullPages(const Sequence& seq, PagePool& pool, int layer_begin, int layer_end) {
  std::vector<const uint8_t*> blocks;
  std::vector<uint64_t> sums;
  for (int l = layer_begin; l < layer_end; ++l) {
    for (int h = 0; h < seq.shape().num_kv_heads; ++h) {
      const KvStream& s = seq.stream(l, h);
      const int full = s.quantized_tokens() / s.layout().page_tokens;
      PageAllocator* sums_at = Keeper(s, pool);
      if (full == 0 || sums_at == nullptr) continue;
      // Sealed pages are a prefix: find where it ends, from the back.
      const uint8_t* last = s.page(full - 1);
      uint64_t last_sum = 0;
      sums_at->GetChecksums({&last, 1}, {&last_sum, 1});
      if (last_sum != 0) continue;
      blocks.resize(full);
      sums.resize(full);
      for (int i = 0; i < full; ++i) blocks[i] = s.page(i);
      sums_at->GetChecksums(blocks, absl::MakeSpan(sums));
      int first = full;
      while (first > 0 && sums[first - 1] == 0) --first;
      for (int i = first; i < full; ++i) sums[i] = StreamPageChecksum(s, i);
      sums_at->SetChecksums(absl::MakeConstSpan(blocks).subspan(first),
                            absl::MakeConstSpan(sums).subspan(first));
    }
  }
}

void PageReadCheck::Add(const Sequence& seq, int layer, int begin, int end) {
  std::vector<const uint8_t*> blocks;
  for (int h = 0; h < seq.shape().num_kv_heads; ++h) {
    const KvStream& s = seq.committed_stream(layer, h);  // What readers read.
    const PageAllocator* sums_at = Keeper(s, pool_);
    if (sums_at == nullptr) continue;
    const int pt = s.layout().page_tokens;
    const int full = s.quantized_tokens() / pt;
    // Pages are token positions page_base() + [i * pt, (i + 1) * pt).
    int lo = std::max(0, begin - s.page_base());
    int hi = std::min(full * pt, end - s.page_base());
    if (lo >= hi) continue;
    int first = lo / pt;
    int last = (hi + pt - 1) / pt;  // Exclusive; <= full.
    auto [it, added] = streams_.try_emplace(&s);
    Stream& entry = it->second;
    if (added) {
      order_.push_back(&s);
    } else {  // The same stream again (two items of one call): the union.
      last = std::max(last, entry.first + static_cast<int>(entry.want.size()));
      first = std::min(first, entry.first);
    }
    entry.seq = &seq;
    entry.layer = layer;
    entry.head = h;
    entry.first = first;
    blocks.resize(last - first);
    entry.want.resize(last - first);
    for (int i = first; i < last; ++i) blocks[i - first] = s.page(i);
    sums_at->GetChecksums(blocks, absl::MakeSpan(entry.want));
    entry.checked = std::make_unique<std::atomic<bool>[]>(entry.want.size());
  }
}

void PageReadCheck::CheckPage(const KvStream& stream, const Stream& entry, int index) const {
  const int i = index - entry.first;
  if (i < 0 || i >= static_cast<int>(entry.want.size()) || entry.want[i] == 0) return;
  // One reader hashes a page; the others go on (the results of a call with
  // a mismatch are discarded whichever thread finds it).
  if (entry.checked[i].load(std::memory_order_relaxed) ||
      entry.checked[i].exchange(true, std::memory_order_relaxed)) {
    return;
  }
  if (StreamPageChecksum(stream, index) == entry.want[i]) return;
  absl::MutexLock lock(&mu_);
  if (failed_ != nullptr) return;
  failed_ = entry.seq;
  any_failed_.store(true, std::memory_order_release);
  const int pt = stream.layout().page_tokens;
  const int t0 = stream.page_base() + index * pt;
  status_ = absl::DataLossError(
      absl::StrCat("page checksum mismatch in ", DescribeSequence(entry.seq->ns(), entry.seq->id()),
                   " layer ", entry.layer, " kv_head ", entry.head, " page ", index, " (tokens [",
                   t0, ", ", t0 + pt, ")): the sequence is removed; append it again"));
}

void PageReadCheck::Check(const KvStream& stream, int page) const {
  auto it = streams_.find(&stream);
  if (it != streams_.end()) CheckPage(stream, it->second, page);
}

void PageReadCheck::CheckAll() const {
  for (const KvStream* s : order_) {
    const Stream& entry = streams_.at(s);
    for (size_t i = 0; i < entry.want.size(); ++i) {
      CheckPage(*s, entry, entry.first + static_cast<int>(i));
      if (any_failed_.load(std::memory_order_relaxed)) return;
    }
  }
}

absl::Status PageReadCheck::status() const {
  if (!any_failed_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return status_;
}

const Sequence* PageReadCheck::failed() const {
  absl::MutexLock lock(&mu_);
  return failed_;
}

absl::Status VerifyPages(const Sequence& seq, const PagePool& pool, int layer, int begin,
                         int end) {
  PageReadCheck check(pool);
  check.Add(seq, layer, begin, end);
  check.CheckAll();
  return check.status();
}

bool VerifySampler::Next() {
  if (fraction_ >= 1.0) return true;
  if (fraction_ <= 0.0) return false;
  const uint64_t n = reads_.fetch_add(1, std::memory_order_relaxed);
  return std::floor(static_cast<double>(n + 1) * fraction_) >
         std::floor(static_cast<double>(n) * fraction_);
}

}  // namespace kvq
