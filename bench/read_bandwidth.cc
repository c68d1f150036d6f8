#include "bench/read_bandwidth.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace kvq {
namespace {

// Four independent accumulators keep the loop load-bound, not add-bound.
uint64_t SumWords(const uint64_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  for (; i < n; ++i) a += p[i];
  return a + b + c + d;
}

}  // namespace

ReadBandwidth MeasureReadBandwidth(size_t buffer_bytes, int passes, int threads) {
  ReadBandwidth result;
  const size_t words = std::max<size_t>(buffer_bytes / sizeof(uint64_t), 1024);
  result.buffer_bytes = words * sizeof(uint64_t);
  result.threads = std::max(1, threads);
  struct Free {
    void operator()(uint64_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint64_t, Free> buffer(
      static_cast<uint64_t*>(std::aligned_alloc(64, (words * sizeof(uint64_t) + 63) / 64 * 64)));
  if (!buffer) return result;
  uint64_t* data = buffer.get();
  // First touch from the threads that will read, so pages are mapped (and
  // placed) before timing.
#pragma omp parallel for num_threads(result.threads) schedule(static)
  for (size_t i = 0; i < words; ++i) data[i] = i * 0x9e3779b97f4a7c15ull;

  // Threads take 1 MiB chunks dynamically, so a thread that the OS
  // deschedules (shared machines) does not hold the pass back.
  constexpr size_t kChunkWords = (size_t{1} << 20) / sizeof(uint64_t);
  const int64_t chunks = static_cast<int64_t>((words + kChunkWords - 1) / kChunkWords);
  volatile uint64_t sink = 0;
  for (int pass = 0; pass < std::max(1, passes); ++pass) {
    uint64_t total = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(result.threads) schedule(dynamic, 1) reduction(+ : total)
    for (int64_t c = 0; c < chunks; ++c) {
      const size_t begin = static_cast<size_t>(c) * kChunkWords;
      total += SumWords(data + begin, std::min(kChunkWords, words - begin));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sink = sink + total;
    result.passes.push_back(static_cast<double>(result.buffer_bytes) / seconds);
  }
  std::vector<double> sorted = result.passes;
  std::sort(sorted.begin(), sorted.end());
  result.bytes_per_second = sorted[sorted.size() / 2];
  return result;
}

CacheEvictor::CacheEvictor(size_t bytes, int threads)
    : words_(bytes / sizeof(uint64_t)), threads_(std::max(1, threads)) {
  if (words_ == 0) return;
  data_ =
      static_cast<uint64_t*>(std::aligned_alloc(64, (words_ * sizeof(uint64_t) + 63) / 64 * 64));
  if (data_ == nullptr) {
    words_ = 0;
    return;
  }
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (size_t i = 0; i < words_; ++i) data_[i] = i;
}

CacheEvictor::~CacheEvictor() { std::free(data_); }

void CacheEvictor::Evict() {
  if (words_ == 0) return;
  uint64_t total = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : total)
  {
    const int n = omp_get_num_threads();
    const int id = omp_get_thread_num();
    const size_t begin = words_ * id / n;
    const size_t end = words_ * (id + 1) / n;
    total += SumWords(data_ + begin, end - begin);
  }
  sink_ += total;
}

}  // namespace kvq
