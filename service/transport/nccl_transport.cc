#include "service/transport/nccl_transport.h"

#include <cuda_runtime_api.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace kvq {
namespace {

bool IsDeviceMemory(const void* p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

void FreeScratch(void* p, int device) {
  if (p == nullptr) return;
  (void)cudaSetDevice(device);
  (void)cudaFree(p);
}

}  // namespace

NcclTransport::~NcclTransport() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, s] : sessions_) {
    s->link.reset();
    FreeScratch(s->scratch, device_);
  }
}

absl::StatusOr<SessionDescriptor> NcclTransport::OpenSession(absl::Time) {
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  if (!id.ok()) return id.status();
  absl::StatusOr<std::unique_ptr<NcclLink>> link = NcclLink::Start(*id, 2, 0, device_);
  if (!link.ok()) return link.status();
  auto s = std::make_shared<Session>();
  s->link = *std::move(link);
  SessionDescriptor d;
  d.nccl_unique_id = *id;
  absl::MutexLock lock(&mu_);
  // Unguessable enough to keep sessions apart; tenants are checked too.
  d.session_id = absl::StrCat("nccl-", next_++, "-", absl::BytesToHexString(id->substr(0, 8)));
  sessions_[d.session_id] = std::move(s);
  return d;
}

void NcclTransport::CloseSession(absl::string_view session_id) {
  std::shared_ptr<Session> s;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    s = std::move(it->second);
    sessions_.erase(it);
  }
  // A transfer still running sees the abort and fails; the last reference
  // frees the rest.
  s->link->Abort();
}

absl::StatusOr<std::shared_ptr<NcclTransport::Session>> NcclTransport::Find(
    const PayloadRef& ref) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(ref.session_id);
  if (it == sessions_.end()) {
    return absl::UnavailableError(
        absl::StrCat(ref.field, ": transfer session ", ref.session_id, " is closed"));
  }
  return it->second;
}

absl::StatusOr<void*> NcclTransport::Scratch(Session& s, size_t bytes) {
  if (s.scratch_bytes < bytes) {
    FreeScratch(s.scratch, device_);
    s.scratch = nullptr;
    s.scratch_bytes = 0;
    KVQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.scratch, bytes), "cudaMalloc (transfer staging)");
    s.scratch_bytes = bytes;
  }
  return s.scratch;
}

absl::Status NcclTransport::Receive(const PayloadRef& ref, absl::Span<uint8_t> dst,
                                    absl::Time deadline) {
  if (absl::Status st = CheckPayloadRef(kind(), ref, dst.size()); !st.ok()) return st;
  absl::StatusOr<std::shared_ptr<Session>> s = Find(ref);
  if (!s.ok()) return s.status();
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  const bool device = IsDeviceMemory(dst.data());
  void* into = dst.data();
  if (!device) {
    absl::StatusOr<void*> scratch = Scratch(**s, dst.size());
    if (!scratch.ok()) return scratch.status();
    into = *scratch;
  }
  if (absl::Status st = (*s)->link->Recv(into, ref.size, 1, deadline, ref.field); !st.ok()) {
    return st;
  }
  if (!device) {
    KVQ_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst.data(), into, dst.size(), cudaMemcpyDeviceToHost),
                             absl::StrCat(ref.field, ": cudaMemcpy"));
  }
  return absl::OkStatus();
}

absl::Status NcclTransport::Send(const PayloadRef& ref, absl::Span<const uint8_t> src,
                                 absl::Time deadline) {
  if (absl::Status st = CheckPayloadRef(kind(), ref, src.size()); !st.ok()) return st;
  absl::StatusOr<std::shared_ptr<Session>> s = Find(ref);
  if (!s.ok()) return s.status();
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  const void* from = src.data();
  if (!IsDeviceMemory(src.data())) {
    absl::StatusOr<void*> scratch = Scratch(**s, src.size());
    if (!scratch.ok()) return scratch.status();
    KVQ_CUDA_RETURN_IF_ERROR(cudaMemcpy(*scratch, src.data(), src.size(), cudaMemcpyHostToDevice),
                             absl::StrCat(ref.field, ": cudaMemcpy"));
    from = *scratch;
  }
  return (*s)->link->Send(from, ref.size, 1, deadline, ref.field);
}

}  // namespace kvq
