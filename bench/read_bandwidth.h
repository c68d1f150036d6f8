// Streaming-read bandwidth of this machine: the bound a decode-attention
// kernel that reads every KV byte once can approach.
#ifndef KVQ_BENCH_READ_BANDWIDTH_H_
#define KVQ_BENCH_READ_BANDWIDTH_H_

#include <cstddef>
#include <vector>

namespace kvq {

struct ReadBandwidth {
  double bytes_per_second = 0.0;   // Median over the passes.
  std::vector<double> passes;      // Bytes per second of every pass.
  size_t buffer_bytes = 0;
  int threads = 0;
};

// Sums a `buffer_bytes` buffer (touched once first) with `threads` OpenMP
// threads, each reading its own contiguous share, `passes` times.
ReadBandwidth MeasureReadBandwidth(size_t buffer_bytes, int passes, int threads);

}  // namespace kvq

#endif  // KVQ_BENCH_READ_BANDWIDTH_H_
