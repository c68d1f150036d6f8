#include "kernels/cpu/outliers.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
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
  // The first k of the total order (score, then lower index), as
  // partial_sort gives them, without ordering every element: the k-th
  // largest maximum of the runs of 16 is a floor T. At least k elements (one
  // per such run) score >= T, so nothing below T can be among the first k;
  // the few elements at or above T are ordered instead.
  const int n = static_cast<int>(total);
  const int runs = n / 16;
  std::vector<float> run_max(runs);
  for (int r = 0; r < runs; ++r) {
    const float* x = scores.data() + 16 * r;
    float m = x[0];
    for (int l = 1; l < 16; ++l) m = x[l] > m ? x[l] : m;
    run_max[r] = m;
  }
  float floor = -std::numeric_limits<float>::infinity();
  if (runs >= k) {
    std::vector<float> maxima = run_max;
    std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<>());
    floor = maxima[k - 1];
  }
  std::vector<std::pair<float, int>> candidates;
  auto take = [&](int i) {
    if (scores[i] >= floor) candidates.push_back({scores[i], i});
  };
  for (int r = 0; r < runs; ++r) {
    if (run_max[r] < floor) continue;
    for (int i = 16 * r; i < 16 * r + 16; ++i) take(i);
  }
  for (int i = 16 * runs; i < n; ++i) take(i);
  const int kept = std::min(k, static_cast<int>(candidates.size()));
  std::partial_sort(candidates.begin(), candidates.begin() + kept, candidates.end(),
                    [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
                      return a.first != b.first ? a.first > b.first : a.second < b.second;
                    });
  std::vector<int> out(kept);
  for (int j = 0; j < kept; ++j) out[j] = candidates[j].second;
  return out;
}

}  // namespace kvq
