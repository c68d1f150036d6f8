#include "kernels/cpu/outliers.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/cpu/simd_outliers.h"

namespace kvq {
namespace {

// Writes the robust score of every element of one group (given by indices).
void ScoreGroup(const float* block, const std::vector<int>& idx, std::vector<float>& tmp,
                std::vector<float>& scores) {
  tmp.resize(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) tmp[i] = block[idx[i]];
  const size_t mid = tmp.size() / 2;
  std::nth_element(tmp.begin(), tmp.begin() + mid, tmp.end());
  const float median = tmp[mid];
  for (size_t i = 0; i < idx.size(); ++i) tmp[i] = std::fabs(block[idx[i]] - median);
  std::nth_element(tmp.begin(), tmp.begin() + mid, tmp.end());
  const float mad = tmp[mid];
  const float eps = 1e-6f * (std::fabs(median) + 1.0f);
  for (int i : idx) scores[i] = std::fabs(block[i] - median) / (mad + eps);
}

// Scores of every element, scalar: one std::nth_element pair per group.
void ScoreBlockRef(const float* block, int rows, int d, const SideLayout& side,
                   std::vector<float>& scores) {
  std::vector<int> idx;
  std::vector<float> tmp;
  if (side.axis == ParamAxis::kChannelGroups) {
    for (int c = 0; c < d; ++c) {
      idx.clear();
      for (int t = 0; t < rows; ++t) idx.push_back(t * d + c);
      ScoreGroup(block, idx, tmp, scores);
    }
  } else {
    const int gc = side.group_channels;
    for (int t = 0; t < rows; ++t) {
      for (int j = 0; j < d / gc; ++j) {
        idx.clear();
        for (int c = j * gc; c < (j + 1) * gc; ++c) idx.push_back(t * d + c);
        ScoreGroup(block, idx, tmp, scores);
      }
    }
  }
}

// Highest score first, ties to the lower index: a strict total order on
// (finite) scores.
bool Before(const std::vector<float>& scores, int a, int b) {
  return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
}

}  // namespace

std::vector<int> SelectOutliersRef(const float* block, int rows, int d, const SideLayout& side,
                                   int k) {
  std::vector<float> scores(static_cast<size_t>(rows) * d);
  ScoreBlockRef(block, rows, d, side, scores);
  std::vector<int> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return Before(scores, a, b); });
  order.resize(k);
  return order;
}

std::vector<int> SelectOutliers(const float* block, int rows, int d, const SideLayout& side,
                                int k) {
  const size_t total = static_cast<size_t>(rows) * d;
  std::vector<float> scores(total);
  if (!cpu::ScoreOutliersSimd(block, rows, d, side, scores.data())) {
    ScoreBlockRef(block, rows, d, side, scores);
  }
  if (k <= 0) return {};
  // The first k of the total order, as partial_sort gives them: one pass
  // keeping the k best so far in a heap whose front is the worst of them.
  // Nearly every element ranks below that front, so the pass is one
  // well-predicted compare per element.
  const auto before = [&](int a, int b) { return Before(scores, a, b); };
  std::vector<int> best;
  best.reserve(k);
  for (int i = 0; i < static_cast<int>(total); ++i) {
    if (static_cast<int>(best.size()) < k) {
      best.push_back(i);
      std::push_heap(best.begin(), best.end(), before);
    } else if (before(i, best.front())) {
      std::pop_heap(best.begin(), best.end(), before);
      best.back() = i;
      std::push_heap(best.begin(), best.end(), before);
    }
  }
  std::sort(best.begin(), best.end(), before);
  return best;
}

}  // namespace kvq
