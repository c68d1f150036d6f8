#include "kernels/backend.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvq {

absl::Status ValidateAttention(absl::Span<const AttentionTask> tasks,
                               const AttentionOptions& options) {
  if (options.group_size < 1 || options.group_size > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_size must be in [1, 64], got ", options.group_size));
  }
  if (!(options.softmax_scale >= 0.0f) || !std::isfinite(options.softmax_scale)) {
    return absl::InvalidArgumentError("softmax_scale must be finite and >= 0");
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    const AttentionTask& t = tasks[i];
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("attention task ", i, ": ", why));
    };
    if (t.stream == nullptr) return bad("stream is null");
    const int n = t.stream->num_tokens();
    const int end = t.key_end == -1 ? n : t.key_end;
    if (t.key_begin < 0 || t.key_begin > end || end > n) {
      return absl::OutOfRangeError(absl::StrCat(
          "attention task ", i, ": key range [", t.key_begin, ", ", end,
          ") is not inside [0, ", n, "]"));
    }
    if (t.num_queries < 1) return bad("num_queries must be >= 1");
    if (t.q == nullptr || t.out == nullptr || t.lse == nullptr) {
      return bad("q, out and lse must be set");
    }
    const int row = options.group_size * t.stream->head_dim();
    if (t.num_queries > 1 && (t.q_stride < row || t.out_stride < row ||
                              t.lse_stride < options.group_size)) {
      return bad(absl::StrCat("q_stride and out_stride must be >= group_size*head_dim=", row,
                              " and lse_stride >= group_size"));
    }
    const float* q = t.q;
    for (int qi = 0; qi < t.num_queries; ++qi) {
      for (int e = 0; e < row; ++e) {
        if (!std::isfinite(q[static_cast<size_t>(qi) * t.q_stride + e])) {
          return bad(absl::StrCat("q[", qi, "][", e, "] is not finite"));
        }
      }
      if (t.q_positions != nullptr && t.q_positions[qi] < 0) {
        return bad(absl::StrCat("q_positions[", qi, "] is negative"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAttentionResults(absl::Span<const AttentionTask> tasks,
                                   const AttentionOptions& options) {
  const int group = options.group_size;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const AttentionTask& t = tasks[i];
    const int d = t.stream->head_dim();
    const int end = t.key_end == -1 ? t.stream->num_tokens() : t.key_end;
    for (int qi = 0; qi < t.num_queries; ++qi) {
      // A row that sees a key has a finite log-sum-exp: -inf there means
      // every score overflowed to -inf.
      const int visible_end =
          t.q_positions == nullptr ? end : std::min(end, t.q_positions[qi] + 1);
      const bool sees_keys = visible_end > t.key_begin;
      for (int h = 0; h < group; ++h) {
        const float lse = t.lse[static_cast<size_t>(qi) * t.lse_stride + h];
        const float* out = t.out + static_cast<size_t>(qi) * t.out_stride + static_cast<size_t>(h) * d;
        bool finite = sees_keys ? std::isfinite(lse)
                                : lse == -std::numeric_limits<float>::infinity();
        for (int c = 0; c < d && finite; ++c) finite = std::isfinite(out[c]);
        if (finite) continue;
        const float* q = t.q + static_cast<size_t>(qi) * t.q_stride + static_cast<size_t>(h) * d;
        float qmax = 0.0f;
        for (int c = 0; c < d; ++c) qmax = std::max(qmax, std::fabs(q[c]));
        return absl::OutOfRangeError(absl::StrCat(
            "attention task ", i, ", query ", qi, ", head ", h,
            ": the result overflowed float (log-sum-exp ", lse, "); the query (largest |q| ",
            qmax, ") or the stored keys and values are too large for float attention"));
      }
    }
  }
  return absl::OkStatus();
}

void MergeAttention(const float* out_a, float lse_a, const float* out_b, float lse_b,
                    int head_dim, float* out, float* lse) {
  const float m = std::max(lse_a, lse_b);
  if (m == -std::numeric_limits<float>::infinity()) {
    for (int c = 0; c < head_dim; ++c) out[c] = 0.0f;
    *lse = m;
    return;
  }
  const float wa = std::exp(lse_a - m);
  const float wb = std::exp(lse_b - m);
  const float inv = 1.0f / (wa + wb);
  for (int c = 0; c < head_dim; ++c) out[c] = (wa * out_a[c] + wb * out_b[c]) * inv;
  *lse = m + std::log(wa + wb);
}

}  // namespace kvq
