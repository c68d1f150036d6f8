#include "client/shard_parts.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvq {

absl::Status OnReplica(const absl::Status& st, absl::string_view replica) {
  if (st.ok()) return st;
  return absl::Status(st.code(), absl::StrCat(st.message(), " (replica ", replica, ")"));
}

HostTensor GatherRows(const HostTensor& t, const std::vector<int>& indexes) {
  HostTensor out;
  out.dtype = t.dtype;
  out.shape = t.shape;
  if (t.shape.empty() || t.shape[0] <= 0) return t;
  const size_t row = t.byte_size() / static_cast<size_t>(t.shape[0]);
  out.shape[0] = static_cast<int64_t>(indexes.size());
  out.data.resize(row * indexes.size());
  for (size_t j = 0; j < indexes.size(); ++j) {
    std::memcpy(out.data.data() + j * row, t.data.data() + indexes[j] * row, row);
  }
  return out;
}

void ScatterRows(const HostTensor& part, const std::vector<int>& indexes, int n,
                 HostTensor* whole) {
  if (part.shape.empty() || part.shape[0] != static_cast<int64_t>(indexes.size())) return;
  if (whole->shape.empty()) {
    std::vector<int64_t> shape = part.shape;
    shape[0] = n;
    *whole = HostTensor::Zeros(part.dtype, shape);
  }
  const size_t row = indexes.empty() ? 0 : part.byte_size() / indexes.size();
  for (size_t j = 0; j < indexes.size(); ++j) {
    std::memcpy(whole->data.data() + indexes[j] * row, part.data.data() + j * row, row);
  }
}

absl::Status ValidateDecodeBatch(const DecodeBatch& batch) {
  const int n = static_cast<int>(batch.sequence_ids.size());
  for (const auto& [name, t] : {std::pair<const char*, const HostTensor*>{"k", &batch.k},
                                {"v", &batch.v}, {"q", &batch.q}}) {
    if (n == 0 || t->rank() != 3 || t->shape[0] != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " is ", t->DebugString(), "; it must be [", n,
          " sequences (one row each, at least one), heads, head_dim]"));
    }
    if (absl::Status st = t->Validate(); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", st.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AttendOutput>> AllOrFirstError(
    std::vector<absl::StatusOr<AttendOutput>> each) {
  std::vector<AttendOutput> out;
  out.reserve(each.size());
  for (absl::StatusOr<AttendOutput>& r : each) {
    if (!r.ok()) return r.status();
    out.push_back(*std::move(r));
  }
  return out;
}

}  // namespace kvq
