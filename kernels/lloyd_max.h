// Lloyd-Max levels of the standard normal distribution: the scalar codebook
// that minimizes the mean squared error of coding N(0, 1) samples at a given
// number of bits (crq's codebook, kernels/hd/crq_hd.h).
//
// They are constants of the crq format, computed here rather than stored:
// 2000 Lloyd iterations in double precision on the Gaussian density, from
// levels spread evenly over [-3, 3], then rounded to float. The iteration
// converges well within that (the 4-bit MSE moves by < 1e-9 over the last
// hundred), so every build computes the same floats. Values (positive half;
// the levels are symmetric):
//   1 bit  0.79788                                    MSE 0.36338
//   2 bits 0.45278 1.51042                            MSE 0.11748
//   3 bits 0.24509 0.75601 1.34391 2.15195            MSE 0.03455
//   4 bits 0.12840 0.38805 0.65676 0.94234 1.25623 1.61805 2.06902 2.73259
//                                                     MSE 0.00950
#ifndef KVQ_KERNELS_LLOYD_MAX_H_
#define KVQ_KERNELS_LLOYD_MAX_H_

#include <vector>

namespace kvq {

struct LloydMaxCodebook {
  int bits = 0;
  std::vector<float> levels;      // 2^bits, ascending, levels[i] == -levels[n-1-i].
  std::vector<float> thresholds;  // 2^bits - 1 midpoints: code = #thresholds < x.
  double mse = 0.0;               // E[(X - level(X))^2] for X ~ N(0, 1).
};

// bits in [1, 4]; computed once, then cached (thread-safe).
const LloydMaxCodebook& LloydMax(int bits);

}  // namespace kvq

#endif  // KVQ_KERNELS_LLOYD_MAX_H_
