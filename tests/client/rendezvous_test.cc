// Rendezvous hashing: the specified hash, spread, stability, minimal
// movement, and the golden placements the Python client checks too.
#include "client/rendezvous.h"

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace kvq {
namespace {

const std::vector<std::string> kReplicas = {"127.0.0.1:50051", "127.0.0.1:50052", "[::1]:50053",
                                            "kvq-3.kvq:50051", "kvq-4.kvq:50051"};

TEST(RendezvousTest, HashMatchesItsSpecification) {
  // FNV-1a 64's published test values.
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(Fnv1a64("foobar"), 0x85944171f73967e8ull);
  // SplitMix64's finalizer: 0 is its fixed point, and it is a bijection
  // that changes every other input here.
  EXPECT_EQ(Mix64(0), 0u);
  EXPECT_EQ(Mix64(1), 0x5692161d100b05e5ull);
  EXPECT_EQ(Hash64("a"), Mix64(0xaf63dc4c8601ec8cull));
  EXPECT_EQ(RendezvousScore(Hash64("k"), "r"), Mix64(Hash64("k") ^ Hash64("r")));
}

TEST(RendezvousTest, KeysAreUnambiguous) {
  EXPECT_EQ(SequenceKey("ns", "id"), std::string("ns\0id", 5));
  EXPECT_NE(SequenceKey("a", "bc"), SequenceKey("ab", "c"));
  const std::vector<int32_t> tokens = {1, -2, 0x01020304};
  EXPECT_EQ(PrefixKey("t", tokens, 2),
            std::string("prefix\0t\0\x01\0\0\0\xfe\xff\xff\xff", 17));
  // Only the first prefix_tokens ids count.
  EXPECT_EQ(PrefixKey("t", tokens, 2), PrefixKey("t", {1, -2, 7, 8}, 2));
  EXPECT_NE(PrefixKey("t", tokens, 2), PrefixKey("u", tokens, 2));
}

TEST(RendezvousTest, EmptyListHasNoWinner) {
  EXPECT_EQ(RendezvousWinner("x", {}), -1);
  EXPECT_TRUE(RendezvousRanking("x", {}).empty());
}

TEST(RendezvousTest, WinnerIsFirstOfRankingAndIndependentOfListOrder) {
  std::vector<std::string> reversed(kReplicas.rbegin(), kReplicas.rend());
  for (int i = 0; i < 200; ++i) {
    const std::string key = SequenceKey("ns", absl::StrCat("seq-", i));
    const std::vector<int> ranking = RendezvousRanking(key, kReplicas);
    ASSERT_EQ(ranking.size(), kReplicas.size());
    EXPECT_EQ(RendezvousWinner(key, kReplicas), ranking[0]);
    EXPECT_EQ(reversed[RendezvousWinner(key, reversed)], kReplicas[ranking[0]]);
  }
}

TEST(RendezvousTest, SpreadsKeysEvenly) {
  // 30000 keys over 5 replicas: 6000 each expected, binomial sd ~69; a
  // 5 % band is over 4 sd.
  std::map<int, int> count;
  constexpr int kKeys = 30000;
  for (int i = 0; i < kKeys; ++i) ++count[RendezvousWinner(SequenceKey("", absl::StrCat(i)), kReplicas)];
  for (int r = 0; r < static_cast<int>(kReplicas.size()); ++r) {
    EXPECT_NEAR(count[r], kKeys / 5, kKeys / 5 * 0.05) << kReplicas[r];
  }
}

TEST(RendezvousTest, RemovingAReplicaMovesOnlyItsKeysToTheirRunnerUp) {
  std::vector<std::string> survivors = kReplicas;
  survivors.erase(survivors.begin() + 2);
  int moved = 0;
  for (int i = 0; i < 5000; ++i) {
    const std::string key = SequenceKey("ns", absl::StrCat("s", i));
    const std::vector<int> before = RendezvousRanking(key, kReplicas);
    const std::string after = survivors[RendezvousWinner(key, survivors)];
    if (before[0] == 2) {
      ++moved;
      EXPECT_EQ(after, kReplicas[before[1]]);
    } else {
      EXPECT_EQ(after, kReplicas[before[0]]) << key;
    }
  }
  EXPECT_NEAR(moved, 1000, 150);  // Its fifth.
}

TEST(RendezvousTest, AddingAReplicaTakesKeysOnlyForItself) {
  std::vector<std::string> grown = kReplicas;
  grown.push_back("kvq-5.kvq:50051");
  int taken = 0;
  for (int i = 0; i < 6000; ++i) {
    const std::string key = SequenceKey("ns", absl::StrCat("s", i));
    const std::string before = kReplicas[RendezvousWinner(key, kReplicas)];
    const std::string after = grown[RendezvousWinner(key, grown)];
    if (after != before) {
      ++taken;
      EXPECT_EQ(after, "kvq-5.kvq:50051");
    }
  }
  EXPECT_NEAR(taken, 1000, 150);  // A sixth.
}

// tests/client/testdata/rendezvous_golden.tsv: placements of fixed keys that
// tests/python/test_sharding_unit.py checks the Python client against.
// Regenerate (only when the hash is meant to change, which moves every
// deployed sequence) with KVQ_WRITE_GOLDEN=1.
std::string GoldenTable() {
  std::string out = absl::StrCat("# replicas\t", absl::StrJoin(kReplicas, "\t"), "\n",
                                 "# kind\tnamespace\tinput\thash64\tranking\n");
  auto line = [&](absl::string_view kind, absl::string_view ns, absl::string_view input,
                  const std::string& key) {
    absl::StrAppend(&out, kind, "\t", ns, "\t", input, "\t", absl::Hex(Hash64(key), absl::kZeroPad16),
                    "\t", absl::StrJoin(RendezvousRanking(key, kReplicas), ","), "\n");
  };
  for (int i = 0; i < 40; ++i) {
    const std::string ns = i % 2 ? "tenant-a" : "";
    const std::string id = i < 20 ? absl::StrCat("seq-", i) : absl::StrCat("s", absl::Hex(i * 0x9e3779b97f4a7c15ull, absl::kZeroPad16));
    line("seq", ns, id, SequenceKey(ns, id));
  }
  for (int i = 0; i < 10; ++i) {
    std::vector<int32_t> tokens;
    for (int t = 0; t < 32 + i; ++t) tokens.push_back(i * 1000 + t * 7 - 3);
    line("prefix", "tenant-b", absl::StrJoin(tokens, ","), PrefixKey("tenant-b", tokens, 32));
  }
  return out;
}

TEST(RendezvousTest, GoldenPlacements) {
  const std::string path = KVQ_RENDEZVOUS_GOLDEN;
  const std::string want = GoldenTable();
  if (std::getenv("KVQ_WRITE_GOLDEN") != nullptr) {
    std::ofstream(path) << want;
    GTEST_SKIP() << "wrote " << path;
  }
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path;
  std::stringstream got;
  got << in.rdbuf();
  EXPECT_EQ(got.str(), want);
}

}  // namespace
}  // namespace kvq
