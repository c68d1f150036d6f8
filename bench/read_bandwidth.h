// Streaming-read bandwidth of this machine (the bound a decode-attention
// kernel that reads every KV byte once can approach), and a cache evictor so
// timed calls start cold.
#ifndef KVQ_BENCH_READ_BANDWIDTH_H_
#define KVQ_BENCH_READ_BANDWIDTH_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvq {

struct ReadBandwidth {
  double bytes_per_second = 0.0;  // Median over the passes.
  std::vector<double> passes;     // Bytes per second of every pass.
  size_t buffer_bytes = 0;
  int threads = 0;
};

// Sums a `buffer_bytes` buffer (touched once first) `passes` times with
// `threads` OpenMP threads taking 1 MiB chunks dynamically.
ReadBandwidth MeasureReadBandwidth(size_t buffer_bytes, int passes, int threads);

// Reads a buffer larger than the last-level cache, so whatever a timed call
// reads afterwards comes from memory (as in a decode step, where the other
// layers' KV and weights pass through the cache in between).
class CacheEvictor {
 public:
  // 0 bytes: Evict() does nothing.
  CacheEvictor(size_t bytes, int threads);
  ~CacheEvictor();
  CacheEvictor(const CacheEvictor&) = delete;
  CacheEvictor& operator=(const CacheEvictor&) = delete;

  void Evict();
  size_t bytes() const { return words_ * sizeof(uint64_t); }

 private:
  uint64_t* data_ = nullptr;
  size_t words_ = 0;
  int threads_ = 1;
  uint64_t sink_ = 0;
};

}  // namespace kvq

#endif  // KVQ_BENCH_READ_BANDWIDTH_H_
