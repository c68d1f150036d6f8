// KernelThread: one long-lived thread that runs the server's multi-threaded
// kernel calls, one at a time.
//
// The CPU backend parallelises a call with OpenMP, and libgomp gives every
// thread that opens a parallel region a worker team of its own. gRPC runs
// handlers on whichever of its threads is free, so without this each
// callback thread kept a team, the teams took turns, and every call woke a
// worker that had gone to sleep since its last turn. Measured on 2 cores
// (docs/BENCHMARKS.md, section 7): Attend at batch 8 and 32 spent 60-130 us
// less per call outside the kernel with every parallel call on one thread.
// Calls that stay on one thread run inline: the hand-off costs them more
// than it saves (about 80 us at batch 1, same section).
#ifndef KVQ_SERVICE_KERNEL_THREAD_H_
#define KVQ_SERVICE_KERNEL_THREAD_H_

#include <deque>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvq {

class KernelThread {
 public:
  KernelThread();
  // Finishes the queued calls, then joins the thread.
  ~KernelThread();
  KernelThread(const KernelThread&) = delete;
  KernelThread& operator=(const KernelThread&) = delete;

  // Runs `fn` on the kernel thread after the calls queued before it, and
  // returns its status. Blocks the caller until then.
  absl::Status Run(absl::AnyInvocable<absl::Status()> fn);

 private:
  struct Call {
    absl::AnyInvocable<absl::Status()> fn;
    absl::Status status;
    bool done = false;
  };
  void Loop();

  absl::Mutex mu_;
  std::deque<Call*> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_KERNEL_THREAD_H_
