#include "client/rendezvous.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace kvq {

uint64_t Fnv1a64(absl::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t Mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 31;
  return z;
}

uint64_t Hash64(absl::string_view bytes) { return Mix64(Fnv1a64(bytes)); }

uint64_t RendezvousScore(uint64_t key_hash, absl::string_view replica) {
  return Mix64(key_hash ^ Hash64(replica));
}

namespace {

// Whether replica a (score sa) ranks before replica b (score sb).
bool Before(uint64_t sa, absl::string_view a, uint64_t sb, absl::string_view b) {
  return sa != sb ? sa > sb : a < b;
}

}  // namespace

int RendezvousWinner(absl::string_view key, absl::Span<const std::string> replicas) {
  const uint64_t h = Hash64(key);
  int best = -1;
  uint64_t best_score = 0;
  for (int i = 0; i < static_cast<int>(replicas.size()); ++i) {
    const uint64_t s = RendezvousScore(h, replicas[i]);
    if (best < 0 || Before(s, replicas[i], best_score, replicas[best])) {
      best = i;
      best_score = s;
    }
  }
  return best;
}

std::vector<int> RendezvousRanking(absl::string_view key, absl::Span<const std::string> replicas) {
  const uint64_t h = Hash64(key);
  std::vector<uint64_t> scores(replicas.size());
  for (size_t i = 0; i < replicas.size(); ++i) scores[i] = RendezvousScore(h, replicas[i]);
  std::vector<int> order(replicas.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return Before(scores[a], replicas[a], scores[b], replicas[b]);
  });
  return order;
}

std::string SequenceKey(absl::string_view ns, absl::string_view sequence_id) {
  return absl::StrCat(ns, absl::string_view("\0", 1), sequence_id);
}

std::string PrefixKey(absl::string_view ns, absl::Span<const int32_t> prompt_token_ids,
                      int prefix_tokens) {
  std::string key = absl::StrCat("prefix", absl::string_view("\0", 1), ns,
                                 absl::string_view("\0", 1));
  const size_t n = std::min<size_t>(std::max(prefix_tokens, 0), prompt_token_ids.size());
  for (size_t i = 0; i < n; ++i) {
    const uint32_t t = static_cast<uint32_t>(prompt_token_ids[i]);
    for (int b = 0; b < 4; ++b) key.push_back(static_cast<char>((t >> (8 * b)) & 0xff));
  }
  return key;
}

}  // namespace kvq
