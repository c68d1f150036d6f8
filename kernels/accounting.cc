#include "kernels/accounting.h"

#include <algorithm>

#include "kernels/status_macros.h"

namespace kvq {
namespace {

size_t AlignUp(size_t n) { return (n + kPageAlign - 1) / kPageAlign * kPageAlign; }
size_t FpRowBytes(int head_dim) { return static_cast<size_t>(2) * head_dim * 2; }  // K+V fp16.
size_t LevelBytes(const StreamConfig& c) {
  return c.spec.nuq ? static_cast<size_t>(2) * c.head_dim * (1 << c.spec.bits) * 2 : 0;
}
int TailCapacity(const StreamConfig& c) { return c.spec.has_tail() ? c.spec.flush_tokens() : 0; }
bool HasHeader(const StreamConfig& c) { return c.spec.kind == SchemeKind::kFp8E4m3; }

}  // namespace

ByteBreakdown& ByteBreakdown::operator+=(const ByteBreakdown& o) {
  codes += o.codes;
  scales += o.scales;
  outliers += o.outliers;
  residual += o.residual;
  sink += o.sink;
  codebook += o.codebook;
  padding += o.padding;
  return *this;
}

size_t AuxBytes(const StreamConfig& c) {
  const int slots = c.spec.sink + TailCapacity(c);
  if (!HasHeader(c) && LevelBytes(c) == 0 && slots == 0) return 0;
  const size_t rows_offset = AlignUp(kStreamHeaderBytes + LevelBytes(c));
  return AlignUp(rows_offset + slots * FpRowBytes(c.head_dim));
}

ByteBreakdown StreamBytes(const StreamConfig& config, const PageLayout& layout, int quantized,
                          int pages, size_t aux_bytes) {
  ByteBreakdown b;
  const int d = config.head_dim;
  const int blocks = quantized / layout.block_tokens;
  for (const SideLayout* s : {&layout.key, &layout.value}) {
    b.codes += static_cast<size_t>(quantized) * s->code_row_bytes;
    if (s->axis != ParamAxis::kNone) {
      b.scales += static_cast<size_t>(blocks) * layout.ParamBlockBytes(*s);
    }
    b.outliers += static_cast<size_t>(blocks) * layout.outliers_per_block * 4;
  }
  b.padding = static_cast<size_t>(pages) * layout.page_bytes - b.codes - b.scales - b.outliers;
  if (aux_bytes > 0) {
    const size_t header = HasHeader(config) ? kStreamHeaderBytes : 0;
    b.scales += header;
    b.codebook = LevelBytes(config);
    b.sink = static_cast<size_t>(config.spec.sink) * FpRowBytes(d);
    b.residual = static_cast<size_t>(TailCapacity(config)) * FpRowBytes(d);
    b.padding += aux_bytes - header - b.codebook - b.sink - b.residual;
  }
  return b;
}

absl::StatusOr<ByteBreakdown> AnalyticBytes(const StreamConfig& config, int tokens) {
  KVQ_RETURN_IF_ERROR(config.Validate());
  KVQ_ASSIGN_OR_RETURN(PageLayout layout,
                       PageLayout::Make(config.spec, config.head_dim, config.page_tokens));
  const int rest = std::max(0, tokens - config.spec.sink);
  const int flush = config.spec.flush_tokens();
  const int quantized = rest / flush * flush;
  const int pages = (quantized + layout.page_tokens - 1) / layout.page_tokens;
  return StreamBytes(config, layout, quantized, pages, AuxBytes(config));
}

double NominalBitsPerElement(const StreamConfig& config) {
  absl::StatusOr<PageLayout> layout =
      PageLayout::Make(config.spec, config.head_dim, config.page_tokens);
  if (!layout.ok()) return 0.0;
  const int d = config.head_dim;
  const double g = layout->block_tokens;
  double bits = 0.0;
  for (const SideLayout* s : {&layout->key, &layout->value}) {
    bits += 8.0 * s->code_row_bytes / d;
    if (s->axis != ParamAxis::kNone) bits += 8.0 * layout->ParamBlockBytes(*s) / (g * d);
    bits += 32.0 * layout->outliers_per_block / (g * d);
  }
  return bits / 2.0;
}

}  // namespace kvq
