// Rendezvous (highest-random-weight) hashing: which of several kvq-server
// replicas holds a sequence.
//
// Every replica gets a score per key and the highest score wins, so all
// clients that see the same replica list agree on placement without talking
// to each other, and removing a replica moves only the keys it won (each to
// its runner-up); adding one takes about 1/N of the keys, all to itself.
//
// The hash is specified here, not borrowed from a library with a per-process
// seed (absl::Hash), because the Python client (kvq_client/sharding.py)
// must compute the same placements bit for bit:
//   Hash64(bytes)     = Mix64(FNV-1a 64 of bytes)
//   Mix64(z)          = the SplitMix64 finalizer (z ^= z >> 30;
//                       z *= 0xbf58476d1ce4e5b9; z ^= z >> 27;
//                       z *= 0x94d049bb133111eb; z ^= z >> 31)
//   Score(key, r)     = Mix64(Hash64(key) ^ Hash64(r))
// Ties (never seen in practice) go to the replica name that sorts first.
// tests/client/testdata/rendezvous_golden.tsv pins the placements both
// clients must produce.
#ifndef KVQ_CLIENT_RENDEZVOUS_H_
#define KVQ_CLIENT_RENDEZVOUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvq {

uint64_t Fnv1a64(absl::string_view bytes);
uint64_t Mix64(uint64_t z);
uint64_t Hash64(absl::string_view bytes);
uint64_t RendezvousScore(uint64_t key_hash, absl::string_view replica);

// Index in `replicas` of the key's winner; -1 when `replicas` is empty.
int RendezvousWinner(absl::string_view key, absl::Span<const std::string> replicas);
// Indexes of `replicas`, best first: the winner, then who takes over when
// it is gone, and so on.
std::vector<int> RendezvousRanking(absl::string_view key, absl::Span<const std::string> replicas);

// The placement key of a sequence: its namespace and id (ids are unique per
// namespace on a server).
std::string SequenceKey(absl::string_view ns, absl::string_view sequence_id);
// The placement key of a prompt for prefix reuse: its namespace and its
// first `prefix_tokens` token ids (little-endian int32). Prompts that share
// a reusable prefix share these tokens, so they meet on one replica.
std::string PrefixKey(absl::string_view ns, absl::Span<const int32_t> prompt_token_ids,
                      int prefix_tokens);

}  // namespace kvq

#endif  // KVQ_CLIENT_RENDEZVOUS_H_
