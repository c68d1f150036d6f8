#include "service/kernel_thread.h"

#include <utility>

namespace kvq {

KernelThread::KernelThread() : thread_([this] { Loop(); }) {}

KernelThread::~KernelThread() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

absl::Status KernelThread::Run(absl::AnyInvocable<absl::Status()> fn) {
  Call call{std::move(fn), absl::OkStatus(), false};
  absl::MutexLock lock(&mu_);
  queue_.push_back(&call);
  mu_.Await(absl::Condition(&call.done));
  return call.status;
}

void KernelThread::Loop() {
  for (;;) {
    Call* call;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this] { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // Stopping, nothing left.
      call = queue_.front();
      queue_.pop_front();
    }
    absl::Status status = call->fn();
    absl::MutexLock lock(&mu_);
    call->status = std::move(status);
    call->done = true;
  }
}

}  // namespace kvq
