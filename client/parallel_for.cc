#include "client/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace kvq {

void ParallelFor(int count, int threads, const std::function<void(int)>& fn) {
  if (count <= 0) return;
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  threads = std::clamp(threads, 1, count);
  std::atomic<int> next{0};
  auto work = [&] {
    for (int i = next++; i < count; i = next++) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace kvq
