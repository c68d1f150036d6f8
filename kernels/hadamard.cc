#include "kernels/hadamard.h"

#include <random>

#include "kernels/hd/attention_hd.h"

// The butterflies and norms are attention_hd.h's, which the device kernels
// and cuda_host run too: one definition of the rotation's arithmetic.
namespace kvq {

void WalshHadamard(float* x, int n) {
  for (int len = 1; len < n; len <<= 1) hd::WalshHadamardStage(x, n, len);
}

HadamardRotation::HadamardRotation(int dim, uint64_t seed) : dim_(dim), signs_(dim) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < dim; ++i) signs_[i] = (rng() & 1) ? -1.0f : 1.0f;
}

void HadamardRotation::Forward(float* x) const { hd::HadamardForward(signs_.data(), dim_, x); }

// H^T = diag(signs) * W / sqrt(d), W symmetric.
void HadamardRotation::Inverse(float* x) const { hd::HadamardInverse(signs_.data(), dim_, x); }

}  // namespace kvq
