// ShardedKvqClient: KvqClient's calls over several kvq-server replicas, each
// sequence on one of them, chosen by rendezvous hashing
// (client/rendezvous.h) over the replicas of a ReplicaSet (a fixed list or a
// DNS name, client/replica_set.h).
//
// Placement: a call about a sequence goes to the winner of
// SequenceKey(namespace, id) among the current replicas. The sharded client
// draws new sequence ids itself ("s" + 16 hex digits) so that the id's
// winner is the replica it wants:
//   - with prompt_token_ids of at least ShardOptions::prefix_tokens tokens
//     (prefix reuse), the winner of PrefixKey(namespace, first
//     prefix_tokens ids): prompts that share a prefix meet on one replica,
//     where the server can reuse the prefix's pages;
//   - otherwise the winner of the first id drawn (uniform).
// It draws ids until one's winner is that replica (N draws expected for N
// replicas). Every worker that sees the same replica list then routes the id
// to the same replica, by the id alone. A caller-chosen id
// (CreateOptions::sequence_id) is placed by its own hash, so such a sequence
// does not meet its prefix unless by chance.
//
// Replicas that go away: calls for their sequences fail with UNAVAILABLE
// (the replica is down but still listed; idempotent calls are retried first,
// as KvqClient does) or NOT_FOUND (it restarted empty); the worker
// recomputes those sequences. Other replicas' sequences are not touched:
// removing a replica moves only the keys it won. A replica that answered
// UNAVAILABLE gets no new sequences for ShardOptions::down_cooldown, so
// creation goes on on the others even before DNS drops the dead one.
// Replicas that are added take about 1/(N+1) of the existing ids' hash
// wins: a call that gets NOT_FOUND from an id's winner looks for the
// sequence on the other replicas in rank order (one Stats probe each),
// remembers where it found it and repeats the call there once.
//
// Batched calls (Attend, AttendBatch, AppendAttend, AppendAttendBatch) are
// split per replica, sent concurrently and merged back in the caller's
// order. Each replica's part is atomic on its server, the batch as a whole
// is not: when one replica fails the others' parts were applied. The *Each
// forms return each item's status, so that a decode worker drops only the
// sequences of the failed replica; the plain forms return the first
// failure (its message names the replica; items[i] in a server's message is
// renumbered to the caller's index).
//
// Decode streams: OpenDecodeSession (client/sharded_decode_session.h) keeps
// one stream per replica behind one session.
//
// Thread-safe, like KvqClient.
#ifndef KVQ_CLIENT_SHARDED_CLIENT_H_
#define KVQ_CLIENT_SHARDED_CLIENT_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/kvq_client.h"
#include "client/replica_set.h"

namespace kvq {

class ShardedDecodeSession;  // client/sharded_decode_session.h

struct ShardOptions {
  // Options of each replica's KvqClient (`target` is replaced per replica).
  ClientOptions client;
  // Prompt tokens that place a sequence created with prompt_token_ids. Must
  // be the same in every worker (C++ and Python default alike) and at most
  // the first reusable block (sink + block_tokens; 32 is the default page).
  int prefix_tokens = 32;
  // How long a replica that answered UNAVAILABLE gets no new sequences.
  absl::Duration down_cooldown = absl::Seconds(5);
  // Deadline of each Stats probe that looks for a sequence after NOT_FOUND.
  absl::Duration probe_deadline = absl::Seconds(2);
  // Seed of the id generator; 0 seeds from std::random_device. A fixed
  // seed gives reproducible ids (tests); workers must not share one.
  uint64_t id_seed = 0;
};

// One replica's answer to a server-wide call.
struct ReplicaStats {
  std::string replica;
  absl::StatusOr<v1::StatsResponse> stats;
};

// AppendAttendBatch / AttendBatch per item: rows of failed items are zero.
struct PartialBatchOutput {
  AttendOutput output;
  std::vector<absl::Status> status;  // One per sequence, in order.
};

class ShardedKvqClient {
 public:
  static absl::StatusOr<std::unique_ptr<ShardedKvqClient>> Connect(
      std::shared_ptr<ReplicaSet> replicas, const ShardOptions& options = {});
  // "a:1,b:2" (a fixed list) or "dns:NAME:PORT" (re-resolved every 5 s).
  static absl::StatusOr<std::unique_ptr<ShardedKvqClient>> Connect(
      absl::string_view targets, const ShardOptions& options = {});

