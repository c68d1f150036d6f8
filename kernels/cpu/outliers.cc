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
  // keeping the k best so far sorted, best first, as (score, index) pairs.
  // Every element met later has a higher index than all kept, so it enters
  // exactly when its score is strictly above the last kept, and goes after
  // any kept equal score. Runs of 16 are tested against that threshold by
  // their maximum; only a run with a candidate goes element by element, and
  // an entry moves at most k pairs (k is ~1% of the block).
  const int n = static_cast<int>(total);
  const int kept = std::min(k, n);
  std::vector<std::pair<float, int>> best(kept);
  for (int i = 0; i < kept; ++i) best[i] = {scores[i], i};
  const auto better = [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  std::sort(best.begin(), best.end(), better);
  auto offer = [&](int i) {
    const float x = scores[i];
    if (!(x > best.back().first)) return;
    int at = kept - 1;  // Slide worse pairs down over the dropped last one.
    while (at > 0 && best[at - 1].first < x) {
      best[at] = best[at - 1];
      --at;
    }
    best[at] = {x, i};
  };
  int i = kept;
  for (; i + 16 <= n; i += 16) {
    float run_max = scores[i];  // The form compilers vectorize (maxps).
    for (int l = 1; l < 16; ++l) run_max = scores[i + l] > run_max ? scores[i + l] : run_max;
    if (!(run_max > best.back().first)) continue;
    for (int l = 0; l < 16; ++l) offer(i + l);
  }
  for (; i < n; ++i) offer(i);
  std::vector<int> out(kept);
  for (int j = 0; j < kept; ++j) out[j] = best[j].second;
  return out;
}

}  // namespace kvq
