// ParallelFor: every index exactly once, on at most the threads asked for,
// with the pool serving one call at a time and calls it cannot serve (nested,
// concurrent) running on threads of their own.
#include "client/parallel_for.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvq {
namespace {

// Runs ParallelFor and returns how often each index ran and on how many
// distinct threads.
struct Ran {
  std::vector<int> times;
  size_t threads = 0;
};
Ran RunLoop(int count, int threads) {
  std::vector<std::atomic<int>> times(static_cast<size_t>(count));
  std::mutex mu;
  std::set<std::thread::id> ids;
  ParallelFor(count, threads, [&](int i) {
    times[i].fetch_add(1);
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  Ran r;
  for (const std::atomic<int>& t : times) r.times.push_back(t.load());
  r.threads = ids.size();
  return r;
}

TEST(ParallelForTest, EveryIndexOnceOnAtMostTheThreadsAsked) {
  for (int count : {1, 2, 3, 7, 64, 1000}) {
    for (int threads : {1, 2, 3, 5, 0}) {
      const Ran r = RunLoop(count, threads);
      EXPECT_EQ(r.times, std::vector<int>(count, 1)) << count << " x " << threads;
      const int cap = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
      EXPECT_LE(r.threads, static_cast<size_t>(std::max(1, std::min(cap, count))))
          << count << " x " << threads;
    }
  }
}

TEST(ParallelForTest, OneThreadRunsInOrderOnTheCaller) {
  std::vector<int> order;
  const std::thread::id caller = std::this_thread::get_id();
  bool elsewhere = false;
  ParallelFor(5, 1, [&](int i) {
    order.push_back(i);
    elsewhere |= std::this_thread::get_id() != caller;
  });
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_FALSE(elsewhere);
}

TEST(ParallelForTest, NothingToDoRunsNothing) {
  int calls = 0;
  ParallelFor(0, 4, [&](int) { ++calls; });
  ParallelFor(-3, 4, [&](int) { ++calls; });
  EXPECT_EQ(calls, 0);
}

// A loop inside a loop finds the pool serving its parent and starts its own
// threads: it completes instead of waiting for helpers that are busy with it.
TEST(ParallelForTest, NestedCallsComplete) {
  std::vector<std::atomic<int>> times(8 * 16);
  ParallelFor(8, 3, [&](int i) {
    ParallelFor(16, 3, [&](int j) { times[16 * i + j].fetch_add(1); });
  });
  for (size_t k = 0; k < times.size(); ++k) EXPECT_EQ(times[k].load(), 1) << k;
}

TEST(ParallelForTest, ConcurrentCallersEachGetEveryIndex) {
  constexpr int kCallers = 4, kRounds = 50, kCount = 37;
  std::vector<int> bad(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < kRounds; ++round) {
        const Ran r = RunLoop(kCount, 2);
        if (r.times != std::vector<int>(kCount, 1)) ++bad[c];
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(bad, std::vector<int>(kCallers, 0));
}

}  // namespace
}  // namespace kvq
