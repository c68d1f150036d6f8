#ifndef KVQ_CLIENT_SHARD_PARTS_H_
#define KVQ_CLIENT_SHARD_PARTS_H_

// Helpers shared by ShardedKvqClient and ShardedDecodeSession: both split a
// batch into one part per replica and put the answers back in batch order.

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/host_tensor.h"
#include "client/kvq_client.h"

namespace kvq {

// The status with " (replica R)" after its message, so that an error of a
// sharded call says which server gave it.
absl::Status OnReplica(const absl::Status& st, absl::string_view replica);

// Rows `indexes` of a tensor whose first dimension is the batch.
HostTensor GatherRows(const HostTensor& t, const std::vector<int>& indexes);

// Copies row j of `part` into row indexes[j] of `whole` ([n, ...], created
// zeroed from part's dtype and row shape when empty).
void ScatterRows(const HostTensor& part, const std::vector<int>& indexes, int n,
                 HostTensor* whole);

// INVALID_ARGUMENT unless k, v and q of `batch` are valid [n, heads,
// head_dim] tensors, n = its sequence count (at least one): checked before
// the batch is split, so that the error names the caller's tensors.
absl::Status ValidateDecodeBatch(const DecodeBatch& batch);

// The outputs of every item when all succeeded, else the first item's error:
// the all-or-nothing form of the per-item (…Each) calls.
absl::StatusOr<std::vector<AttendOutput>> AllOrFirstError(
    std::vector<absl::StatusOr<AttendOutput>> each);

}  // namespace kvq

#endif  // KVQ_CLIENT_SHARD_PARTS_H_
