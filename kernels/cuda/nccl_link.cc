#include "kernels/cuda/nccl_link.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cuda/cuda_status.h"

namespace kvq {
namespace {

absl::Status NcclError(ncclResult_t r, absl::string_view what) {
  const std::string msg = absl::StrCat(what, ": ", ncclGetErrorString(r));
  // A remote or system error is a peer that went away (or its network).
  if (r == ncclRemoteError || r == ncclSystemError) return absl::UnavailableError(msg);
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return absl::InvalidArgumentError(msg);
  return absl::InternalError(msg);
}

}  // namespace

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclError(r, "ncclGetUniqueId");
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclLink>> NcclLink::Start(absl::string_view unique_id,
                                                          int nranks, int rank, int device) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("nccl_unique_id has ", unique_id.size(),
                                                   " bytes, an ncclUniqueId has ",
                                                   sizeof(id.internal)));
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  std::unique_ptr<NcclLink> link(new NcclLink(device));
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  KVQ_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&link->stream_, cudaStreamNonBlocking),
                           "cudaStreamCreate");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // Every call returns; Wait() polls with a deadline.
  const ncclResult_t r = ncclCommInitRankConfig(&link->comm_, nranks, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) return NcclError(r, "ncclCommInitRankConfig");
  return link;
}

NcclLink::~NcclLink() {
  Abort();
  if (stream_ != nullptr) {
    (void)cudaSetDevice(device_);
    (void)cudaStreamDestroy(stream_);
  }
}

void NcclLink::Abort() {
  if (comm_ != nullptr && !aborted_) {
    (void)ncclCommAbort(comm_);
    aborted_ = true;
  }
}

absl::Status NcclLink::Wait(absl::Time deadline, absl::string_view what) {
  while (true) {
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(comm_, &async); r != ncclSuccess) {
      Abort();
      return NcclError(r, what);
    }
    if (async != ncclSuccess && async != ncclInProgress) {
      Abort();
      return NcclError(async, what);
    }
    if (async == ncclSuccess) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) {
        Abort();
        return CudaStatus(e, what);
      }
    }
    if (absl::Now() >= deadline) {
      Abort();
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": the peer did not complete before the deadline"));
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

absl::Status NcclLink::WaitReady(absl::Time deadline) {
  if (aborted_) return absl::UnavailableError("the transfer session was aborted");
  if (ready_) return absl::OkStatus();
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  absl::Status st = Wait(deadline, "joining the transfer session");
  ready_ = st.ok();
  return st;
}

absl::Status NcclLink::Send(const void* device_ptr, int64_t bytes, int peer,
                            absl::Time deadline, absl::string_view field) {
  if (absl::Status st = WaitReady(deadline); !st.ok()) return st;
  const std::string what = absl::StrCat(field, ": ncclSend");
  const ncclResult_t r =
      ncclSend(device_ptr, static_cast<size_t>(bytes), ncclUint8, peer, comm_, stream_);
  if (r != ncclSuccess && r != ncclInProgress) {
    Abort();
    return NcclError(r, what);
  }
  return Wait(deadline, what);
}

absl::Status NcclLink::Recv(void* device_ptr, int64_t bytes, int peer, absl::Time deadline,
                            absl::string_view field) {
  if (absl::Status st = WaitReady(deadline); !st.ok()) return st;
  const std::string what = absl::StrCat(field, ": ncclRecv");
  const ncclResult_t r =
      ncclRecv(device_ptr, static_cast<size_t>(bytes), ncclUint8, peer, comm_, stream_);
  if (r != ncclSuccess && r != ncclInProgress) {
    Abort();
    return NcclError(r, what);
  }
  return Wait(deadline, what);
}

}  // namespace kvq
