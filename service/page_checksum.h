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
// the page, whose layout is fixed by kernels/page_layout.h.
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

#include "absl/status/status.h"
#include "service/page_pool.h"
#include "service/sequence.h"

namespace kvq {

// XXH3-64 of `bytes` bytes at `page`, never 0: 0 marks an unsealed block in
// the pool, so a hash of 0 is stored as 1.
uint64_t PageChecksum(const uint8_t* page, size_t bytes);

// Seals every full page not sealed yet of the streams of layers
// [layer_begin, layer_end) of `seq` whose pages come from `pool`. Pages
// fill in order, so only the pages after the last sealed one are hashed:
// an append that fills no page costs one look-up per stream. Call holding
// the sequence's lock for writing, right after an append.
void SealFullPages(const Sequence& seq, PagePool& pool, int layer_begin, int layer_end);

// Verifies the sealed pages holding tokens [begin, end) of `layer` (every
// KV head; token positions as Read() takes them, the sink included). OK
// when every one matches its checksum; DATA_LOSS naming the sequence, the
// layer, the KV head and the page (never the data) at the first that does
// not. Pages not from `pool` and unsealed pages are not checked. Call
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
