// The input format of rpc_fuzz and the sequences every input starts with,
// shared by the target and the seed corpus generator (make_fuzz_corpus.cc).
//
// An input is a list of calls, end to end, each
//   [method byte][message count byte] then per message [u16 length LE][bytes]
// where the method byte picks a kvq.v1.KvCache method (modulo kNumMethods)
// and the bytes are one serialized request message of it (fuzzed as bytes:
// they need not parse). Unary methods take their first message; a
// truncated length takes what is left of the input.
#ifndef KVQ_TESTS_FUZZ_RPC_INPUT_H_
#define KVQ_TESTS_FUZZ_RPC_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "service/sequence_store.h"

namespace kvq::fuzz {

enum class Method : uint8_t {
  kGetServerInfo,
  kCreateSequence,
  kAppend,
  kFetchDequant,
  kAttend,
  kAppendAttend,
  kDecodeStream,
  kFork,
  kRelease,
  kStats,
};
inline constexpr int kNumMethods = 10;
// Bounds that keep one input's work small.
inline constexpr int kMaxCalls = 4;
inline constexpr int kMaxMessages = 8;

// "/kvq.v1.KvCache/Attend".
const char* MethodPath(Method m);
// Whether the client sends a stream (Append, DecodeStream).
bool ClientStreams(Method m);

struct Call {
  Method method = Method::kGetServerInfo;
  std::vector<std::string> messages;
};

std::vector<Call> DecodeCalls(const uint8_t* data, size_t size);
std::string EncodeCalls(const std::vector<Call>& calls);

// The sequences of the store when an input starts (namespace kNamespace):
// two GQA group sizes, a sink, the fp16 residual, pre_rope and outliers,
// and whole pages for raw fetches and appends.
struct BaseSequence {
  const char* id;
  int layers, kv_heads, q_heads, head_dim;
  const char* scheme;
  int tokens;
};
inline constexpr char kNamespace[] = "fuzz";
inline constexpr BaseSequence kBaseSequences[] = {
    {"kivi", 2, 2, 4, 32, "kivi2:g16:r16:sink=2", 66},
    {"fp16", 1, 1, 1, 16, "fp16", 5},
    {"k4", 2, 1, 2, 64, "kivi4:g32:r0:pre_rope:outliers=1", 64},
};

// Creates the base sequences in `store` and appends their tokens (seeded,
// the same every time).
absl::Status AddBaseSequences(SequenceStore* store);

}  // namespace kvq::fuzz

#endif  // KVQ_TESTS_FUZZ_RPC_INPUT_H_
