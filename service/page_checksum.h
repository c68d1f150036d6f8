// Page checksums: the integrity check of sealed KV pages.
//
// A page is sealed once it is full. From then on it is never written again
// (appends write rows past quantized_tokens(), and Fork and prefix reuse
// share full pages but copy a partial one: kernels/kv_stream.h), so a
// checksum taken then holds for its whole life, in every sequence that
// shares it. The append that fills a page seals it before releasing the
// sequence's lock (SealFullPages), so no reader sees a full page without a
// checksum; the checksum (XXH3-64 of the page's page_bytes) lives in the
// pool's slab metadata beside the block (PagePool::SetChecksums), not in
// the page, whose layout is fixed by kernels/page_layout.h. Pages the host
// cannot address (device memory) are copied to a host buffer and hashed
// there: one device-to-host copy of every sealed page at seal and again at
// each verified read.
//
// Readers verify the sealed pages they are about to read (VerifyPages)
// before any byte of them is sent or enters attention. The fp16 sink, the
// fp16 residual tail and the partial last page are still being written and
// carry no checksum.
#ifndef KVQ_SERVICE_PAGE_CHECKSUM_H_
#define KVQ_SERVICE_PAGE_CHECKSUM_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "service/page_pool.h"
#include "service/sequence.h"

namespace kvq {

// XXH3-64 of `bytes` bytes at `page`, never 0: 0 marks an unsealed block in
// the pool, so a hash of 0 is stored as 1.
uint64_t PageChecksum(const uint8_t* page, size_t bytes);

// Seals every full page not sealed yet of the streams of layers
// [layer_begin, layer_end) of `seq` whose pages come from `pool` or from
// an allocator that keeps checksums itself (PageAllocator::
// keeps_checksums: the device page pool). Pages
// fill in order, so only the pages after the last sealed one are hashed:
// an append that fills no page costs one look-up per stream. Call holding
// the sequence's lock for writing, right after an append.
void SealFullPages(const Sequence& seq, PagePool& pool, int layer_begin, int layer_end);

// The sealed pages one read will touch, with the checksums they were
// sealed with, checked either by the attention backend's threads as they
// read each page (KernelBackend::ChecksPages: the page then crosses the
// cache once for the hash and the attention, and the hashing is spread
// over the worker team instead of running on the handler's thread before
// the kernel) or all at once by CheckAll(). Each page is hashed at most
// once per read. Build it holding the sequences' locks and keep them until
// status() is read.
class PageReadCheck final : public PageCheck {
 public:
  explicit PageReadCheck(const PagePool& pool) : pool_(pool) {}
  PageReadCheck(const PageReadCheck&) = delete;
  PageReadCheck& operator=(const PageReadCheck&) = delete;

  // Adds the sealed pages holding tokens [begin, end) of `layer` (every KV
  // head; token positions as Read() takes them, the sink included).
  void Add(const Sequence& seq, int layer, int begin, int end);
  // PageCheck: hashes page `page` of `stream` once, if it was added.
  void Check(const KvStream& stream, int page) const override;
  // Checks every added page (in order of Add, head and page), stopping at
  // the first mismatch.
  void CheckAll() const;
  // OK, or DATA_LOSS naming the sequence, the layer, the KV head and the
  // page (never the data) of a mismatch.
  absl::Status status() const;
  // The sequence whose page failed; nullptr while status() is OK.
  const Sequence* failed() const;

 private:
  struct Stream {
    const Sequence* seq = nullptr;
    int layer = 0;
    int head = 0;
    int first = 0;               // First page added.
    std::vector<uint64_t> want;  // Sealed checksum of pages first..; 0: unsealed.
    std::unique_ptr<std::atomic<bool>[]> checked;
  };
  // Hashes page `index` of `stream` if it is in `entry` and not hashed yet.
  void CheckPage(const KvStream& stream, const Stream& entry, int index) const;

  const PagePool& pool_;
  absl::flat_hash_map<const KvStream*, Stream> streams_;
  std::vector<const KvStream*> order_;  // Add order, for CheckAll.
  mutable std::atomic<bool> any_failed_{false};
  mutable absl::Mutex mu_;
  mutable absl::Status status_ ABSL_GUARDED_BY(mu_);
  mutable const Sequence* failed_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// Verifies the sealed pages holding tokens [begin, end) of `layer` (every
// KV head; token positions as Read() takes them, the sink included). OK
// when every one matches its checksum; DATA_LOSS naming the sequence, the
// layer, the KV head and the page (never the data) at the first that does
// not. Pages from neither and unsealed pages are not checked. Call
// holding the sequence's lock (a reader lock is enough).
absl::Status VerifyPages(const Sequence& seq, const PagePool& pool, int layer, int begin,
                         int end);

// Which reads verify, for --verify_fraction = f in [0, 1]: read n (counted
// from 0 across the whole server) verifies iff floor((n + 1) f) >
// floor(n f). That is deterministic and evenly spread: exactly floor(N f)
// of any first N reads verify, every read for f = 1 and none for f = 0.
// Thread-safe.
class VerifySampler {
 public:
  explicit VerifySampler(double fraction) : fraction_(fraction) {}
  double fraction() const { return fraction_; }
  // Whether the next read verifies.
  bool Next();

 private:
  const double fraction_;
  std::atomic<uint64_t> reads_{0};
};

}  // namespace kvq

#endif  // KVQ_SERVICE_PAGE_CHECKSUM_H_
