// Randomized Hadamard rotation over head_dim (the QuaRot / TurboQuant idea).
//
// H = (1/sqrt(d)) * Walsh-Hadamard * diag(signs), with signs drawn from a
// fixed seed. H is orthonormal, so q.k == (Hq).(Hk) and keys, queries and
// values can be stored rotated: one outlier channel is spread over all d
// channels, which shrinks every group's quantization range.
#ifndef KVQ_KERNELS_HADAMARD_H_
#define KVQ_KERNELS_HADAMARD_H_

#include <cstdint>
#include <vector>

namespace kvq {

class HadamardRotation {
 public:
  // `dim` must be a power of two.
  HadamardRotation(int dim, uint64_t seed);

  int dim() const { return dim_; }
  // x <- H x.
  void Forward(float* x) const;
  // x <- H^T x (the inverse).
  void Inverse(float* x) const;
  // The +-1 of diag(signs), for kernels that apply H themselves.
  const std::vector<float>& signs() const { return signs_; }

 private:
  int dim_;
  std::vector<float> signs_;
};

// In-place unnormalized fast Walsh-Hadamard transform of length n (power of 2).
void WalshHadamard(float* x, int n);

}  // namespace kvq

#endif  // KVQ_KERNELS_HADAMARD_H_
