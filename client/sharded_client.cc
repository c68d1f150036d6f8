#include "client/sharded_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/parallel_for.h"
#include "client/rendezvous.h"
#include "client/shard_parts.h"
#include "kernels/quoted.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

// Draws before giving up on an id for a replica: the chance that 64 * N
// draws all miss is (1 - 1/N)^(64 N) < e^-64.
constexpr int kDrawsPerReplica = 64;
// Sequences found off their winner that are remembered; past this the
// memory starts over (a lookup costs one probe again).
constexpr size_t kMaxMoved = size_t{1} << 16;

const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

template <typename T>
std::vector<T> Pick(absl::Span<const T> items, const std::vector<int>& indexes) {
  std::vector<T> out;
  out.reserve(indexes.size());
  for (int i : indexes) out.push_back(items[i]);
  return out;
}

// The first failed status, or OK.
absl::Status FirstError(const std::vector<absl::Status>& status) {
  for (const absl::Status& st : status) {
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RenumberItems(const absl::Status& status, const std::vector<int>& indexes) {
  if (status.ok()) return status;
  const absl::string_view m = status.message();
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t at = m.find("items[", pos);
    if (at == absl::string_view::npos) break;
    const size_t digits = at + 6;
    size_t end = digits;
    while (end < m.size() && absl::ascii_isdigit(m[end])) ++end;
    int j = -1;
    if (end > digits && end < m.size() && m[end] == ']' && end - digits < 9) {
      j = std::stoi(std::string(m.substr(digits, end - digits)));
    }
    if (j < 0 || j >= static_cast<int>(indexes.size())) {
      absl::StrAppend(&out, m.substr(pos, digits - pos));
      pos = digits;
      continue;
    }
    absl::StrAppend(&out, m.substr(pos, digits - pos), indexes[j]);
    pos = end;
  }
  absl::StrAppend(&out, m.substr(pos));
  return absl::Status(status.code(), out);
}

// ------------------------------------------------------------- connecting

absl::StatusOr<std::unique_ptr<ShardedKvqClient>> ShardedKvqClient::Connect(
    std::shared_ptr<ReplicaSet> replicas, const ShardOptions& options) {
  if (replicas == nullptr) return absl::InvalidArgumentError("replicas is null");
  if (options.prefix_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_tokens must be >= 0, got ", options.prefix_tokens));
  }
  // The per-replica options are checked once here, not on each first use.
  ClientOptions probe = options.client;
  probe.target = "localhost:0";
  KVQ_RETURN_IF_ERROR(KvqClient::Connect(probe).status());
  return std::unique_ptr<ShardedKvqClient>(new ShardedKvqClient(std::move(replicas), options));
}

absl::StatusOr<std::unique_ptr<ShardedKvqClient>> ShardedKvqClient::Connect(
    absl::string_view targets, const ShardOptions& options) {
  absl::StatusOr<std::unique_ptr<ReplicaSet>> set;
  if (absl::ConsumePrefix(&targets, "dns:")) {
    set = ReplicaSet::FromDns(targets);
  } else {
    set = ReplicaSet::FromTargets(absl::StrSplit(targets, ',', absl::SkipWhitespace()));
  }
  if (!set.ok()) return set.status();
  return Connect(std::shared_ptr<ReplicaSet>(*std::move(set)), options);
}

ShardedKvqClient::ShardedKvqClient(std::shared_ptr<ReplicaSet> replicas,
                                   const ShardOptions& options)
    : replicas_(std::move(replicas)), options_(options) {
  rng_.seed(options.id_seed != 0 ? options.id_seed
                                 : (uint64_t{std::random_device{}()} << 32) ^
                                       std::random_device{}());
}

absl::StatusOr<std::shared_ptr<KvqClient>> ShardedKvqClient::ClientForReplica(
    absl::string_view replica) {
  std::shared_ptr<const ReplicaSet::Snapshot> snap = replicas_->Get();
  absl::MutexLock lock(&mu_);
  if (clients_version_ != snap->version) {
    // Replicas that left the list: their channels close once no call holds
    // them.
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (std::binary_search(snap->replicas.begin(), snap->replicas.end(), it->first)) {
        ++it;
      } else {
        clients_.erase(it++);  // flat_hash_map: erasing leaves other iterators valid.
      }
    }
    clients_version_ = snap->version;
  }
  auto it = clients_.find(replica);
  if (it != clients_.end()) return it->second;
  ClientOptions o = options_.client;
  o.target = std::string(replica);
  KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvqClient> client, KvqClient::Connect(o));
  std::shared_ptr<KvqClient> shared = std::move(client);
  clients_.emplace(std::string(replica), shared);
  return shared;
}

