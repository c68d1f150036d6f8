#include "kernels/cpu/outliers.h"

#include <algorithm>
#include <cmath>
#include <numeric>

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

}  // namespace

std::vector<int> SelectOutliers(const float* block, int rows, int d, const SideLayout& side,
                                int k) {
  std::vector<float> scores(static_cast<size_t>(rows) * d);
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
  std::vector<int> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
    return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
  });
  order.resize(k);
  return order;
}

}  // namespace kvq
