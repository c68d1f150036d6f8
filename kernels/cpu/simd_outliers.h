// SIMD scoring behind SelectOutliers (kernels/cpu/outliers.h).
#ifndef KVQ_KERNELS_CPU_SIMD_OUTLIERS_H_
#define KVQ_KERNELS_CPU_SIMD_OUTLIERS_H_

#include "kernels/page_layout.h"

namespace kvq {
namespace cpu {

// Writes the robust score of every element of a [rows, d] block into
// scores[t * d + c], bit-identical to the scalar scoring of
// SelectOutliersRef. Returns false, writing nothing, when the group size is
// not a power of two in [2, 256] or the groups do not fill whole vectors;
// the caller then scores with the scalar code.
bool ScoreOutliersSimd(const float* block, int rows, int d, const SideLayout& side,
                       float* scores);

}  // namespace cpu
}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_SIMD_OUTLIERS_H_
