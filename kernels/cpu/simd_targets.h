// Which Highway targets the cpu backend compiles, included before any Highway
// header by every kernels/cpu/simd_* file.
//
// Dynamic dispatch picks the best compiled target the running CPU supports
// (simd_dispatch.h can pin a lower one). We build:
//  * AVX3_DL (AVX3 plus VNNI and VBMI: Ice Lake and later Xeons, Zen 4):
//    the AVX3 code with integer dot products (vpdpwssd, vpdpbusd) and byte
//    permutes in the kivi decode loops;
//  * AVX3 (AVX-512 F/VL/DQ/BW: Skylake-SP and later Xeons, Zen 4): the AVX2
//    code plus 512-bit versions of the hottest integer-path loops;
//  * AVX2 (+ FMA + F16C), the floor of the machines this project runs on;
//  * the portable baseline Highway always adds (SCALAR with this compiler),
//    so the binary still runs, correctly but slowly, on a CPU without AVX2.
// SSE4 is skipped to keep compile time down.
//
// Every generic (Highway) loop of the kernels uses 256-bit tags, also on
// AVX3: their tile layouts and the hand-written AVX2 blocks assume 8 float
// lanes, so AVX3 runs exactly the AVX2 arithmetic except where a block is
// written for 512 bits (marked KVQ_X86_AVX3).
#ifndef KVQ_KERNELS_CPU_SIMD_TARGETS_H_
#define KVQ_KERNELS_CPU_SIMD_TARGETS_H_

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4)
#endif
// Highway only attains AVX3_DL on request.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#endif  // KVQ_KERNELS_CPU_SIMD_TARGETS_H_

// True in the translation pass of a target with the AVX2 intrinsics (AVX2,
// AVX3, AVX3_DL), with the AVX-512 ones (AVX3, AVX3_DL), with VNNI and VBMI
// (AVX3_DL). Outside the include guard: HWY_TARGET changes between the
// passes of foreach_target.h, and the macros are read at each use.
#ifndef KVQ_X86_AVX2
#define KVQ_X86_AVX2 \
  (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
#define KVQ_X86_AVX3 (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
#define KVQ_X86_VNNI (HWY_TARGET == HWY_AVX3_DL)
#endif
