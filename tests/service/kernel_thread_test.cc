#include "service/kernel_thread.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace kvq {
namespace {

TEST(KernelThreadTest, RunsEveryCallOnOneOtherThreadAndReturnsItsStatus) {
  KernelThread kernel;
  std::thread::id first, second;
  EXPECT_TRUE(kernel.Run([&] {
                first = std::this_thread::get_id();
                return absl::OkStatus();
              }).ok());
  const absl::Status st = kernel.Run([&] {
    second = std::this_thread::get_id();
    return absl::InvalidArgumentError("q: attention task 3: q[0][1] is not finite");
  });
  EXPECT_EQ(st, absl::InvalidArgumentError("q: attention task 3: q[0][1] is not finite"));
  EXPECT_EQ(first, second);
  EXPECT_NE(first, std::this_thread::get_id());
}

TEST(KernelThreadTest, ConcurrentCallersRunOneAtATime) {
  KernelThread kernel;
  std::atomic<int> active{0}, most{0}, done{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        ASSERT_TRUE(kernel.Run([&] {
                      const int now = ++active;
                      int seen = most.load();
                      while (now > seen && !most.compare_exchange_weak(seen, now)) {
                      }
                      std::this_thread::yield();
                      --active;
                      ++done;
                      return absl::OkStatus();
                    }).ok());
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(done.load(), 200);
  EXPECT_EQ(most.load(), 1);
}

TEST(KernelThreadTest, DestroyingAnIdleThreadJoinsIt) {
  for (int i = 0; i < 20; ++i) {
    KernelThread kernel;
    if (i % 2 == 0) EXPECT_TRUE(kernel.Run([] { return absl::OkStatus(); }).ok());
  }
}

}  // namespace
}  // namespace kvq
