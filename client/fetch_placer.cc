#include "client/fetch_placer.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/parallel_for.h"
#include "kernels/status_macros.h"

namespace kvq {

FetchPlacer::FetchPlacer(const FetchOptions& options, HostTensor* k, HostTensor* v,
                         int out_offset, int tokens)
    : options_(options),
      k_(k),
      v_(v),
      layers_(k->shape[0]),
      heads_(k->shape[1]),
      out_tokens_(k->shape[2]),
      d_(k->shape[3]),
      out_offset_(out_offset),
      tokens_(tokens >= 0 ? tokens : k->shape[2] - out_offset),
      elem_(DTypeBytes(options.dtype)),
      filled_(static_cast<size_t>(layers_), 0) {}

absl::Status FetchPlacer::Place(const v1::FetchResponse& m) {
  const int64_t l = int64_t{m.layer()} - options_.layer_begin;
  const int64_t t0 = int64_t{m.token_begin()} - options_.token_begin;
  const int64_t n = m.k().shape_size() == 3 ? m.k().shape(1) : -1;
  const size_t piece = static_cast<size_t>(std::max<int64_t>(n, 0)) * d_ * elem_;
  const bool shape_ok =
      n >= 0 && m.k().shape(0) == heads_ && m.k().shape(2) == d_ && m.v().shape_size() == 3 &&
      m.v().shape(0) == heads_ && m.v().shape(1) == n && m.v().shape(2) == d_ &&
      m.k().dtype() == ToProtoDType(options_.dtype) && m.v().dtype() == m.k().dtype() &&
      m.k().data().size() == heads_ * piece && m.v().data().size() == heads_ * piece;
  if (!shape_ok || l < 0 || l >= layers_ || t0 != filled_[l] || t0 + n > tokens_) {
    return absl::DataLossError(
        absl::StrCat("fetch response for layer ", m.layer(), " token ", m.token_begin(), " (", n,
                     " tokens) does not continue the range: layer ", m.layer(), " has ",
                     l >= 0 && l < layers_ ? filled_[l] : -1, " of ", tokens_, " tokens of [",
                     heads_, ", tokens, ", d_, "] ", DTypeName(options_.dtype)));
  }
  for (int64_t h = 0; h < heads_; ++h) {
    const size_t dst =
        static_cast<size_t>(((l * heads_ + h) * out_tokens_ + out_offset_ + t0) * d_) * elem_;
    std::memcpy(k_->mutable_bytes() + dst, m.k().data().data() + h * piece, piece);
    std::memcpy(v_->mutable_bytes() + dst, m.v().data().data() + h * piece, piece);
  }
  filled_[l] += n;
  bytes_ += static_cast<int64_t>(2 * heads_ * piece);
  if (options_.progress) options_.progress(bytes_, 2 * static_cast<int64_t>(k_->byte_size()));
  return absl::OkStatus();
}

void FetchPlacer::Reset() {
  std::fill(filled_.begin(), filled_.end(), 0);
  bytes_ = 0;
}

absl::Status FetchPlacer::CheckComplete() const {
  for (int64_t l = 0; l < layers_; ++l) {
    if (filled_[l] != tokens_) {
      return absl::DataLossError(absl::StrCat("fetch stream ended with ", filled_[l], " of ",
                                              tokens_, " tokens of layer ",
                                              options_.layer_begin + l));
    }
  }
  return absl::OkStatus();
}

RawPagePlacer::RawPagePlacer(const LocalSequence& local, const ReadOptions& read,
                             int pages_begin, int begin, int end, int out_begin, HostTensor* k,
                             HostTensor* v, int threads)
    : local_(local),
      read_(read),
      pages_begin_(pages_begin),
      begin_(begin),
      end_(end),
      out_begin_(out_begin),
      k_(k),
      v_(v),
      threads_(threads),
      next_(static_cast<size_t>(local.layers()), pages_begin) {}

absl::Status RawPagePlacer::Place(const v1::FetchResponse& m) {
  const int l = m.layer() - local_.layer_begin();
  const int heads = local_.kv_heads();
  const KvStream& s0 = local_.stream(local_.layer_begin(), 0);
  const PageLayout& layout = s0.layout();
  const v1::QuantizedPages& p = m.pages();
  const int n = p.tokens();
  const size_t per_stream = static_cast<size_t>(s0.PagesFor(std::max(n, 0))) * layout.page_bytes;
  const bool shape_ok = m.has_pages() && p.layers() == 1 && n > 0 &&
                        p.page_bytes() == static_cast<int64_t>(layout.page_bytes) &&
                        p.page_tokens() == layout.page_tokens &&
                        p.page_data().size() == per_stream * heads;
  if (!shape_ok || l < 0 || l >= local_.layers() || m.token_begin() != next_[l] ||
      int64_t{m.token_begin()} + n > end_) {
    return absl::DataLossError(absl::StrCat(
        "raw fetch response for layer ", m.layer(), " token ", m.token_begin(), " (", n,
        " tokens, ", p.page_data().size(), " bytes) does not continue the range: layer ",
        m.layer(), " is at token ", l >= 0 && l < local_.layers() ? next_[l] : -1, " of [",
        pages_begin_, ", ", end_, "), ", heads, " kv heads of ", layout.page_tokens, "-token, ",
        layout.page_bytes, "-byte pages"));
  }
  const int t0 = m.token_begin();
  const int b = std::max(t0, begin_), e = std::min(t0 + n, end_);
  const int64_t out_tokens = k_->shape[2];
  const int d = s0.head_dim();
  const size_t elem = DTypeBytes(read_.dtype);
  const auto* data = reinterpret_cast<const uint8_t*>(p.page_data().data());
  // K and V of each head are independent, and so are runs of whole pages:
  // about kTasksPerThread tasks per thread. The helper thread wakes tens
  // of microseconds after the caller starts, on a message of a few hundred;
  // with one task per (head, side) it found two of six left, with smaller
  // ones it takes its half of what remains (kvq-bench convert: dequantizing
  // on two threads 7.0 -> 6.0 ms, BENCHMARKS.md section 7).
  constexpr int kTasksPerThread = 12;
  const int threads = threads_ > 0 ? threads_ : static_cast<int>(std::thread::hardware_concurrency());
  const int pt = layout.page_tokens;
  const int pages = b < e ? (e - 1 - t0) / pt - (b - t0) / pt + 1 : 0;
  const int parts = std::clamp((kTasksPerThread * threads + 2 * heads - 1) / (2 * heads), 1,
                               std::max(pages, 1));
  const int span = (pages + parts - 1) / parts * pt;  // Tokens per part, whole pages.
  const int first_page_token = t0 + (b - t0) / pt * pt;
  std::vector<absl::Status> results(b < e ? 2 * static_cast<size_t>(heads) * parts : 0);
  ParallelFor(static_cast<int>(results.size()), threads_, [&](int i) {
    const int h = i / (2 * parts);
    const bool keys = i / parts % 2 == 0;
    const int pb = std::max(b, first_page_token + i % parts * span);
    const int pe = std::min(e, first_page_token + (i % parts + 1) * span);
    if (pb >= pe) return;
    const size_t at =
        static_cast<size_t>((int64_t{l} * heads + h) * out_tokens + (pb - out_begin_)) * d * elem;
    HostTensor* out = keys ? k_ : v_;
    const TensorView rows{out->mutable_bytes() + at, read_.dtype, pe - pb, d, 0};
    const TensorView none{nullptr, read_.dtype, pe - pb, d, 0};
    results[i] = local_.stream(m.layer(), h)
                     .ReadPages(data + h * per_stream, n, t0, pb, pe, read_, keys ? rows : none,
                                keys ? none : rows);
  });
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].ok()) {
      return absl::Status(results[i].code(),
                          absl::StrCat("raw fetch of layer ", m.layer(), " kv head ",
                                       i / (2 * parts), " from token ", t0, ": ",
                                       results[i].message()));
    }
  }
  next_[l] = t0 + n;
  bytes_ += static_cast<int64_t>(p.page_data().size());
  return absl::OkStatus();
}

void RawPagePlacer::Reset() {
  std::fill(next_.begin(), next_.end(), pages_begin_);
  bytes_ = 0;
}

absl::Status RawPagePlacer::CheckComplete() const {
  for (int l = 0; l < local_.layers(); ++l) {
    if (next_[l] != end_) {
      return absl::DataLossError(absl::StrCat("raw fetch stream ended at token ", next_[l],
                                              " of layer ", local_.layer_begin() + l,
                                              "; the range ends at ", end_));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvq
