#include "client/sharded_decode_session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/shard_parts.h"
#include "kernels/status_macros.h"

namespace kvq {
std::unique_ptr<ShardedDecodeSession> ShardedKvqClient::OpenDecodeSession(
    absl::Duration deadline) {
  return std::make_unique<ShardedDecodeSession>(this, deadline);
}

ShardedDecodeSession::ShardedDecodeSession(ShardedKvqClient* client, absl::Duration deadline)
    : client_(client), deadline_(deadline) {}

ShardedDecodeSession::~ShardedDecodeSession() = default;  // Each DecodeSession cancels itself.

std::vector<ShardedDecodeSession::Part> ShardedDecodeSession::Split(
    absl::Span<const std::string> ids) {
  std::vector<Part> parts;
  for (int i = 0; i < static_cast<int>(ids.size()); ++i) {
    absl::StatusOr<std::string> replica = client_->ReplicaOf(ids[i]);
    if (!replica.ok()) {
      parts.push_back(Part{"", {i}, nullptr, replica.status()});
      continue;
    }
    auto p = std::find_if(parts.begin(), parts.end(), [&](const Part& x) {
      return x.status.ok() && x.replica == *replica;
    });
    if (p == parts.end()) {
      parts.push_back(Part{*replica, {}, nullptr, absl::OkStatus()});
      p = std::prev(parts.end());
    }
    p->indexes.push_back(i);
  }
  return parts;
}

absl::StatusOr<std::shared_ptr<DecodeSession>> ShardedDecodeSession::SessionFor(
    const std::string& replica) {
  auto it = sessions_.find(replica);
  if (it != sessions_.end()) return it->second;
  KVQ_ASSIGN_OR_RETURN(std::shared_ptr<KvqClient> c, client_->ClientForReplica(replica));
  KVQ_ASSIGN_OR_RETURN(std::unique_ptr<DecodeSession> s, c->OpenDecodeSession(deadline_));
  std::shared_ptr<DecodeSession> shared = std::move(s);
  sessions_.emplace(replica, shared);
  return shared;
}

void ShardedDecodeSession::Drop(const Part& part) {
  auto it = sessions_.find(part.replica);
  if (it != sessions_.end() && it->second == part.session) sessions_.erase(it);
}

void ShardedDecodeSession::WriteParts(
    Pending pending,
    absl::FunctionRef<absl::Status(DecodeSession&, const std::vector<int>&)> write) {
  for (Part& p : pending.parts) {
    if (!p.status.ok()) continue;
    absl::StatusOr<std::shared_ptr<DecodeSession>> s = SessionFor(p.replica);
    if (!s.ok()) {
      p.status = OnReplica(s.status(), p.replica);
      continue;
    }
    p.session = *s;
    if (absl::Status st = write(*p.session, p.indexes); !st.ok()) {
      p.status = OnReplica(RenumberItems(st, p.indexes), p.replica);
      Drop(p);
      p.session = nullptr;
    }
  }
  pending_.push_back(std::move(pending));
}

absl::Status ShardedDecodeSession::Write(int layer, absl::Span<const AppendAttendItem> items,
                                         float softmax_scale) {
  if (items.empty()) return absl::InvalidArgumentError("items is empty");
  std::vector<std::string> ids;
  for (const AppendAttendItem& it : items) ids.push_back(it.sequence_id);
  Pending pending{false, static_cast<int>(items.size()), Split(ids)};
  WriteParts(std::move(pending), [&](DecodeSession& session, const std::vector<int>& indexes) {
    std::vector<AppendAttendItem> part;
    for (int i : indexes) part.push_back(items[i]);
    return session.Write(layer, part, softmax_scale);
  });
  return absl::OkStatus();
}

absl::Status ShardedDecodeSession::WriteBatch(int layer, const DecodeBatch& batch,
                                              float softmax_scale) {
  KVQ_RETURN_IF_ERROR(ValidateDecodeBatch(batch));
  const int n = static_cast<int>(batch.sequence_ids.size());
  Pending pending{true, n, Split(batch.sequence_ids)};
  WriteParts(std::move(pending), [&](DecodeSession& session, const std::vector<int>& indexes) {
    DecodeBatch part;
    for (int i : indexes) part.sequence_ids.push_back(batch.sequence_ids[i]);
    part.k = GatherRows(batch.k, indexes);
    part.v = GatherRows(batch.v, indexes);
    part.q = GatherRows(batch.q, indexes);
    return session.WriteBatch(layer, part, softmax_scale);
  });
  return absl::OkStatus();
}

absl::StatusOr<ShardedDecodeSession::Pending> ShardedDecodeSession::Next(bool packed) {
  if (pending_.empty()) return absl::FailedPreconditionError("no step written to read");
  if (pending_.front().packed != packed) {
    return absl::FailedPreconditionError(
        packed ? "the next step was written with Write: read it with Read"
               : "the next step was written with WriteBatch: read it with ReadBatch");
  }
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  return p;
}

void ShardedDecodeSession::ReadParts(Pending& pending,
                                     absl::FunctionRef<absl::Status(const Part&)> read,
                                     absl::FunctionRef<void(int, const absl::Status&)> fail) {
  for (Part& p : pending.parts) {
    if (p.status.ok()) {
      const absl::Status st = read(p);
      if (st.ok()) continue;
      p.status = OnReplica(RenumberItems(st, p.indexes), p.replica);
      Drop(p);
    }
    for (int i : p.indexes) fail(i, p.status);
  }
}

std::vector<absl::StatusOr<AttendOutput>> ShardedDecodeSession::ReadEach() {
  absl::StatusOr<Pending> pending = Next(false);
  if (!pending.ok()) return {pending.status()};
  std::vector<absl::StatusOr<AttendOutput>> out(pending->n,
                                                absl::InternalError("no result was read"));
  ReadParts(
      *pending,
      [&](const Part& p) -> absl::Status {
        KVQ_ASSIGN_OR_RETURN(std::vector<AttendOutput> r, p.session->Read());
        if (r.size() != p.indexes.size()) {
          return absl::DataLossError(absl::StrCat("the stream answered ", r.size(),
                                                  " results for ", p.indexes.size(), " items"));
        }
        for (size_t j = 0; j < p.indexes.size(); ++j) out[p.indexes[j]] = std::move(r[j]);
        return absl::OkStatus();
      },
      [&](int i, const absl::Status& st) { out[i] = st; });
  return out;
}

absl::StatusOr<PartialBatchOutput> ShardedDecodeSession::ReadBatchEach() {
  KVQ_ASSIGN_OR_RETURN(Pending pending, Next(true));
  PartialBatchOutput out;
  out.status.resize(pending.n);
  ReadParts(
      pending,
      [&](const Part& p) -> absl::Status {
        KVQ_ASSIGN_OR_RETURN(AttendOutput r, p.session->ReadBatch());
        ScatterRows(r.out, p.indexes, pending.n, &out.output.out);
        ScatterRows(r.lse, p.indexes, pending.n, &out.output.lse);
        return absl::OkStatus();
      },
      [&](int i, const absl::Status& st) { out.status[i] = st; });
  return out;
}

absl::StatusOr<std::vector<AttendOutput>> ShardedDecodeSession::Read() {
  return AllOrFirstError(ReadEach());
}

absl::StatusOr<AttendOutput> ShardedDecodeSession::ReadBatch() {
  KVQ_ASSIGN_OR_RETURN(PartialBatchOutput r, ReadBatchEach());
  for (const absl::Status& st : r.status) KVQ_RETURN_IF_ERROR(st);
  return std::move(r.output);
}

std::vector<absl::StatusOr<AttendOutput>> ShardedDecodeSession::StepEach(
    int layer, absl::Span<const AppendAttendItem> items, float softmax_scale) {
  if (absl::Status st = Write(layer, items, softmax_scale); !st.ok()) return {st};
  return ReadEach();
}

absl::StatusOr<std::vector<AttendOutput>> ShardedDecodeSession::Step(
    int layer, absl::Span<const AppendAttendItem> items, float softmax_scale) {
  KVQ_RETURN_IF_ERROR(Write(layer, items, softmax_scale));
  return Read();
}

absl::StatusOr<PartialBatchOutput> ShardedDecodeSession::StepBatchEach(int layer,
                                                                      const DecodeBatch& batch,
                                                                      float softmax_scale) {
  KVQ_RETURN_IF_ERROR(WriteBatch(layer, batch, softmax_scale));
  return ReadBatchEach();
}

absl::StatusOr<AttendOutput> ShardedDecodeSession::StepBatch(int layer, const DecodeBatch& batch,
                                                             float softmax_scale) {
  KVQ_RETURN_IF_ERROR(WriteBatch(layer, batch, softmax_scale));
  return ReadBatch();
}

absl::Status ShardedDecodeSession::Close() {
  absl::Status first;
  for (auto& [replica, session] : sessions_) {
    const absl::Status st = session->Close();
    if (first.ok() && !st.ok()) first = OnReplica(st, replica);
  }
  sessions_.clear();
  pending_.clear();
  return first;
}

}  // namespace kvq
