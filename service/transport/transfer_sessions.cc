#include "service/transport/transfer_sessions.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/quoted.h"

namespace kvq {

TransferSessions::~TransferSessions() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, s] : sessions_) s.transport->CloseSession(id);
}

absl::Status TransferSessions::NotFound(absl::string_view session_id) const {
  return absl::NotFoundError(absl::StrCat("transfer session ", Quoted(session_id),
                                          " is unknown, expired or closed; open a new one"));
}

int TransferSessions::ExpireLocked(absl::Time now) {
  std::vector<std::string> gone;
  for (const auto& [id, s] : sessions_) {
    if (!s.busy && s.expires <= now) gone.push_back(id);
  }
  for (const std::string& id : gone) {
    sessions_[id].transport->CloseSession(id);
    sessions_.erase(id);
  }
  return static_cast<int>(gone.size());
}

absl::StatusOr<TransferSessions::Opened> TransferSessions::Open(KvTransport* transport,
                                                                absl::string_view tenant,
                                                                absl::Duration ttl,
                                                                absl::Time now,
                                                                absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(now);
  }
  if (ttl == absl::ZeroDuration()) ttl = default_ttl_;
  ttl = std::min(ttl, max_ttl_);
  absl::StatusOr<SessionDescriptor> d = transport->OpenSession(deadline);
  if (!d.ok()) return d.status();
  absl::MutexLock lock(&mu_);
  Session& s = sessions_[d->session_id];
  s.transport = transport;
  s.tenant = std::string(tenant);
  s.ttl = ttl;
  s.expires = now + ttl;
  return Opened{*std::move(d), ttl};
}

absl::StatusOr<KvTransport*> TransferSessions::Acquire(absl::string_view session_id,
                                                       absl::string_view tenant, absl::Time now) {
  absl::MutexLock lock(&mu_);
  ExpireLocked(now);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end() || it->second.tenant != tenant) return NotFound(session_id);
  if (it->second.busy) {
    return absl::FailedPreconditionError(absl::StrCat("transfer session ", Quoted(session_id),
                                                      " is carrying another request's transfers"));
  }
  it->second.busy = true;
  return it->second.transport;
}

void TransferSessions::Release(absl::string_view session_id, bool failed, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  if (failed) {
    it->second.transport->CloseSession(it->first);
    sessions_.erase(it);
    return;
  }
  it->second.busy = false;
  it->second.expires = now + it->second.ttl;
}

absl::Status TransferSessions::Close(absl::string_view session_id, absl::string_view tenant) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(session_id);
  if (it == sessions_.end() || it->second.tenant != tenant) return NotFound(session_id);
  // A busy session's transfer fails with UNAVAILABLE; Release then finds
  // nothing to give back.
  it->second.transport->CloseSession(it->first);
  sessions_.erase(it);
  return absl::OkStatus();
}

int TransferSessions::ExpireIdle(absl::Time now) {
  absl::MutexLock lock(&mu_);
  return ExpireLocked(now);
}

int TransferSessions::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

}  // namespace kvq