// ------------------------------------------------------------- placement

absl::StatusOr<ShardedKvqClient::Route> ShardedKvqClient::RouteOf(absl::string_view sequence_id) {
  std::shared_ptr<const ReplicaSet::Snapshot> snap = replicas_->Get();
  if (snap->replicas.empty()) return absl::FailedPreconditionError("no replicas");
  const std::string key = SequenceKey(options_.client.ns, sequence_id);
  std::string replica;
  {
    absl::MutexLock lock(&mu_);
    auto it = moved_.find(key);
    if (it != moved_.end() &&
        std::binary_search(snap->replicas.begin(), snap->replicas.end(), it->second)) {
      replica = it->second;
    }
  }
  if (replica.empty()) replica = snap->replicas[RendezvousWinner(key, snap->replicas)];
  KVQ_ASSIGN_OR_RETURN(std::shared_ptr<KvqClient> client, ClientForReplica(replica));
  return Route{std::move(replica), std::move(client)};
}

absl::StatusOr<std::string> ShardedKvqClient::ReplicaOf(absl::string_view sequence_id) {
  KVQ_ASSIGN_OR_RETURN(Route route, RouteOf(sequence_id));
  return route.replica;
}

absl::StatusOr<std::shared_ptr<KvqClient>> ShardedKvqClient::ClientFor(
    absl::string_view sequence_id) {
  KVQ_ASSIGN_OR_RETURN(Route route, RouteOf(sequence_id));
  return route.client;
}

