// SIMD robust scores for SelectOutliers (kernels/cpu/outliers.h): the same
// numbers as the scalar reference, bit for bit.
//
// A group's median and median absolute deviation are order statistics of 16
// to 256 values. The reference finds each with std::nth_element, group by
// group; here N groups (N = the vector's lanes) go through one Batcher
// odd-even merge sorting network together, lane by lane, so every min / max
// serves N groups. A sorting network yields the exact sorted order, hence the
// same rank-`mid` element nth_element returns; the score arithmetic is the
// reference's, operation for operation (-ffp-contract=off).
//  * per-channel groups: N adjacent channels of the block's rows, loaded as
//    they lie in memory;
//  * per-token groups: the same group of N consecutive tokens, gathered
//    through a small transposition buffer.

#include "kernels/cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/simd_outliers.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <utility>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "kernels/cpu/simd_outliers.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace cpu {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::CappedTag<float, 8>;  // 256-bit on AVX3 too (simd_targets.h).

// Comparators of Batcher's odd-even merge sort for n (a power of two).
const std::vector<std::pair<int, int>>& Network(int n) {
  static thread_local std::vector<std::pair<int, int>> nets[9];  // n = 2^0 .. 2^8
  int log = 0;
  while ((1 << log) < n) ++log;
  std::vector<std::pair<int, int>>& net = nets[log];
  if (net.empty() && n > 1) {
    for (int p = 1; p < n; p <<= 1) {
      for (int k = p; k >= 1; k >>= 1) {
        for (int j = k % p; j + k < n; j += 2 * k) {
          for (int i = 0; i < k && i + j + k < n; ++i) {
            if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) net.emplace_back(i + j, i + j + k);
          }
        }
      }
    }
  }
  return net;
}

// x[0..n) (one group per lane) -> score[i] lane by lane, as ScoreGroup does.
void ScoreLanes(const float* HWY_RESTRICT x, int n, float* HWY_RESTRICT sorted,
                float* HWY_RESTRICT score) {
  const DF df;
  const size_t N = hn::Lanes(df);
  const std::vector<std::pair<int, int>>& net = Network(n);
  auto sort = [&]() {
    for (auto [a, b] : net) {
      const auto va = hn::Load(df, sorted + a * N);
      const auto vb = hn::Load(df, sorted + b * N);
      hn::Store(hn::Min(va, vb), df, sorted + a * N);
      hn::Store(hn::Max(va, vb), df, sorted + b * N);
    }
  };
  const int mid = n / 2;
  for (int i = 0; i < n; ++i) hn::Store(hn::Load(df, x + i * N), df, sorted + i * N);
  sort();
  const auto median = hn::Load(df, sorted + mid * N);
  for (int i = 0; i < n; ++i) {
    hn::Store(hn::Abs(hn::Sub(hn::Load(df, x + i * N), median)), df, sorted + i * N);
  }
  sort();
  const auto mad = hn::Load(df, sorted + mid * N);
  const auto eps = hn::Mul(hn::Set(df, 1e-6f), hn::Add(hn::Abs(median), hn::Set(df, 1.0f)));
  const auto den = hn::Add(mad, eps);
  for (int i = 0; i < n; ++i) {
    hn::Store(hn::Div(hn::Abs(hn::Sub(hn::Load(df, x + i * N), median)), den), df, score + i * N);
  }
}

}  // namespace

bool ScoreOutliersImpl(const float* block, int rows, int d, int axis_channels, int group_channels,
                       float* scores) {
  const DF df;
  const int N = static_cast<int>(hn::Lanes(df));
  const bool per_channel = axis_channels != 0;
  const int n = per_channel ? rows : group_channels;  // Values per group.
  const int lanes_of = per_channel ? d : rows;        // What the lanes run over.
  if (n < 2 || n > 256 || (n & (n - 1)) != 0 || lanes_of % N != 0) return false;
  if (!per_channel && (group_channels <= 0 || d % group_channels != 0)) return false;
  static thread_local hwy::AlignedFreeUniquePtr<float[]> buf;
  static thread_local size_t buf_size = 0;
  const size_t need = 3 * static_cast<size_t>(n) * N;
  if (buf_size < need) {
    buf = hwy::AllocateAligned<float>(need);
    buf_size = need;
  }
  float* x = buf.get();
  float* sorted = x + static_cast<size_t>(n) * N;
  float* score = sorted + static_cast<size_t>(n) * N;
  if (per_channel) {
    for (int c0 = 0; c0 < d; c0 += N) {
      for (int t = 0; t < rows; ++t) {
        hn::Store(hn::LoadU(df, block + static_cast<size_t>(t) * d + c0), df, x + t * N);
      }
      ScoreLanes(x, n, sorted, score);
      for (int t = 0; t < rows; ++t) {
        hn::StoreU(hn::Load(df, score + t * N), df, scores + static_cast<size_t>(t) * d + c0);
      }
    }
    return true;
  }
  const int gc = group_channels;
  for (int j = 0; j < d / gc; ++j) {
    for (int t0 = 0; t0 < rows; t0 += N) {
      for (int l = 0; l < N; ++l) {
        const float* src = block + static_cast<size_t>(t0 + l) * d + j * gc;
        for (int i = 0; i < gc; ++i) x[i * N + l] = src[i];
      }
      ScoreLanes(x, n, sorted, score);
      for (int l = 0; l < N; ++l) {
        float* dst = scores + static_cast<size_t>(t0 + l) * d + j * gc;
        for (int i = 0; i < gc; ++i) dst[i] = score[i * N + l];
      }
    }
  }
  return true;
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq {
namespace cpu {

HWY_EXPORT(ScoreOutliersImpl);

bool ScoreOutliersSimd(const float* block, int rows, int d, const SideLayout& side,
                       float* scores) {
  return HWY_DYNAMIC_DISPATCH(ScoreOutliersImpl)(
      block, rows, d, side.axis == ParamAxis::kChannelGroups ? 1 : 0, side.group_channels, scores);
}

}  // namespace cpu
}  // namespace kvq
#endif
