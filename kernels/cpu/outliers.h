// Choosing the sparse outliers of one quantization block (KVQuant's
// dense-and-sparse split).
#ifndef KVQ_KERNELS_CPU_OUTLIERS_H_
#define KVQ_KERNELS_CPU_OUTLIERS_H_

#include <vector>

#include "kernels/page_layout.h"

namespace kvq {

// Returns the `k` elements of a [rows, d] block that stand furthest out of
// their quantization group, as indices t * d + c, most extreme first.
//
// "Out" is measured robustly within the group the element is quantized
// with: |x - median| / (median absolute deviation + eps), where the group is
// the channel's column for per-channel sides and the token's run of
// group_channels for per-token sides. An isolated extreme value widens its
// group's range the most, so it is the one worth storing exactly; a channel
// that is large everywhere (a stable outlier channel) scores low, because
// per-channel scales already absorb it. Ties break to the lower index.
//
// Scores are computed with SIMD sorting networks where the group size allows
// (kernels/cpu/simd_outliers.h) and the top k by selection: the same indices
// in the same order as SelectOutliersRef, the scalar version, which the
// tests compare it with.
std::vector<int> SelectOutliers(const float* block, int rows, int d, const SideLayout& side,
                                int k);
std::vector<int> SelectOutliersRef(const float* block, int rows, int d, const SideLayout& side,
                                   int k);

}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_OUTLIERS_H_
