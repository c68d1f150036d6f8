#include "bench/dot_rate.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvq {
namespace {

constexpr int64_t kSteps = int64_t{1} << 20;  // 16 instructions per step.

#if defined(__x86_64__)
// 16 independent accumulators: more than the instruction's latency times the
// ports that run it, so the loop is bound by issue, not by a chain.
// Unsigned sums wrap, as the lanes do: the value only keeps the chains alive.
__attribute__((target("avx512f,avx512vnni"))) uint32_t DotChains(int64_t steps) {
  __m512i u = _mm512_set1_epi8(3);
  __m512i s = _mm512_set1_epi8(-5);
  // Operands the compiler cannot see, so it cannot fold the products.
  asm volatile("" : "+v"(u), "+v"(s));
  // Named registers: an indexed array stays on the stack at -O2.
  // Different starting values: identical chains would be merged into one.
  __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2),
          a3 = _mm512_set1_epi32(3), a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5),
          a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7), a8 = _mm512_set1_epi32(8),
          a9 = _mm512_set1_epi32(9), a10 = _mm512_set1_epi32(10), a11 = _mm512_set1_epi32(11),
          a12 = _mm512_set1_epi32(12), a13 = _mm512_set1_epi32(13), a14 = _mm512_set1_epi32(14),
          a15 = _mm512_set1_epi32(15);
  for (int64_t i = 0; i < steps; ++i) {
    a0 = _mm512_dpbusd_epi32(a0, u, s);
    a1 = _mm512_dpbusd_epi32(a1, u, s);
    a2 = _mm512_dpbusd_epi32(a2, u, s);
    a3 = _mm512_dpbusd_epi32(a3, u, s);
    a4 = _mm512_dpbusd_epi32(a4, u, s);
    a5 = _mm512_dpbusd_epi32(a5, u, s);
    a6 = _mm512_dpbusd_epi32(a6, u, s);
    a7 = _mm512_dpbusd_epi32(a7, u, s);
    a8 = _mm512_dpbusd_epi32(a8, u, s);
    a9 = _mm512_dpbusd_epi32(a9, u, s);
    a10 = _mm512_dpbusd_epi32(a10, u, s);
    a11 = _mm512_dpbusd_epi32(a11, u, s);
    a12 = _mm512_dpbusd_epi32(a12, u, s);
    a13 = _mm512_dpbusd_epi32(a13, u, s);
    a14 = _mm512_dpbusd_epi32(a14, u, s);
    a15 = _mm512_dpbusd_epi32(a15, u, s);
  }
  const __m512i sum = _mm512_add_epi32(
      _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                       _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7))),
      _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)),
                       _mm512_add_epi32(_mm512_add_epi32(a12, a13), _mm512_add_epi32(a14, a15))));
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, sum);
  uint32_t total = 0;
  for (int32_t x : lanes) total += static_cast<uint32_t>(x);
  return total;
}
#endif

}  // namespace

DotRate MeasureDotRate(int passes, int threads) {
  DotRate result;
  result.threads = std::max(1, threads);
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512vnni")) return result;
  volatile uint32_t sink = 0;
  sink = sink + DotChains(kSteps / 16);  // Warm-up: the clock settles under load.
  for (int pass = 0; pass < std::max(1, passes); ++pass) {
    const auto start = std::chrono::steady_clock::now();
    uint32_t total = 0;
#pragma omp parallel num_threads(result.threads) reduction(+ : total)
    total += DotChains(kSteps);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sink = sink + total;
    result.passes.push_back(seconds / (16.0 * static_cast<double>(kSteps)));
  }
  std::vector<double> sorted = result.passes;
  std::sort(sorted.begin(), sorted.end());
  result.seconds = sorted[sorted.size() / 2];
#endif
  return result;
}

double KiviDotsPerToken(int rows, int d) { return 2.0 * (2.0 * rows * d / 64.0); }

}  // namespace kvq
