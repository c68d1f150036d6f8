// What a KvStream's device view needs besides pointers, built on the host
// once for every user: the cuda_host backend, the CUDA backend's uploads
// and the GPU tests. No CUDA headers.
#ifndef KVQ_KERNELS_CUDA_STREAM_VIEW_HOST_H_
#define KVQ_KERNELS_CUDA_STREAM_VIEW_HOST_H_

#include <vector>

#include "kernels/hd/device_stream_view.h"
#include "kernels/kv_stream.h"

namespace kvq {

// The stream's nuq levels of one side as floats, channel-major (the form
// hd::SideExtras takes); empty for uniform codes.
std::vector<float> LevelsAsFloats(const KvStream& s, Side side);

// One side's extras with `levels` (null for uniform codes) and the fp8 scale.
hd::SideExtras ExtrasFor(const KvStream& s, Side side, const float* levels);

// The stream's view with every count, its layout, its RoPE parameters and
// its fp8 scales filled in, and every pointer null: the caller points them
// at host memory (cuda_host) or at device copies (cuda).
DeviceStreamView ViewWithoutPointers(const KvStream& s);

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_STREAM_VIEW_HOST_H_
