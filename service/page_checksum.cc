#include "service/page_checksum.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace kvq {
namespace {

std::string Describe(const Sequence& seq) {
  return seq.ns().empty()
             ? absl::StrCat("sequence \"", seq.id(), "\"")
             : absl::StrCat("sequence \"", seq.id(), "\" in namespace \"", seq.ns(), "\"");
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
      if (full == 0 || s.allocator() != &pool) continue;
      // Sealed pages are a prefix: find where it ends, from the back.
      const uint8_t* last = s.page(full - 1);
      uint64_t last_sum = 0;
      pool.GetChecksums({&last, 1}, {&last_sum, 1});
      if (last_sum != 0) continue;
      blocks.resize(full);
      sums.resize(full);
      for (int i = 0; i < full; ++i) blocks[i] = s.page(i);
      pool.GetChecksums(blocks, absl::MakeSpan(sums));
      int first = full;
      while (first > 0 && sums[first - 1] == 0) --first;
      for (int i = first; i < full; ++i) sums[i] = PageChecksum(blocks[i], s.layout().page_bytes);
      pool.SetChecksums(absl::MakeConstSpan(blocks).subspan(first),
                        absl::MakeConstSpan(sums).subspan(first));
    }
  }
}

absl::Status VerifyPages(const Sequence& seq, const PagePool& pool, int layer, int begin,
                         int end) {
  std::vector<const uint8_t*> blocks;
  std::vector<uint64_t> sums;
  for (int h = 0; h < seq.shape().num_kv_heads; ++h) {
    const KvStream& s = seq.stream(layer, h);
    if (s.allocator() != &pool) continue;
    const int pt = s.layout().page_tokens;
    const int full = s.quantized_tokens() / pt;
    // Pages are token positions page_base() + [i * pt, (i + 1) * pt).
    const int lo = std::max(0, begin - s.page_base());
    const int hi = std::min(full * pt, end - s.page_base());
    if (lo >= hi) continue;
    const int first = lo / pt;
    const int last = (hi + pt - 1) / pt;  // Exclusive; <= full.
    blocks.resize(last - first);
    sums.resize(last - first);
    for (int i = first; i < last; ++i) blocks[i - first] = s.page(i);
    pool.GetChecksums(blocks, absl::MakeSpan(sums));
    for (int i = first; i < last; ++i) {
      const uint64_t want = sums[i - first];
      if (want == 0 || PageChecksum(blocks[i - first], s.layout().page_bytes) == want) continue;
      const int t0 = s.page_base() + i * pt;
      return absl::DataLossError(absl::StrCat(
          "page checksum mismatch in ", Describe(seq), " layer ", layer, " kv_head ", h,
          " page ", i, " (tokens [", t0, ", ", t0 + pt, ")): the sequence is removed; append it "
          "again"));
    }
  }
  return absl::OkStatus();
}

bool VerifySampler::Next() {
  if (fraction_ >= 1.0) return true;
  if (fraction_ <= 0.0) return false;
  const uint64_t n = reads_.fetch_add(1, std::memory_order_relaxed);
  return std::floor(static_cast<double>(n + 1) * fraction_) >
         std::floor(static_cast<double>(n) * fraction_);
}

}  // namespace kvq