  ReplicaSet& replica_set() { return *replicas_; }
  const ShardOptions& options() const { return options_; }

  // The replica that holds (or will hold) the sequence: where a NOT_FOUND
  // found it, else its id's winner. FAILED_PRECONDITION without replicas.
  absl::StatusOr<std::string> ReplicaOf(absl::string_view sequence_id);
  // The KvqClient of a sequence's replica, e.g. to open a DecodeSession for
  // the sequences of one replica.
  absl::StatusOr<std::shared_ptr<KvqClient>> ClientFor(absl::string_view sequence_id);
  absl::StatusOr<std::shared_ptr<KvqClient>> ClientForReplica(absl::string_view replica);

  // The first replica that answers.
  absl::StatusOr<v1::ServerInfo> GetServerInfo(const CallOptions& call = {});
  // See the placement rule above. INVALID_ARGUMENT as KvqClient;
  // UNAVAILABLE when every replica is.
  absl::StatusOr<SequenceInfo> CreateSequence(const CreateOptions& options);
  // KvqClient::MatchPrefix (read-only) asked of the replica CreateSequence
  // would place this prompt on: the prefix key's first replica not known to
  // be down. A prompt shorter than prefix_tokens is placed uniformly: over
  // several replicas no one holds its prefix predictably, so the answer is
  // 0 matched tokens without a call.
  absl::StatusOr<PrefixMatch> MatchPrefix(const SequenceConfig& config,
                                          const std::vector<int32_t>& prompt_token_ids,
                                          const CallOptions& call = {});
  absl::StatusOr<AppendResult> AppendPrompt(absl::string_view sequence_id, const HostTensor& k,
                                            const HostTensor& v, const AppendOptions& options = {});
  absl::StatusOr<AppendResult> AppendPromptQuantized(absl::string_view sequence_id,
                                                     const SequenceConfig& config,
                                                     const HostTensor& k, const HostTensor& v,
                                                     const AppendOptions& options = {});
  absl::StatusOr<FetchedKv> FetchDequant(absl::string_view sequence_id,
                                         const FetchOptions& options = {});
  absl::Status FetchDequantInto(absl::string_view sequence_id, const FetchOptions& options,
                                HostTensor* k, HostTensor* v);
  absl::StatusOr<RawFetch> FetchRaw(absl::string_view sequence_id,
                                    const FetchOptions& options = {});
  absl::StatusOr<FetchedKv> FetchDequantLocal(absl::string_view sequence_id,
                                              const SequenceConfig& config,
                                              const FetchOptions& options = {});
  absl::Status FetchDequantLocalInto(absl::string_view sequence_id, const SequenceConfig& config,
                                     const FetchOptions& options, HostTensor* k, HostTensor* v);

  absl::StatusOr<std::vector<AttendOutput>> Attend(int layer, absl::Span<const AttendQuery> items,
                                                   float softmax_scale = 0.0f,
                                                   const CallOptions& call = {});
  std::vector<absl::StatusOr<AttendOutput>> AttendEach(int layer,
                                                       absl::Span<const AttendQuery> items,
                                                       float softmax_scale = 0.0f,
                                                       const CallOptions& call = {});
  absl::StatusOr<AttendOutput> AttendBatch(int layer, absl::Span<const std::string> sequence_ids,
                                           const HostTensor& q,
                                           const AttendBatchOptions& options = {});
  absl::StatusOr<PartialBatchOutput> AttendBatchEach(int layer,
                                                     absl::Span<const std::string> sequence_ids,
                                                     const HostTensor& q,
                                                     const AttendBatchOptions& options = {});
  absl::StatusOr<std::vector<AttendOutput>> AppendAttend(
      int layer, absl::Span<const AppendAttendItem> items, float softmax_scale = 0.0f,
      const CallOptions& call = {});
  std::vector<absl::StatusOr<AttendOutput>> AppendAttendEach(
      int layer, absl::Span<const AppendAttendItem> items, float softmax_scale = 0.0f,
      const CallOptions& call = {});
  absl::StatusOr<AttendOutput> AppendAttendBatch(int layer, const DecodeBatch& batch,
                                                 float softmax_scale = 0.0f,
                                                 const CallOptions& call = {});
  absl::StatusOr<PartialBatchOutput> AppendAttendBatchEach(int layer, const DecodeBatch& batch,
                                                           float softmax_scale = 0.0f,
                                                           const CallOptions& call = {});

