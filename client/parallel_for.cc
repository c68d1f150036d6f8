#include "client/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvq {
namespace {

// Claims indices from `next` until none are left.
void Drain(std::atomic<int>& next, int count, const std::function<void(int)>& fn) {
  for (int i = next++; i < count; i = next++) fn(i);
}

// One call at a time: the caller posts the loop, `seats` sleeping helpers
// join it, and the caller waits for every helper that joined. Helpers are
// never stopped (the pool lives as long as the process).
class HelperPool {
 public:
  // Runs the loop on the caller and up to `helpers` pool threads; false,
  // running nothing, when the pool is serving another call.
  bool TryRun(int count, int helpers, const std::function<void(int)>& fn) {
    if (!serving_.TryLock()) return false;
    {
      absl::MutexLock lock(&mu_);
      while (static_cast<int>(threads_started_) < helpers) {
        std::thread([this] { Serve(); }).detach();
        ++threads_started_;
      }
      fn_ = &fn;
      count_ = count;
      next_.store(0);
      seats_ = helpers;
    }
    Drain(next_, count, fn);
    {
      absl::MutexLock lock(&mu_);
      seats_ = 0;  // Every index is claimed: late helpers need not join.
      mu_.Await(absl::Condition(
          +[](int* running) { return *running == 0; }, &running_));
      fn_ = nullptr;
    }
    serving_.Unlock();
    return true;
  }

 private:
  void Serve() {
    absl::MutexLock lock(&mu_);
    for (;;) {
      mu_.Await(absl::Condition(+[](int* seats) { return *seats > 0; }, &seats_));
      --seats_;
      ++running_;
      const std::function<void(int)>* fn = fn_;
      const int count = count_;
      mu_.Unlock();
      Drain(next_, count, *fn);
      mu_.Lock();
      --running_;
    }
  }

  absl::Mutex serving_;  // Held by the call being served.
  absl::Mutex mu_;
  size_t threads_started_ ABSL_GUARDED_BY(mu_) = 0;
  const std::function<void(int)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
  int seats_ ABSL_GUARDED_BY(mu_) = 0;    // Helpers still wanted.
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // Helpers inside the loop.
  std::atomic<int> next_{0};
};

HelperPool& Pool() {
  static HelperPool* pool = new HelperPool;  // Never destroyed: its threads never stop.
  return *pool;
}

}  // namespace

void ParallelFor(int count, int threads, const std::function<void(int)>& fn) {
  if (count <= 0) return;
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  threads = std::clamp(threads, 1, count);
  if (threads == 1) {
    for (int i = 0; i < count; ++i) fn(i);
    return;
  }
  if (Pool().TryRun(count, threads - 1, fn)) return;
  // The pool is busy: threads of this call's own.
  std::atomic<int> next{0};
  std::vector<std::thread> own;
  own.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) own.emplace_back([&] { Drain(next, count, fn); });
  Drain(next, count, fn);
  for (std::thread& t : own) t.join();
}

}  // namespace kvq
