#include "kernels/stream_config.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/page_layout.h"

namespace kvq {

absl::Status StreamConfig::Validate() const {
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  if (absl::Status s = PageLayout::Make(spec, head_dim, page_tokens).status(); !s.ok()) {
    return s;
  }
  if (spec.rotate && (head_dim & (head_dim - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rotate needs a power-of-two head_dim, got ", head_dim));
  }
  if (spec.is_crq() && (head_dim & (head_dim - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scheme crq needs a power-of-two head_dim (its Hadamard rotation), got ", head_dim));
  }
  if (spec.pre_rope) return rope.Validate(head_dim);
  return absl::OkStatus();
}

absl::Status Codebook::Validate(const StreamConfig& config) const {
  if (bits != config.spec.bits || head_dim != config.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codebook is for ", bits, " bits and head_dim ", head_dim, ", stream has ",
        config.spec.bits, " bits and head_dim ", config.head_dim));
  }
  const size_t n = static_cast<size_t>(head_dim) * levels();
  if (key_levels.size() != n || value_levels.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("codebook needs ", n, " levels per side"));
  }
  for (const auto* side : {&key_levels, &value_levels}) {
    for (int c = 0; c < head_dim; ++c) {
      const float* l = side->data() + c * levels();
      for (int i = 0; i < levels(); ++i) {
        if (!(l[i] >= 0.0f && l[i] <= 1.0f) || (i > 0 && l[i] < l[i - 1])) {
          return absl::InvalidArgumentError(absl::StrCat(
              "codebook levels of channel ", c, " must be sorted and in [0, 1]"));
        }
      }
    }
  }
  return absl::OkStatus();
}

Codebook Codebook::Uniform(int bits, int head_dim) {
  Codebook cb;
  cb.bits = bits;
  cb.head_dim = head_dim;
  const int n = 1 << bits;
  cb.key_levels.resize(static_cast<size_t>(head_dim) * n);
  for (int c = 0; c < head_dim; ++c) {
    for (int i = 0; i < n; ++i) cb.key_levels[c * n + i] = static_cast<float>(i) / (n - 1);
  }
  cb.value_levels = cb.key_levels;
  return cb;
}

}  // namespace kvq
