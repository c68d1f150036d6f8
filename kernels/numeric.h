// Scalar conversions between float and the narrow storage types kvq uses.
// These are the reference definitions: SIMD paths must round the same way
// (round to nearest even) so that the typed tests can compare bit for bit.
#ifndef KVQ_KERNELS_NUMERIC_H_
#define KVQ_KERNELS_NUMERIC_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/hd/numeric_hd.h"

namespace kvq {

// Largest finite IEEE half: inputs beyond it cannot be stored in fp16 pages.
inline constexpr float kFp16Max = 65504.0f;
// Largest finite bfloat16 (0x7f7f); floats beyond it round to infinity.
inline constexpr float kBf16Max = 3.38953139e38f;
// Largest finite OCP FP8 E4M3 ("fn") value.
inline constexpr float kFp8E4m3Max = 448.0f;

// Element i of a 16-bit row that need not be 2-byte aligned: a tensor
// inside a serialized message starts wherever its header ends. memcpy is
// the defined access (a plain load or store once optimized); indexing a
// misaligned uint16_t* is undefined behaviour, and the sanitizer build
// stops on it.
inline uint16_t Load16(const void* row, size_t i) {
  uint16_t x;
  std::memcpy(&x, static_cast<const unsigned char*>(row) + 2 * i, 2);
  return x;
}
inline void Store16(void* row, size_t i, uint16_t x) {
  std::memcpy(static_cast<unsigned char*>(row) + 2 * i, &x, 2);
}

// The conversions are KVQ_HD functions (kernels/hd/numeric_hd.h): one
// definition for the host, the SIMD kernels' scalar edges and the CUDA
// kernels. IEEE binary16 and bfloat16 round to nearest even (fp16
// overflows to infinity); OCP FP8 E4M3 (bias 7, no infinities, 0x7f/0xff
// NaN) rounds to nearest even and saturates at +-448. RoundToHalf is the
// value a half-precision field holds.
using hd::Bf16ToFloat;
using hd::BitsToFloat;
using hd::FloatBits;
using hd::FloatToBf16;
using hd::FloatToFp8E4m3;
using hd::FloatToHalf;
using hd::Fp8E4m3ToFloat;
using hd::HalfToFloat;
using hd::RoundToHalf;

}  // namespace kvq

#endif  // KVQ_KERNELS_NUMERIC_H_
