// TransferSessions: the server's table of open transfer sessions (NCCL).
//
// A session belongs to the tenant that opened it and carries one request's
// transfers at a time (its payloads must pair with the client's sends and
// receives in order). It expires after its ttl without use and closes
// after a failed transfer: its communicator may be aborted and its peer
// may be gone, so a client opens a new one instead of reusing it.
#ifndef KVQ_SERVICE_TRANSPORT_TRANSFER_SESSIONS_H_
#define KVQ_SERVICE_TRANSPORT_TRANSFER_SESSIONS_H_

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/transport/kv_transport.h"

namespace kvq {

class TransferSessions {
 public:
  TransferSessions(absl::Duration default_ttl, absl::Duration max_ttl)
      : default_ttl_(default_ttl), max_ttl_(max_ttl) {}
  ~TransferSessions();  // Closes every session left.

  struct Opened {
    SessionDescriptor descriptor;
    absl::Duration ttl;  // The lease granted.
  };
  // A new session on `transport` for `tenant`; `ttl` 0 means the default,
  // longer than the maximum is capped. Expired sessions are closed first.
  absl::StatusOr<Opened> Open(KvTransport* transport, absl::string_view tenant,
                              absl::Duration ttl, absl::Time now, absl::Time deadline);
  // Takes the session for one request: NOT_FOUND when it is unknown,
  // expired or another tenant's; FAILED_PRECONDITION while another request
  // holds it.
  absl::StatusOr<KvTransport*> Acquire(absl::string_view session_id, absl::string_view tenant,
                                       absl::Time now);
  // Gives it back: its lease restarts at `now`, or with `failed` the
  // session is closed.
  void Release(absl::string_view session_id, bool failed, absl::Time now);
  // Closes it (CloseTransfer): NOT_FOUND as Acquire.
  absl::Status Close(absl::string_view session_id, absl::string_view tenant);
  // Closes sessions idle past their lease; returns how many.
  int ExpireIdle(absl::Time now);
  int size() const;

 private:
  struct Session {
    KvTransport* transport = nullptr;
    std::string tenant;
    absl::Duration ttl;
    absl::Time expires;
    bool busy = false;
  };
  absl::Status NotFound(absl::string_view session_id) const;
  // Removes sessions past their lease (not busy) from the table and
  // closes them on their transport; called with mu_ held.
  int ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration default_ttl_;
  const absl::Duration max_ttl_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvq

#endif  // KVQ_SERVICE_TRANSPORT_TRANSFER_SESSIONS_H_
