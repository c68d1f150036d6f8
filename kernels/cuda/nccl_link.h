// NcclLink: one rank's membership of a small NCCL communicator, made
// non-blocking so every wait has a deadline: a peer that never joins, never
// sends or dies ends in ncclCommAbort and a status, never a hung thread.
// Shared by the server's NcclTransport and the client's NcclPeer.
#ifndef KVQ_KERNELS_CUDA_NCCL_LINK_H_
#define KVQ_KERNELS_CUDA_NCCL_LINK_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvq {

// A fresh ncclUniqueId's bytes (128).
absl::StatusOr<std::string> NewNcclUniqueId();

class NcclLink {
 public:
  // Starts joining the communicator `unique_id` as `rank` of `nranks` on
  // `device`; returns at once (WaitReady waits).
  static absl::StatusOr<std::unique_ptr<NcclLink>> Start(absl::string_view unique_id, int nranks,
                                                         int rank, int device);
  ~NcclLink();  // Aborts the communicator.

  // Until every rank joined: DEADLINE_EXCEEDED (and aborted) otherwise.
  absl::Status WaitReady(absl::Time deadline);
  // `bytes` from / to device memory, with rank `peer`. DEADLINE_EXCEEDED
  // or UNAVAILABLE (peer gone) abort the link: it is unusable after.
  absl::Status Send(const void* device_ptr, int64_t bytes, int peer, absl::Time deadline,
                    absl::string_view field);
  absl::Status Recv(void* device_ptr, int64_t bytes, int peer, absl::Time deadline,
                    absl::string_view field);
  void Abort();
  int device() const { return device_; }

 private:
  NcclLink(int device) : device_(device) {}
  // Polls the communicator and the stream until the queued work is done.
  absl::Status Wait(absl::Time deadline, absl::string_view what);

  int device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool ready_ = false;
  bool aborted_ = false;
};

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_NCCL_LINK_H_
