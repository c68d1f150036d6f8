// Attributable K/V: every appended token's fp16 rows are a function of the
// append operation's id, the token's index within it and the KV head, so
// any token a read returns names the operation that wrote it, and its bytes
// can be checked exactly (the fp16 scheme stores fp16 input bit-exactly).
#ifndef KVQ_TESTS_INTEGRATION_HISTORY_PAYLOAD_H_
#define KVQ_TESTS_INTEGRATION_HISTORY_PAYLOAD_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvq/v1/kvq.pb.h"

namespace kvq::history {

// The model every checked sequence has: one layer (an AppendAttend step
// then appends to the whole sequence), GQA group 2, the smallest head_dim.
inline constexpr int kLayers = 1;
inline constexpr int kKvHeads = 2;
inline constexpr int kQHeads = 4;
inline constexpr int kHeadDim = 16;
// Elements 0..kTagDims-1 of a key row carry the tag; queries are zero there
// so that the tags never enter the attention logits.
inline constexpr int kTagDims = 4;
inline constexpr int64_t kMaxOpId = (int64_t{1} << 22) - 1;
inline constexpr int kMaxTokensPerOp = 2047;

v1::ModelLayout Layout();

// Token `index` of the append whose id is `op`.
struct TokenRef {
  int64_t op = 0;
  int index = 0;
  friend bool operator==(const TokenRef&, const TokenRef&) = default;
};

// fp16 bit patterns of the K and V rows of (op, index, head).
std::vector<uint16_t> KeyRow(int64_t op, int index, int head);
std::vector<uint16_t> ValueRow(int64_t op, int index, int head);

// The K and V tensors [layers = 1, kv_heads, tokens, head_dim] (fp16) of
// tokens [first, first + tokens) of append `op`.
void FillChunk(int64_t op, int first, int tokens, v1::KvChunk* chunk);
// [kv_heads, tokens = 1, head_dim] K and V of the single token of `op`
// (an AppendAttend item or DecodeStream step).
void FillStep(int64_t op, v1::Tensor* k, v1::Tensor* v);

// The tokens of one fetched layer ([kv_heads, tokens, head_dim] fp16 K and
// V), each attributed by its tag and checked bit for bit against the rows
// it names; nullopt for a token whose bytes are not exactly the rows of any
// append (corruption or a foreign writer).
std::vector<std::optional<TokenRef>> Attribute(const v1::Tensor& k, const v1::Tensor& v);

// A query [1, q_heads, head_dim] (fp32, zero on the tag dims), a function of
// `seed`.
std::vector<float> Query(uint64_t seed);

}  // namespace kvq::history

#endif  // KVQ_TESTS_INTEGRATION_HISTORY_PAYLOAD_H_
