// Timing helpers the bench subcommands share: a steady clock's seconds and
// the median of timed calls (the middle two averaged for an even count).
#ifndef KVQ_BENCH_BENCH_STATS_H_
#define KVQ_BENCH_BENCH_STATS_H_

#include <algorithm>
#include <chrono>
#include <vector>

namespace kvq::bench {

using Clock = std::chrono::steady_clock;

inline double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// 0 for no values.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace kvq::bench

#endif  // KVQ_BENCH_BENCH_STATS_H_
