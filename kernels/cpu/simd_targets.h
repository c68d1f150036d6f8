// Which Highway targets the cpu backend compiles, included before any Highway
// header by every kernels/cpu/simd_* file.
//
// Dynamic dispatch picks the best compiled target the running CPU supports.
// We build AVX2 (the machines this project runs on: AVX2 + FMA + F16C), SSE4
// and the portable EMU128 baseline, so the binary still runs on a CPU without
// AVX2. AVX-512 targets are skipped to keep compile time down (such CPUs run
// the AVX2 code); SSSE3 adds nothing over SSE4 for us.
#ifndef KVQ_KERNELS_CPU_SIMD_TARGETS_H_
#define KVQ_KERNELS_CPU_SIMD_TARGETS_H_

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_AVX3 | HWY_AVX3_DL)
#endif

#endif  // KVQ_KERNELS_CPU_SIMD_TARGETS_H_