  // A DecodeStream per replica behind one session; `deadline` covers each
  // replica's stream (infinite: as long as the decode loop).
  std::unique_ptr<ShardedDecodeSession> OpenDecodeSession(
      absl::Duration deadline = absl::InfiniteDuration());

  // The fork lives on the source's replica: its id is drawn to win there
  // (a caller-chosen new_sequence_id that does not is INVALID_ARGUMENT).
  absl::StatusOr<ForkResult> Fork(absl::string_view source_id, const ForkOptions& options = {});
  absl::StatusOr<int64_t> Release(absl::string_view sequence_id, const CallOptions& call = {});
  absl::StatusOr<v1::StatsResponse> Stats(absl::string_view sequence_id,
                                          const CallOptions& call = {});
  // Server-wide stats of every current replica, in replica order.
  std::vector<ReplicaStats> StatsAll(const CallOptions& call = {});

 private:
  ShardedKvqClient(std::shared_ptr<ReplicaSet> replicas, const ShardOptions& options);

  // A sequence's replica (see ReplicaOf) with its client.
  struct Route {
    std::string replica;
    std::shared_ptr<KvqClient> client;
  };
  absl::StatusOr<Route> RouteOf(absl::string_view sequence_id);
  // After NOT_FOUND from `tried`: probes the other replicas in rank order;
  // true when the sequence was found elsewhere (and remembered).
  bool Relocate(absl::string_view sequence_id, absl::string_view tried);
  // Runs fn(route) on the sequence's replica; after NOT_FOUND, once more
  // where Relocate found it. Marks a replica that answers UNAVAILABLE down.
  template <typename Fn>
  auto OnOwner(absl::string_view sequence_id, Fn fn) -> decltype(fn(std::declval<KvqClient&>()));
  // Splits item indexes per replica and runs run(client, indexes) for each
  // group concurrently; item i's status is its group's. Groups that fail
  // with NOT_FOUND are retried once where Relocate finds their sequences.
  std::vector<absl::Status> ForEachReplica(
      absl::Span<const std::string> ids,
      const std::function<absl::Status(KvqClient&, const std::vector<int>&)>& run);
  // AttendEach and AppendAttendEach: attend(client, part) for each replica's
  // part of `items`; item i gets its output or its part's status.
  template <typename Item, typename AttendFn>
  std::vector<absl::StatusOr<AttendOutput>> AttendPerReplica(absl::Span<const Item> items,
                                                             AttendFn attend);

  // A fresh id whose winner among `replicas` is `target`.
  absl::StatusOr<std::string> DrawIdFor(const std::vector<std::string>& replicas,
                                        absl::string_view target);
  std::string RandomId();
  // The best-ranked replica for `key` not known to be down (all down: the best).
  std::string FirstUp(absl::string_view key, const std::vector<std::string>& replicas);
  // PrefixKey of the prompt's first prefix_tokens ids; "" when shorter.
  std::string PromptKey(const std::vector<int32_t>& prompt_token_ids) const;
  void MarkDown(absl::string_view replica);
  bool IsDown(absl::string_view replica);
  void NoteStatus(absl::string_view replica, const absl::Status& status);

  std::shared_ptr<ReplicaSet> replicas_;
  ShardOptions options_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<KvqClient>> clients_ ABSL_GUARDED_BY(mu_);
  uint64_t clients_version_ ABSL_GUARDED_BY(mu_) = 0;
  // SequenceKey -> replica, for sequences found off their winner.
  absl::flat_hash_map<std::string, std::string> moved_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::Time> down_until_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
};

// "items[j]" at the start of a server's message about a sub-batch, renumbered
// to items[indexes[j]] of the caller's batch.
absl::Status RenumberItems(const absl::Status& status, const std::vector<int>& indexes);

}  // namespace kvq

#endif  // KVQ_CLIENT_SHARDED_CLIENT_H_
