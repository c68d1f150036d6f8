// The input format of raw_page_fuzz, shared with the seed corpus generator
// (make_fuzz_corpus.cc): [scheme][shape][tokens][cut] then the page bytes.
#ifndef KVQ_TESTS_FUZZ_RAW_PAGE_INPUT_H_
#define KVQ_TESTS_FUZZ_RAW_PAGE_INPUT_H_

#include <cstdint>

#include "kernels/backend.h"

namespace kvq::fuzz {

// Every page feature: fp16/bf16/int8 rows, 2/3/4-bit codes, split key and
// value bits, p8 parameters, outliers, sink, nuq, rotate, pre_rope,
// per-token keys, a residual window; fp8_e4m3 takes no raw pages.
inline constexpr const char* kPageSchemes[] = {
    "fp16",
    "bf16",
    "int8",
    "fp8_e4m3",
    "kivi2:g8:r0",
    "kivi3:g16:r0",
    "kivi4:g32:r0",
    "kivi4:v2:g16:r0:p8",
    "kivi2:v4:g8:r16",
    "kivi2:g16:r0:outliers=5",
    "kivi3:g8:r0:p8:outliers=2",
    "kivi4:g16:r0:sink=4",
    "kivi2:g16:r0:nuq",
    "kivi4:g16:r0:rotate",
    "kivi3:g16:r0:pre_rope",
    "kivi2:g16:r0:ktok",
    "kivi4:v3:g8:r0:fit:p8",
    "kivi2:g16:r0:pre_rope:outliers=1:sink=4:nuq",
    "kivi3:g8:r0:p8:rotate:ktok:outliers=10",
};
inline constexpr int kNumPageSchemes = sizeof(kPageSchemes) / sizeof(kPageSchemes[0]);

// What the shape byte selects.
struct PageShape {
  int head_dim;
  const KernelBackend* backend;
  bool prefill;  // One page of dense tokens precedes the raw pages.
};
inline PageShape DecodePageShape(uint8_t b) {
  static constexpr int kHeadDims[] = {16, 32, 64};
  return {kHeadDims[b % 3], (b / 3) % 2 ? &CpuBackend() : &RefBackend(), (b / 6) % 2 != 0};
}

// Tokens the raw pages claim: mostly whole flushes (what validation is
// about), sometimes any count (what the flush check is about).
inline int DecodePageTokens(uint8_t b, int flush, int page_tokens) {
  return b < 224 ? flush * (1 + b % 4) : (b % 32) * (page_tokens / 8 + 1) - 3;
}

}  // namespace kvq::fuzz

#endif  // KVQ_TESTS_FUZZ_RAW_PAGE_INPUT_H_
