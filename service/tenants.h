// Tenants: who a request is (its bearer token, looked up in the tokens
// file) and whether it may run now (the tenant's request rate).
//
// Without a tokens file every request is the default tenant (the empty
// name): no token needed, no quota, no rate limit. With one, every kvq.v1
// call must carry "authorization: Bearer <token>" metadata naming a tenant
// of the file; the file is re-read when its modification time or size
// changes (ReloadIfChanged, polled by the server), and a file that no
// longer parses keeps the table in force.
//
// Thread-safe.
#ifndef KVQ_SERVICE_TENANTS_H_
#define KVQ_SERVICE_TENANTS_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/tokens_file.h"

namespace kvq {

struct TenantMetrics;  // service/metrics.h
class SequenceStore;

// A token bucket: `burst` requests at once, refilled at `rate` per second.
class TokenBucket {
 public:
  TokenBucket(double rate, double burst, absl::Time now);
  // Takes one token if there is one.
  bool TryTake(absl::Time now);

 private:
  double rate_;
  double burst_;
  double tokens_;
  absl::Time last_;
};

// One tenant, kept by name across reloads (its bucket and metrics handles).
class Tenant {
 public:
  Tenant(const TenantSpec& spec, absl::Time now);
  const std::string& name() const { return name_; }
  TenantSpec spec() const;
  // RESOURCE_EXHAUSTED naming the limit when the tenant's bucket is empty.
  absl::Status Admit(absl::Time now);
  // Handles set once by the metrics layer (null until then).
  std::atomic<TenantMetrics*> metrics{nullptr};

 private:
  friend class Tenants;
  void Update(const TenantSpec& spec, absl::Time now);

  const std::string name_;
  mutable absl::Mutex mu_;
  TenantSpec spec_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<TokenBucket> bucket_ ABSL_GUARDED_BY(mu_);  // Null: no limit.
};

class Tenants {
 public:
  // Reads and checks `path` (the file's error when it does not parse).
  static absl::StatusOr<std::unique_ptr<Tenants>> Load(const std::string& path);
  // A table from specs already parsed (tests, embedding).
  static std::unique_ptr<Tenants> FromSpecs(const std::vector<TenantSpec>& specs);

  // The tenant of an "authorization" metadata value (`present`: whether
  // the call carried one), or UNAUTHENTICATED. Tokens are compared in
  // constant time, every tenant's, so the answer's timing says nothing
  // about which token came close.
  absl::StatusOr<std::shared_ptr<Tenant>> Authenticate(bool present,
                                                       absl::string_view authorization) const;

  // Re-reads the file when its modification time or size changed. Returns
  // true when a new table is in force; a file that does not parse keeps
  // the old table and returns its error.
  absl::StatusOr<bool> ReloadIfChanged();
  // Installs `specs` as the table (tenants that stay keep their state),
  // setting their quotas on the attached store before any call can use it.
  void Replace(const std::vector<TenantSpec>& specs);
  // Sets the quotas of the table on `store`, and of every later table.
  void AttachStore(SequenceStore* store);

  // The specs in force, by name.
  std::vector<TenantSpec> Specs() const;
  const std::string& path() const { return path_; }

 private:
  struct FileStamp {
    int64_t mtime_ns = -1;
    int64_t size = -1;
    friend bool operator==(const FileStamp&, const FileStamp&) = default;
  };
  static FileStamp Stamp(const std::string& path);

  std::string path_;
  mutable absl::Mutex mu_;
  FileStamp stamp_ ABSL_GUARDED_BY(mu_);
  SequenceStore* store_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Every tenant seen since start-up, by name; `tokens_` holds those in force.
  absl::flat_hash_map<std::string, std::shared_ptr<Tenant>> by_name_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, std::shared_ptr<Tenant>>> tokens_ ABSL_GUARDED_BY(mu_);
};

// Whether `a` equals `b`, in time that depends only on b's length.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace kvq

#endif  // KVQ_SERVICE_TENANTS_H_
