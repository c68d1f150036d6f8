// The tokens file of kvq-server (--tokens_file): which bearer token belongs
// to which tenant, and that tenant's limits. One tenant per line:
//
//   # comment
//   tenant=team-a token=s3cr3t-token-of-team-a quota_bytes=1073741824 rate_rps=50 burst=100
//
// Keys, in any order, separated by spaces or tabs:
//   tenant       required; 1 to 64 letters, digits, '-', '_' or '.'
//   token        required; 16 to 512 printable characters, no spaces
//   quota_bytes  bytes the tenant's sequences may hold in the pool; 0 or
//                absent: no quota
//   rate_rps     requests per second (token bucket); 0 or absent: no limit
//   burst        bucket size; default max(1, rate_rps); needs rate_rps
// Blank lines and lines starting with '#' are skipped. Tenant names and
// tokens must be unique. Errors name the line and the key.
#ifndef KVQ_SERVICE_TOKENS_FILE_H_
#define KVQ_SERVICE_TOKENS_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvq {

struct TenantSpec {
  std::string name;
  std::string token;
  int64_t quota_bytes = 0;  // 0: none.
  double rate_rps = 0;      // 0: no limit.
  double burst = 0;         // Tokens of the bucket when rate_rps > 0.
  friend bool operator==(const TenantSpec&, const TenantSpec&) = default;
};

// INVALID_ARGUMENT "tokens file line N: ..." naming the key and the rule.
absl::StatusOr<std::vector<TenantSpec>> ParseTokensFile(absl::string_view text);
// Reads and parses `path` (NOT_FOUND / PERMISSION_DENIED naming it when it
// cannot be read).
absl::StatusOr<std::vector<TenantSpec>> ReadTokensFile(const std::string& path);

}  // namespace kvq

#endif  // KVQ_SERVICE_TOKENS_FILE_H_
