// Which Highway targets the cpu backend compiles, included before any Highway
// header by every kernels/cpu/simd_* file.
//
// Dynamic dispatch picks the best compiled target the running CPU supports.
// We build AVX2 (the machines this project runs on: AVX2 + FMA + F16C) and
// the portable baseline Highway always adds (SCALAR with this compiler), so
// the binary still runs, correctly but slowly, on a CPU without AVX2. Every
// other target is skipped to keep compile time down: AVX-512 CPUs run the
// AVX2 code, and SSE4-only CPUs are too rare to pay a third copy of the
// kernels for.
#ifndef KVQ_KERNELS_CPU_SIMD_TARGETS_H_
#define KVQ_KERNELS_CPU_SIMD_TARGETS_H_

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4 | HWY_AVX3 | HWY_AVX3_DL)
#endif

#endif  // KVQ_KERNELS_CPU_SIMD_TARGETS_H_
