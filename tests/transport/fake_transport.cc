#include "tests/transport/fake_transport.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvq {

void FakeTransportHub::set_fault(Fault fault, std::string field) {
  absl::MutexLock lock(&mu_);
  fault_ = fault;
  fault_field_ = std::move(field);
}

FakeTransportHub::Fault FakeTransportHub::FaultFor(absl::string_view field) {
  absl::MutexLock lock(&mu_);
  return fault_field_.empty() || fault_field_ == field ? fault_ : Fault::kNone;
}

std::string FakeTransportHub::Export(const void* data, size_t size) {
  absl::MutexLock lock(&mu_);
  // 64 bytes, as a cudaIpcMemHandle_t.
  std::string handle = absl::StrCat("fake-ipc-", next_id_++);
  handle.resize(64, '\0');
  exports_[handle] = {data, size};
  return handle;
}

void FakeTransportHub::Unexport(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  exports_.erase(handle);
}

absl::StatusOr<FakeTransportHub::Buffer> FakeTransportHub::Lookup(const PayloadRef& ref) {
  absl::MutexLock lock(&mu_);
  auto it = exports_.find(ref.ipc_handle);
  if (it == exports_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        ref.field, ".cuda_ipc.handle is not an allocation exported on this node"));
  }
  const Buffer b = it->second;
  if (static_cast<uint64_t>(ref.offset) > b.size ||
      static_cast<uint64_t>(ref.size) > b.size - ref.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        ref.field, ".cuda_ipc: offset ", ref.offset, " + size ", ref.size,
        " exceeds the exported allocation of ", b.size, " bytes"));
  }
  return Buffer{static_cast<const uint8_t*>(b.data) + ref.offset, static_cast<size_t>(ref.size)};
}

SessionDescriptor FakeTransportHub::OpenSession() {
  absl::MutexLock lock(&mu_);
  SessionDescriptor d;
  d.session_id = absl::StrCat("fake-session-", next_id_++);
  d.nccl_unique_id = std::string(128, '\x5a');
  sessions_[d.session_id];
  return d;
}

void FakeTransportHub::CloseSession(absl::string_view id) {
  absl::MutexLock lock(&mu_);
  sessions_.erase(id);
}

int FakeTransportHub::open_sessions() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

absl::Status FakeTransportHub::Push(absl::string_view id, bool to_server, std::string bytes) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::UnavailableError(absl::StrCat("transfer session ", id, " is closed"));
  }
  (to_server ? it->second.to_server : it->second.to_client).push_back(std::move(bytes));
  return absl::OkStatus();
}

absl::StatusOr<std::string> FakeTransportHub::Pop(absl::string_view id, bool to_server,
                                                  absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = sessions_.find(id);
    return it == sessions_.end() ||
           !(to_server ? it->second.to_server : it->second.to_client).empty();
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::UnavailableError(absl::StrCat("transfer session ", id, " is closed"));
  }
  std::deque<std::string>& q = to_server ? it->second.to_server : it->second.to_client;
  if (q.empty()) {
    return absl::DeadlineExceededError(
        absl::StrCat("no payload on transfer session ", id, " before the deadline"));
  }
  std::string bytes = std::move(q.front());
  q.pop_front();
  return bytes;
}

// ------------------------------------------------------------ server side

absl::StatusOr<SessionDescriptor> FakeKvTransport::OpenSession(absl::Time) {
  if (kind_ != TransportKind::kNccl) {
    return absl::FailedPreconditionError("cuda_ipc payloads need no session");
  }
  return hub_->OpenSession();
}

void FakeKvTransport::CloseSession(absl::string_view session_id) {
  hub_->CloseSession(session_id);
}

