// Group parameters (scale and zero point) of quantized pages, in the two
// formats a SideLayout stores them in. Every kernel that writes or reads
// them goes through here, so the encoding exists once.
//
// param_bits 16 (default): per entry, fp16 scale[n] then fp16 zero[n] (an
// entry is a block for channel groups, a token row for token groups).
//
// param_bits 8 (`p8`, double quantization): per block, an 8-byte header
//   {fp16 scale_step, fp16 zero_base, fp16 zero_step, 0}
// then one u8 scale code per group of the block, then one u8 zero code per
// group (groups in entry order: channel c, or row * n + group). Decoded:
//   scale = scale_code * scale_step
//   zero  = zero_base + zero_code * zero_step
// Both products are exact in float (8-bit times 11-bit significands), so
// every backend decodes the same floats whether or not it fuses the add.
//
// The encoder never narrows a group's range: zero codes round down and
// scale codes round up from the range left above the decoded zero, so the
// decoded [zero, zero + scale * top] covers every element of the group and
// no code clips. The price is a slightly wider step (at most one zero step
// and one scale step), which the round-trip bound of a group includes.
#ifndef KVQ_KERNELS_GROUP_PARAMS_H_
#define KVQ_KERNELS_GROUP_PARAMS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/page_layout.h"

namespace kvq {

// Writes the parameters of `entries` entries starting at `first_entry` from
// each group's element range [lo, hi] (arrays of entries * n, entry-major; a
// group with lo > hi, every element an outlier, gets the range [0, 0]) and
// returns in scale / zero (same shape) the floats a reader will decode, which
// the caller quantizes its codes with (MakeGroupParams' rule for fp16: for
// nuq the scale spans the whole range). For param_bits 8 the entries must
// cover whole blocks.
void StoreGroupParams(const PageLayout& L, const SideLayout& S, uint8_t* page, int first_entry,
                      int entries, const float* lo, const float* hi, bool nuq, float* scale,
                      float* zero);

// Decodes `entries` entries starting at `first_entry` into out, per entry
// scale[n] then zero[n] (the fp16 layout, whatever the storage format).
// Scalar; the SIMD kernels convert fp16 parameters themselves.
void LoadGroupParams(const PageLayout& L, const SideLayout& S, const uint8_t* page,
                     int first_entry, int entries, float* out);

// The decoded header of one p8 parameter block.
struct Params8Steps {
  float scale_step = 0.0f;
  float zero_base = 0.0f;
  float zero_step = 0.0f;
};
Params8Steps ReadParams8Steps(const uint8_t* block);

// Checks the stored parameters of the first `rows` rows of a page that
// arrived from outside: scales finite and >= 0, zero points finite. The
// message names the entry ("row" or "block") and the parameter. The page
// may lie at any address (inside a received message).
absl::Status CheckGroupParams(const PageLayout& L, const SideLayout& S, const uint8_t* page,
                              int rows);

// fp16 rounding toward -inf / +inf (the p8 encoder's directed rounding).
uint16_t FloatToHalfDown(float f);
uint16_t FloatToHalfUp(float f);

}  // namespace kvq

#endif  // KVQ_KERNELS_GROUP_PARAMS_H_
