// Fuzz target: the scheme parser (kernels/quant_spec.h) and PageLayout::Make
// of every scheme it accepts.
//
// Input: the scheme string. Checked beyond "no crash, no sanitizer report":
//   - what parses passes Validate() and prints a canonical form that parses
//     back to the same QuantSpec (CreateSequence answers with that form, and
//     a client may create the next sequence from it);
//   - for every head_dim a page can have, a layout that Make() accepts has
//     its sections inside the page, apart from each other and aligned, and
//     counts its padding exactly.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "kernels/page_layout.h"
#include "kernels/quant_spec.h"

namespace {

[[noreturn]] void Fail(const std::string& what, const std::string& scheme) {
  std::fprintf(stderr, "quant_spec_fuzz: %s (scheme \"%s\")\n", what.c_str(), scheme.c_str());
  std::abort();
}

void CheckLayout(const kvq::PageLayout& l, const std::string& scheme) {
  if (l.page_bytes == 0 || l.page_bytes % kvq::kPageAlign != 0) {
    Fail("page_bytes is not a positive multiple of kPageAlign", scheme);
  }
  // [offset, offset + bytes) of every section.
  std::vector<std::pair<size_t, size_t>> sections;
  size_t used = 0;
  for (const kvq::SideLayout* s : {&l.key, &l.value}) {
    const size_t codes = s->code_row_bytes * l.page_tokens;
    if (codes == 0) Fail("a side has no code bytes", scheme);
    if (s->codes_offset % kvq::kPageAlign != 0) Fail("code rows are not line-aligned", scheme);
    sections.push_back({s->codes_offset, codes});
    // crq's widths may be fractional: half_bits per coordinate on average.
    const size_t row_bits = s->format == kvq::CodeFormat::kCrq
                                ? static_cast<size_t>(l.head_dim) * s->half_bits / 2
                                : static_cast<size_t>(l.head_dim) * s->bits;
    if (s->code_row_bytes != row_bits / 8) {
      Fail("code_row_bytes does not hold head_dim codes of the side's bits", scheme);
    }
    if ((s->axis == kvq::ParamAxis::kNone) != (s->params_bytes == 0)) {
      Fail("parameter bytes disagree with the parameter axis", scheme);
    }
    if (s->params_bytes != 0) {
      if (s->params_offset % kvq::kTableAlign != 0) Fail("parameters are not aligned", scheme);
      if (s->params_bytes != l.ParamBlockBytes(*s) * l.blocks_per_page()) {
        Fail("params_bytes is not one block's parameters per block", scheme);
      }
      sections.push_back({s->params_offset, s->params_bytes});
    }
    if (s->outliers_bytes != 0) {
      if (s->outliers_offset % kvq::kTableAlign != 0) Fail("outliers are not aligned", scheme);
      sections.push_back({s->outliers_offset, s->outliers_bytes});
    }
    if (s->axis == kvq::ParamAxis::kTokenGroups &&
        (s->group_channels <= 0 || l.head_dim % s->group_channels != 0)) {
      Fail("token groups do not divide head_dim", scheme);
    }
    used += codes + s->params_bytes + s->outliers_bytes;
  }
  for (size_t i = 0; i < sections.size(); ++i) {
    if (sections[i].first + sections[i].second > l.page_bytes) {
      Fail("a section runs past the page", scheme);
    }
    for (size_t j = 0; j < i; ++j) {
      const bool apart = sections[i].first >= sections[j].first + sections[j].second ||
                         sections[j].first >= sections[i].first + sections[i].second;
      if (!apart) Fail("two sections overlap", scheme);
    }
  }
  if (used + l.padding_bytes != l.page_bytes) Fail("padding_bytes miscounts the page", scheme);
  // Outlier indices are 16-bit positions inside a block.
  if (l.outliers_per_block > 0 &&
      static_cast<int64_t>(l.block_tokens) * l.head_dim > int64_t{1} << 16) {
    Fail("outlier indices cannot address the block", scheme);
  }
  if (l.outliers_per_block > l.block_tokens * l.head_dim) {
    Fail("more outliers than elements per block", scheme);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 256) return -1;  // Scheme strings are short; longer adds nothing.
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvq::QuantSpec> spec = kvq::QuantSpec::Parse(text);
  if (!spec.ok()) {
    if (spec.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("a refused scheme is not INVALID_ARGUMENT", text);
    }
    return 0;
  }
  if (!spec->Validate().ok()) Fail("Parse accepted a spec Validate refuses", text);
  const std::string canonical = spec->ToString();
  absl::StatusOr<kvq::QuantSpec> again = kvq::QuantSpec::Parse(canonical);
  if (!again.ok()) Fail("the canonical form \"" + canonical + "\" does not parse", text);
  if (!(*again == *spec)) Fail("the canonical form \"" + canonical + "\" is another spec", text);
  if (again->ToString() != canonical) Fail("the canonical form is not stable", text);

  for (int head_dim = 16; head_dim <= kvq::kMaxHeadDim; head_dim += 16) {
    absl::StatusOr<kvq::PageLayout> layout = kvq::PageLayout::Make(*spec, head_dim);
    if (!layout.ok()) continue;
    CheckLayout(*layout, text);
    // Explicit page sizes: the smallest and a larger multiple of the block.
    for (int blocks : {1, 3}) {
      absl::StatusOr<kvq::PageLayout> l =
          kvq::PageLayout::Make(*spec, head_dim, blocks * layout->block_tokens);
      if (l.ok()) CheckLayout(*l, text);
    }
  }
  return 0;
}
