#include "kernels/hadamard.h"

#include <cmath>
#include <random>

namespace kvq {

void WalshHadamard(float* x, int n) {
  for (int len = 1; len < n; len <<= 1) {
    for (int i = 0; i < n; i += len << 1) {
      for (int j = i; j < i + len; ++j) {
        const float a = x[j];
        const float b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
}

HadamardRotation::HadamardRotation(int dim, uint64_t seed) : dim_(dim), signs_(dim) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < dim; ++i) signs_[i] = (rng() & 1) ? -1.0f : 1.0f;
}

void HadamardRotation::Forward(float* x) const {
  for (int i = 0; i < dim_; ++i) x[i] *= signs_[i];
  WalshHadamard(x, dim_);
  const float norm = 1.0f / std::sqrt(static_cast<float>(dim_));
  for (int i = 0; i < dim_; ++i) x[i] *= norm;
}

void HadamardRotation::Inverse(float* x) const {
  // H^T = diag(signs) * W / sqrt(d), W symmetric.
  WalshHadamard(x, dim_);
  const float norm = 1.0f / std::sqrt(static_cast<float>(dim_));
  for (int i = 0; i < dim_; ++i) x[i] *= norm * signs_[i];
}

}  // namespace kvq
