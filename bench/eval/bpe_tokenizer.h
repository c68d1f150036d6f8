// The byte-level BPE tokenizer of a GGUF "gpt2"-model vocabulary with the
// SmolLM pre-tokenizer (tokenizer.ggml.pre = "smollm"), as SmolLM2 uses it.
//
// Encoding matches the Hugging Face `tokenizers` library given the same vocab
// and merges and the pre-tokenizer of SmolLM2's tokenizer.json:
//   1. Digits(individual_digits): every numeric character (general category
//      Nd, Nl or No) becomes a piece of its own;
//   2. ByteLevel(add_prefix_space=false, use_regex=true): each remaining
//      stretch is split by the GPT-2 pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (\s is Unicode White_Space), and each piece's UTF-8 bytes are mapped to
//      GPT-2's printable byte alphabet ("Ġ" for a space);
//   3. BPE: adjacent symbols merge, lowest merge rank first (leftmost on a
//      tie), until no pair of the piece has a rank.
// tests/python/test_tokenizer_parity.py checks the ids against that library.
#ifndef KVQ_BENCH_EVAL_BPE_TOKENIZER_H_
#define KVQ_BENCH_EVAL_BPE_TOKENIZER_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "bench/eval/gguf_file.h"

namespace kvq::eval {

class BpeTokenizer {
 public:
  // Reads tokenizer.ggml.{model,pre,tokens,merges,token_type,bos_token_id,
  // eos_token_id} (token_type is optional). Errors, each naming the key:
  //   the GgufFile getter's status (NOT_FOUND, or INVALID_ARGUMENT for a
  //     wrong type) when a required key is absent or mistyped;
  //   UNIMPLEMENTED when tokenizer.ggml.model is not "gpt2" or
  //     tokenizer.ggml.pre is not "smollm" (other pre-tokenizers split text
  //     differently, and a silent mismatch would corrupt every evaluation);
  //   INVALID_ARGUMENT for an empty vocabulary, a malformed merge, a merge
  //     naming a token (or producing one) that is not in the vocabulary, or a
  //     token_type array whose length differs from the vocabulary's;
  //   OUT_OF_RANGE for a BOS/EOS id outside the vocabulary.
  static absl::StatusOr<BpeTokenizer> FromGguf(const GgufFile& file);

  // Token ids of plain text: no BOS is added, and strings such as
  // "<|im_start|>" are tokenized as ordinary text, never mapped to their
  // control tokens (look those up with TokenId()). Never fails: ill-formed
  // UTF-8 is kept byte for byte, each bad sequence pre-tokenized as one
  // symbol character (as U+FFFD would be). A byte whose symbol the vocabulary
  // lacks (CanEncodeByte() false) is dropped, as the reference drops it.
  std::vector<int32_t> Encode(absl::string_view text) const;

  // The bytes the ids stand for: Decode(Encode(s)) == s for every s whose
  // bytes all pass CanEncodeByte() (for SmolLM2: all text of assigned
  // characters but U+0004, U+0006, U+0013, U+0014, U+0016 and U+001D).
  // Control tokens decode to their text ("<|im_end|>"); ids outside the
  // vocabulary are skipped.
  std::string Decode(absl::Span<const int32_t> ids) const;

  // The token as the vocabulary spells it, e.g. "Ġthe" or "<|im_start|>";
  // empty for an id outside the vocabulary.
  std::string TokenText(int32_t id) const;

  // Id of the vocabulary entry spelled `text` (as TokenText() returns it);
  // NOT_FOUND naming it otherwise.
  absl::StatusOr<int32_t> TokenId(absl::string_view text) const;

  // Whether the vocabulary has the byte-level symbol of `byte`.
  bool CanEncodeByte(uint8_t byte) const { return byte_tokens_[byte] >= 0; }

  // Whether tokenizer.ggml.token_type marks `id` as a control token (3).
  bool IsControl(int32_t id) const;

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }

 private:
  // What a merge of an adjacent (left, right) pair yields.
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  struct EncodeScratch;

  BpeTokenizer() = default;

  // Appends the BPE ids of one pre-tokenized piece to `ids`.
  void EncodePiece(absl::string_view piece, EncodeScratch& scratch,
                   std::vector<int32_t>& ids) const;

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  std::vector<std::string> tokens_;
  // What each token decodes to (GPT-2 byte alphabet mapped back to bytes).
  std::vector<std::string> token_bytes_;
  std::vector<bool> is_control_;
  absl::flat_hash_map<std::string, int32_t> token_ids_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  // Token of each single byte: the symbols BPE starts from; -1 when the
  // vocabulary lacks it.
  std::array<int32_t, 256> byte_tokens_{};
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
};

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_BPE_TOKENIZER_H_
