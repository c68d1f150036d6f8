// PageGuard: the service's side of page checksums (service/page_checksum.h).
//
// Handlers call Seal() right after an append, Verify() before reading pages
// (FetchDequant, dense and raw; Attend; AppendAttend and DecodeStream), and
// Remove() after a Verify() failure once they no longer hold the
// sequence's lock. A mismatch is answered DATA_LOSS, counted in
// kvq_page_checksum_failures_total, and the sequence leaves the store, so
// a corrupted page is never served.
#ifndef KVQ_SERVICE_PAGE_GUARD_H_
#define KVQ_SERVICE_PAGE_GUARD_H_

#include <memory>

#include "absl/status/status.h"
#include "service/metrics.h"
#include "service/page_checksum.h"
#include "service/sequence_store.h"

namespace kvq {

class PageGuard {
 public:
  // `verify_fraction` in [0, 1]: the share of reads that verify (VerifySampler).
  PageGuard(SequenceStore* store, Metrics* metrics, double verify_fraction)
      : store_(store), metrics_(metrics), sampler_(verify_fraction) {}

  // Seals the pages the append to layers [layer_begin, layer_end) filled
  // (the sequence locked for writing).
  void Seal(const Sequence& seq, int layer_begin, int layer_end) {
    SealFullPages(seq, store_->pool(), layer_begin, layer_end);
  }
  // Before reading tokens [begin, end) of `layer` (the sequence locked): a
  // sampled read verifies the sealed pages it covers. DATA_LOSS (counted)
  // on a mismatch.
  absl::Status Verify(const Sequence& seq, int layer, int begin, int end);
  // A read whose pages are checked as they are read (Attend: the backend's
  // threads run the check, KernelBackend::ChecksPages): the check to Add()
  // the read's ranges to, or nullptr when the sampler skips this read.
  std::unique_ptr<PageReadCheck> StartRead();
  // After such a read, with the sequences still locked: OK, or the check's
  // DATA_LOSS (logged and counted once).
  absl::Status Finish(const PageReadCheck& check);
  // After Verify() failed, without the sequence's lock: removes it.
  void Remove(const Sequence& seq) { store_->RemoveCorrupted(seq); }

  double verify_fraction() const { return sampler_.fraction(); }

 private:
  SequenceStore* store_;
  Metrics* metrics_;
  VerifySampler sampler_;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_PAGE_GUARD_H_