namespace {

// What a fault does to a transfer of ref.size bytes; `partial` moves the
// bytes that made it before the peer vanished.
absl::Status Misbehave(FakeTransportHub::Fault fault, const PayloadRef& ref, absl::Time deadline,
                       const std::function<void(size_t)>& partial) {
  switch (fault) {
    case FakeTransportHub::Fault::kNone:
      return absl::OkStatus();
    case FakeTransportHub::Fault::kPeerVanishes:
      partial(static_cast<size_t>(ref.size) / 2);
      return absl::UnavailableError(absl::StrCat(ref.field, ": the peer went away after ",
                                                 ref.size / 2, " of ", ref.size, " bytes"));
    case FakeTransportHub::Fault::kNeverArrives:
      absl::SleepFor(std::max(absl::ZeroDuration(), deadline - absl::Now()));
      return absl::DeadlineExceededError(
          absl::StrCat(ref.field, ": the peer moved no bytes before the deadline"));
    case FakeTransportHub::Fault::kShortPayload:
      return absl::InvalidArgumentError(absl::StrCat(ref.field, ".size = ", ref.size,
                                                     " but the peer's payload has ",
                                                     ref.size - 1, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FakeKvTransport::Receive(const PayloadRef& ref, absl::Span<uint8_t> dst,
                                      absl::Time deadline) {
  if (absl::Status st = CheckPayloadRef(kind_, ref, dst.size()); !st.ok()) return st;
  if (kind_ == TransportKind::kCudaIpc) {
    absl::StatusOr<FakeTransportHub::Buffer> src = hub_->Lookup(ref);
    if (!src.ok()) return src.status();
    if (absl::Status st = Misbehave(hub_->FaultFor(ref.field), ref, deadline,
                                    [&](size_t n) { std::memcpy(dst.data(), src->data, n); });
        !st.ok()) {
      return st;
    }
    std::memcpy(dst.data(), src->data, dst.size());
    return absl::OkStatus();
  }
  const FakeTransportHub::Fault fault = hub_->FaultFor(ref.field);
  if (fault == FakeTransportHub::Fault::kNeverArrives) {
    return Misbehave(fault, ref, deadline, [](size_t) {});
  }
  absl::StatusOr<std::string> bytes = hub_->Pop(ref.session_id, /*to_server=*/true, deadline);
  if (!bytes.ok()) return bytes.status();
  if (absl::Status st = Misbehave(fault, ref, deadline,
                                  [&](size_t n) { std::memcpy(dst.data(), bytes->data(), n); });
      !st.ok()) {
    return st;
  }
  if (bytes->size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat(ref.field, ".size = ", ref.size,
                                                   " but the peer sent ", bytes->size(),
                                                   " bytes"));
  }
  std::memcpy(dst.data(), bytes->data(), dst.size());
  return absl::OkStatus();
}

absl::Status FakeKvTransport::Send(const PayloadRef& ref, absl::Span<const uint8_t> src,
                                   absl::Time deadline) {
  if (absl::Status st = CheckPayloadRef(kind_, ref, src.size()); !st.ok()) return st;
  if (kind_ == TransportKind::kCudaIpc) {
    absl::StatusOr<FakeTransportHub::Buffer> dst = hub_->Lookup(ref);
    if (!dst.ok()) return dst.status();
    uint8_t* out = static_cast<uint8_t*>(const_cast<void*>(dst->data));
    if (absl::Status st = Misbehave(hub_->FaultFor(ref.field), ref, deadline,
                                    [&](size_t n) { std::memcpy(out, src.data(), n); });
        !st.ok()) {
      return st;
    }
    std::memcpy(out, src.data(), src.size());
    return absl::OkStatus();
  }
  std::string bytes(reinterpret_cast<const char*>(src.data()), src.size());
  if (absl::Status st = Misbehave(hub_->FaultFor(ref.field), ref, deadline,
                                  [&](size_t n) { bytes.resize(n); });
      !st.ok()) {
    if (hub_->FaultFor(ref.field) == FakeTransportHub::Fault::kPeerVanishes) {
      hub_->CloseSession(ref.session_id);
    }
    return st;
  }
  return hub_->Push(ref.session_id, /*to_server=*/false, std::move(bytes));
}

// ------------------------------------------------------------ client side

void FakeDevicePeer::Register(const void* data, size_t size) {
  allocations_.push_back(
      {static_cast<const uint8_t*>(data), size, hub_->Export(data, size)});
}

absl::StatusOr<IpcExport> FakeDevicePeer::Export(const void* ptr) {
  const uint8_t* p = static_cast<const uint8_t*>(ptr);
  for (const Allocation& a : allocations_) {
    if (p >= a.data && p < a.data + a.size) return IpcExport{a.handle, p - a.data, 0};
  }
  return absl::InvalidArgumentError("pointer is not inside a registered allocation");
}

absl::Status FakeDevicePeer::Join(const SessionJoin& join, absl::Time) {
  if (join.nccl_unique_id.size() != 128) {
    return absl::InvalidArgumentError("nccl_unique_id must have 128 bytes");
  }
  session_ = join.session_id;
  return absl::OkStatus();
}

absl::Status FakeDevicePeer::Send(const void* ptr, int64_t size, absl::Time) {
  if (session_.empty()) return absl::FailedPreconditionError("no session joined");
  return hub_->Push(session_, /*to_server=*/true,
                    std::string(static_cast<const char*>(ptr), static_cast<size_t>(size)));
}

absl::Status FakeDevicePeer::Recv(void* ptr, int64_t size, absl::Time deadline) {
  if (session_.empty()) return absl::FailedPreconditionError("no session joined");
  absl::StatusOr<std::string> bytes = hub_->Pop(session_, /*to_server=*/false, deadline);
  if (!bytes.ok()) return bytes.status();
  if (static_cast<int64_t>(bytes->size()) != size) {
    return absl::DataLossError(
        absl::StrCat("received ", bytes->size(), " bytes, expected ", size));
  }
  std::memcpy(ptr, bytes->data(), bytes->size());
  return absl::OkStatus();
}

}  // namespace kvq