std::string ShardedKvqClient::RandomId() {
  uint64_t r;
  {
    absl::MutexLock lock(&mu_);
    r = rng_();
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = "s";
  for (int shift = 60; shift >= 0; shift -= 4) id.push_back(kHex[(r >> shift) & 0xf]);
  return id;
}

absl::StatusOr<std::string> ShardedKvqClient::DrawIdFor(const std::vector<std::string>& replicas,
                                                        absl::string_view target) {
  const int draws = kDrawsPerReplica * static_cast<int>(replicas.size());
  for (int i = 0; i < draws; ++i) {
    std::string id = RandomId();
    const int w = RendezvousWinner(SequenceKey(options_.client.ns, id), replicas);
    if (w >= 0 && replicas[w] == target) return id;
  }
  return absl::InternalError(
      absl::StrCat("no id drawn in ", draws, " tries wins replica ", target));
}

void ShardedKvqClient::MarkDown(absl::string_view replica) {
  absl::MutexLock lock(&mu_);
  down_until_[replica] = absl::Now() + options_.down_cooldown;
}

bool ShardedKvqClient::IsDown(absl::string_view replica) {
  absl::MutexLock lock(&mu_);
  auto it = down_until_.find(replica);
  return it != down_until_.end() && it->second > absl::Now();
}

void ShardedKvqClient::NoteStatus(absl::string_view replica, const absl::Status& status) {
  if (status.code() == absl::StatusCode::kUnavailable) MarkDown(replica);
}

bool ShardedKvqClient::Relocate(absl::string_view sequence_id, absl::string_view tried) {
  std::shared_ptr<const ReplicaSet::Snapshot> snap = replicas_->Get();
  const std::string key = SequenceKey(options_.client.ns, sequence_id);
  CallOptions probe;
  probe.deadline = options_.probe_deadline;
  for (int i : RendezvousRanking(key, snap->replicas)) {
    const std::string& r = snap->replicas[i];
    if (r == tried || IsDown(r)) continue;
    absl::StatusOr<std::shared_ptr<KvqClient>> client = ClientForReplica(r);
    if (!client.ok()) continue;
    const absl::Status st = (*client)->Stats(sequence_id, probe).status();
    NoteStatus(r, st);
    if (!st.ok()) continue;
    absl::MutexLock lock(&mu_);
    if (moved_.size() >= kMaxMoved) moved_.clear();
    moved_[key] = r;
    return true;
  }
  return false;
}

template <typename Fn>
auto ShardedKvqClient::OnOwner(absl::string_view sequence_id, Fn fn)
    -> decltype(fn(std::declval<KvqClient&>())) {
  absl::StatusOr<Route> route = RouteOf(sequence_id);
  if (!route.ok()) return route.status();
  auto result = fn(*route->client);
  NoteStatus(route->replica, StatusOf(result));
  if (StatusOf(result).code() == absl::StatusCode::kNotFound &&
      Relocate(sequence_id, route->replica)) {
    route = RouteOf(sequence_id);
    if (!route.ok()) return route.status();
    result = fn(*route->client);
    NoteStatus(route->replica, StatusOf(result));
  }
  if (!StatusOf(result).ok()) return OnReplica(StatusOf(result), route->replica);
  return result;
}

std::vector<absl::Status> ShardedKvqClient::ForEachReplica(
    absl::Span<const std::string> ids,
    const std::function<absl::Status(KvqClient&, const std::vector<int>&)>& run) {
  const int n = static_cast<int>(ids.size());
  std::vector<absl::Status> status(n);
  struct Group {
    Route route;
    std::vector<int> indexes;
    absl::Status status;
  };
  // Groups of `indexes` by replica, in order of first appearance.
  auto group = [&](const std::vector<int>& indexes) {
    std::vector<Group> groups;
    for (int i : indexes) {
      absl::StatusOr<Route> route = RouteOf(ids[i]);
      if (!route.ok()) {
        status[i] = route.status();
        continue;
      }
      auto g = std::find_if(groups.begin(), groups.end(),
                            [&](const Group& x) { return x.route.replica == route->replica; });
      if (g == groups.end()) {
        groups.push_back(Group{*std::move(route), {}, {}});
        g = std::prev(groups.end());
      }
      g->indexes.push_back(i);
    }
    ParallelFor(static_cast<int>(groups.size()), static_cast<int>(groups.size()), [&](int g) {
      groups[g].status = run(*groups[g].route.client, groups[g].indexes);
    });
    for (Group& g : groups) {
      NoteStatus(g.route.replica, g.status);
      const absl::Status st = OnReplica(RenumberItems(g.status, g.indexes), g.route.replica);
      for (int i : g.indexes) status[i] = st;
    }
    return groups;
  };
  std::vector<int> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;
  std::vector<int> again;
  for (Group& g : group(all)) {
    if (g.status.code() != absl::StatusCode::kNotFound) continue;
    // The replica applied nothing of this part. Its sequences that it holds
    // and those found elsewhere go again; those found nowhere stay NOT_FOUND.
    CallOptions probe;
    probe.deadline = options_.probe_deadline;
    std::vector<int> present;
    bool moved = false;
    for (int i : g.indexes) {
      if (g.route.client->Stats(ids[i], probe).ok()) {
        present.push_back(i);
      } else if (Relocate(ids[i], g.route.replica)) {
        present.push_back(i);
        moved = true;
      } else {
        status[i] = absl::NotFoundError(absl::StrCat(
            "items[", i, "].sequence: ", ids[i], " is on none of the replicas"));
      }
    }
    if (moved || present.size() < g.indexes.size()) {
      again.insert(again.end(), present.begin(), present.end());
    }
  }
  if (!again.empty()) {
    std::sort(again.begin(), again.end());
    group(again);
  }
  return status;
}

// ------------------------------------------------------------- the calls

absl::StatusOr<v1::ServerInfo> ShardedKvqClient::GetServerInfo(const CallOptions& call) {
  std::shared_ptr<const ReplicaSet::Snapshot> snap = replicas_->Get();
  absl::Status last = absl::FailedPreconditionError("no replicas");
  for (const std::string& r : snap->replicas) {
    KVQ_ASSIGN_OR_RETURN(std::shared_ptr<KvqClient> client, ClientForReplica(r));
    absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo(call);
    NoteStatus(r, info.status());
    if (info.ok()) return info;
    last = OnReplica(info.status(), r);
  }
  return last;
}

absl::StatusOr<SequenceInfo> ShardedKvqClient::CreateSequence(const CreateOptions& options) {
  KVQ_RETURN_IF_ERROR(options.config.ToStreamConfig().status());
  if (!options.sequence_id.empty()) {
    return OnOwner(options.sequence_id,
                   [&](KvqClient& c) { return c.CreateSequence(options); });
  }
  std::shared_ptr<const ReplicaSet::Snapshot> snap = replicas_->Get();
  const std::vector<std::string>& reps = snap->replicas;
  if (reps.empty()) return absl::FailedPreconditionError("no replicas");
  const std::string& ns = options_.client.ns;
  const int p = options_.prefix_tokens;
  const std::string prefix_key =
      p > 0 && static_cast<int>(options.prompt_token_ids.size()) >= p
          ? PrefixKey(ns, options.prompt_token_ids, p)
          : std::string();
  absl::Status last;
  for (size_t attempt = 0; attempt < reps.size(); ++attempt) {
    std::string id = RandomId();
    const std::vector<int> ranking =
        RendezvousRanking(prefix_key.empty() ? SequenceKey(ns, id) : prefix_key, reps);
    // The best replica not known to be down (all down: the best).
    std::string target = reps[ranking[0]];
    for (int i : ranking) {
      if (!IsDown(reps[i])) {
        target = reps[i];
        break;
      }
    }
    if (reps[RendezvousWinner(SequenceKey(ns, id), reps)] != target) {
      KVQ_ASSIGN_OR_RETURN(id, DrawIdFor(reps, target));
    }
    KVQ_ASSIGN_OR_RETURN(std::shared_ptr<KvqClient> client, ClientForReplica(target));
    CreateOptions o = options;
    o.sequence_id = id;
    absl::StatusOr<SequenceInfo> info = client->CreateSequence(o);
    NoteStatus(target, info.status());
    if (info.ok()) return info;
    last = OnReplica(info.status(), target);
    if (info.status().code() != absl::StatusCode::kUnavailable) return last;
  }
  return last;
}

absl::StatusOr<AppendResult> ShardedKvqClient::AppendPrompt(absl::string_view sequence_id,
                                                            const HostTensor& k,
                                                            const HostTensor& v,
                                                            const AppendOptions& options) {
  return OnOwner(sequence_id,
                 [&](KvqClient& c) { return c.AppendPrompt(sequence_id, k, v, options); });
}

absl::StatusOr<AppendResult> ShardedKvqClient::AppendPromptQuantized(
    absl::string_view sequence_id, const SequenceConfig& config, const HostTensor& k,
    const HostTensor& v, const AppendOptions& options) {
  return OnOwner(sequence_id, [&](KvqClient& c) {
    return c.AppendPromptQuantized(sequence_id, config, k, v, options);
  });
}

absl::StatusOr<FetchedKv> ShardedKvqClient::FetchDequant(absl::string_view sequence_id,
                                                         const FetchOptions& options) {
  return OnOwner(sequence_id, [&](KvqClient& c) { return c.FetchDequant(sequence_id, options); });
}

absl::Status ShardedKvqClient::FetchDequantInto(absl::string_view sequence_id,
                                                const FetchOptions& options, HostTensor* k,
                                                HostTensor* v) {
  return OnOwner(sequence_id,
                 [&](KvqClient& c) { return c.FetchDequantInto(sequence_id, options, k, v); });
}

absl::StatusOr<RawFetch> ShardedKvqClient::FetchRaw(absl::string_view sequence_id,
                                                    const FetchOptions& options) {
  return OnOwner(sequence_id, [&](KvqClient& c) { return c.FetchRaw(sequence_id, options); });
}

absl::StatusOr<FetchedKv> ShardedKvqClient::FetchDequantLocal(absl::string_view sequence_id,
                                                              const SequenceConfig& config,
                                                              const FetchOptions& options) {
  return OnOwner(sequence_id, [&](KvqClient& c) {
    return c.FetchDequantLocal(sequence_id, config, options);
  });
}

absl::Status ShardedKvqClient::FetchDequantLocalInto(absl::string_view sequence_id,
                                                     const SequenceConfig& config,
                                                     const FetchOptions& options, HostTensor* k,
                                                     HostTensor* v) {
  return OnOwner(sequence_id, [&](KvqClient& c) {
    return c.FetchDequantLocalInto(sequence_id, config, options, k, v);
  });
}

template <typename Item, typename AttendFn>
std::vector<absl::StatusOr<AttendOutput>> ShardedKvqClient::AttendPerReplica(
    absl::Span<const Item> items, AttendFn attend) {
  std::vector<std::string> ids;
  for (const Item& it : items) ids.push_back(it.sequence_id);
  std::vector<AttendOutput> outputs(items.size());
  const std::vector<absl::Status> status =
      ForEachReplica(ids, [&](KvqClient& c, const std::vector<int>& idx) -> absl::Status {
        const std::vector<Item> part = Pick(items, idx);
        KVQ_ASSIGN_OR_RETURN(std::vector<AttendOutput> out, attend(c, part));
        for (size_t j = 0; j < idx.size() && j < out.size(); ++j) {
          outputs[idx[j]] = std::move(out[j]);
        }
        return absl::OkStatus();
      });
  std::vector<absl::StatusOr<AttendOutput>> result;
  for (size_t i = 0; i < items.size(); ++i) {
    if (status[i].ok()) {
      result.push_back(std::move(outputs[i]));
    } else {
      result.push_back(status[i]);
    }
  }
  return result;
}

std::vector<absl::StatusOr<AttendOutput>> ShardedKvqClient::AttendEach(
    int layer, absl::Span<const AttendQuery> items, float softmax_scale,
    const CallOptions& call) {
  return AttendPerReplica(items, [&](KvqClient& c, const std::vector<AttendQuery>& part) {
    return c.Attend(layer, part, softmax_scale, call);
  });
}

absl::StatusOr<std::vector<AttendOutput>> ShardedKvqClient::Attend(
    int layer, absl::Span<const AttendQuery> items, float softmax_scale,
    const CallOptions& call) {
  return AllOrFirstError(AttendEach(layer, items, softmax_scale, call));
}

std::vector<absl::StatusOr<AttendOutput>> ShardedKvqClient::AppendAttendEach(
    int layer, absl::Span<const AppendAttendItem> items, float softmax_scale,
    const CallOptions& call) {
  return AttendPerReplica(items, [&](KvqClient& c, const std::vector<AppendAttendItem>& part) {
    return c.AppendAttend(layer, part, softmax_scale, call);
  });
}

absl::StatusOr<std::vector<AttendOutput>> ShardedKvqClient::AppendAttend(
    int layer, absl::Span<const AppendAttendItem> items, float softmax_scale,
    const CallOptions& call) {
  return AllOrFirstError(AppendAttendEach(layer, items, softmax_scale, call));
}

absl::StatusOr<PartialBatchOutput> ShardedKvqClient::AttendBatchEach(
    int layer, absl::Span<const std::string> sequence_ids, const HostTensor& q,
    const AttendBatchOptions& options) {
  const int n = static_cast<int>(sequence_ids.size());
  if (n == 0 || q.rank() != 3 || q.shape[0] != n) {
    return absl::InvalidArgumentError(absl::StrCat("q is ", q.DebugString(), "; it must be [",
                                                   n, " sequences (at least one), heads, head_dim]"));
  }
  KVQ_RETURN_IF_ERROR(q.Validate());
  PartialBatchOutput result;
  absl::Mutex merge_mu;
  result.status =
      ForEachReplica(sequence_ids, [&](KvqClient& c, const std::vector<int>& idx) -> absl::Status {
        const std::vector<std::string> part = Pick(sequence_ids, idx);
        KVQ_ASSIGN_OR_RETURN(AttendOutput out,
                             c.AttendBatch(layer, part, GatherRows(q, idx), options));
        absl::MutexLock lock(&merge_mu);
        ScatterRows(out.out, idx, n, &result.output.out);
        ScatterRows(out.lse, idx, n, &result.output.lse);
        return absl::OkStatus();
      });
  return result;
}

absl::StatusOr<AttendOutput> ShardedKvqClient::AttendBatch(
    int layer, absl::Span<const std::string> sequence_ids, const HostTensor& q,
    const AttendBatchOptions& options) {
  KVQ_ASSIGN_OR_RETURN(PartialBatchOutput r, AttendBatchEach(layer, sequence_ids, q, options));
  KVQ_RETURN_IF_ERROR(FirstError(r.status));
  return std::move(r.output);
}

absl::StatusOr<PartialBatchOutput> ShardedKvqClient::AppendAttendBatchEach(
    int layer, const DecodeBatch& batch, float softmax_scale, const CallOptions& call) {
  KVQ_RETURN_IF_ERROR(ValidateDecodeBatch(batch));
  const int n = static_cast<int>(batch.sequence_ids.size());
  PartialBatchOutput result;
  absl::Mutex merge_mu;
  result.status = ForEachReplica(
      batch.sequence_ids, [&](KvqClient& c, const std::vector<int>& idx) -> absl::Status {
        DecodeBatch part;
        part.sequence_ids = Pick(absl::MakeConstSpan(batch.sequence_ids), idx);
        part.k = GatherRows(batch.k, idx);
        part.v = GatherRows(batch.v, idx);
        part.q = GatherRows(batch.q, idx);
        KVQ_ASSIGN_OR_RETURN(AttendOutput out,
                             c.AppendAttendBatch(layer, part, softmax_scale, call));
        absl::MutexLock lock(&merge_mu);
        ScatterRows(out.out, idx, n, &result.output.out);
        ScatterRows(out.lse, idx, n, &result.output.lse);
        return absl::OkStatus();
      });
  return result;
}

absl::StatusOr<AttendOutput> ShardedKvqClient::AppendAttendBatch(int layer,
                                                                 const DecodeBatch& batch,
                                                                 float softmax_scale,
                                                                 const CallOptions& call) {
  KVQ_ASSIGN_OR_RETURN(PartialBatchOutput r,
                       AppendAttendBatchEach(layer, batch, softmax_scale, call));
  KVQ_RETURN_IF_ERROR(FirstError(r.status));
  return std::move(r.output);
}

absl::StatusOr<ForkResult> ShardedKvqClient::Fork(absl::string_view source_id,
                                                  const ForkOptions& options) {
  KVQ_ASSIGN_OR_RETURN(Route route, RouteOf(source_id));
  std::shared_ptr<const ReplicaSet::Snapshot> snap = replicas_->Get();
  ForkOptions o = options;
  if (o.new_sequence_id.empty()) {
    KVQ_ASSIGN_OR_RETURN(o.new_sequence_id, DrawIdFor(snap->replicas, route.replica));
  } else {
    const std::string& winner = snap->replicas[RendezvousWinner(
        SequenceKey(options_.client.ns, o.new_sequence_id), snap->replicas)];
    if (winner != route.replica) {
      return absl::InvalidArgumentError(absl::StrCat(
          "new_sequence_id ", Quoted(o.new_sequence_id), " is placed on replica ", winner,
          ", not on ", route.replica, " where the source is; leave it empty to draw one"));
    }
  }
  absl::StatusOr<ForkResult> r = route.client->Fork(source_id, o);
  NoteStatus(route.replica, r.status());
  if (!r.ok()) return OnReplica(r.status(), route.replica);
  return r;
}

absl::StatusOr<int64_t> ShardedKvqClient::Release(absl::string_view sequence_id,
                                                  const CallOptions& call) {
  absl::StatusOr<int64_t> r =
      OnOwner(sequence_id, [&](KvqClient& c) { return c.Release(sequence_id, call); });
  if (r.ok()) {
    absl::MutexLock lock(&mu_);
    moved_.erase(SequenceKey(options_.client.ns, sequence_id));
  }
  return r;
}

absl::StatusOr<v1::StatsResponse> ShardedKvqClient::Stats(absl::string_view sequence_id,
                                                          const CallOptions& call) {
  if (sequence_id.empty()) {
    return absl::InvalidArgumentError(
        "sequence_id is empty: server-wide stats are per replica (StatsAll)");
  }
  return OnOwner(sequence_id, [&](KvqClient& c) { return c.Stats(sequence_id, call); });
}

std::vector<ReplicaStats> ShardedKvqClient::StatsAll(const CallOptions& call) {
  std::shared_ptr<const ReplicaSet::Snapshot> snap = replicas_->Get();
  const int n = static_cast<int>(snap->replicas.size());
  std::vector<ReplicaStats> out(n);
  ParallelFor(n, n, [&](int i) {
    out[i].replica = snap->replicas[i];
    absl::StatusOr<std::shared_ptr<KvqClient>> client = ClientForReplica(snap->replicas[i]);
    out[i].stats = client.ok() ? (*client)->Stats("", call) : client.status();
    if (!out[i].stats.ok()) out[i].stats = OnReplica(out[i].stats.status(), out[i].replica);
  });
  return out;
}

}  // namespace kvq
