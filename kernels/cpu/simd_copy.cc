// StreamLines: whole 64-byte lines copied with non-temporal stores (see
// kernels/line_streamer.h for why and when).

#include "kernels/cpu/simd_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/simd_copy.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cstdint>
#include <cstring>

#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "kernels/cpu/simd_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void StreamLinesImpl(uint8_t* dst, const uint8_t* src, size_t lines) {
  const hn::ScalableTag<uint8_t> d;
  const size_t N = hn::Lanes(d);
  if (N < 16 || kStreamLine % N != 0) {  // The portable target: plain copies.
    std::memcpy(dst, src, lines * kStreamLine);
    return;
  }
  for (size_t i = 0; i < lines * kStreamLine; i += kStreamLine) {
    for (size_t j = 0; j < kStreamLine; j += N) hn::Stream(hn::LoadU(d, src + i + j), d, dst + i + j);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace cpu
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq {
namespace cpu {

HWY_EXPORT(StreamLinesImpl);

void StreamLines(uint8_t* dst, const uint8_t* src, size_t lines) {
  HWY_DYNAMIC_DISPATCH(StreamLinesImpl)(dst, src, lines);
}

void FenceStreams() { hwy::FlushStream(); }

}  // namespace cpu
}  // namespace kvq
#endif
