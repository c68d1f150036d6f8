#include "bench/eval/bpe_tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/status_macros.h"
#include "unicode/uchar.h"
#include "unicode/utf8.h"

namespace kvq::eval {
namespace {

constexpr char kModelKey[] = "tokenizer.ggml.model";
constexpr char kPreKey[] = "tokenizer.ggml.pre";
constexpr char kTokensKey[] = "tokenizer.ggml.tokens";
constexpr char kMergesKey[] = "tokenizer.ggml.merges";
constexpr char kTokenTypeKey[] = "tokenizer.ggml.token_type";
constexpr char kBosKey[] = "tokenizer.ggml.bos_token_id";
constexpr char kEosKey[] = "tokenizer.ggml.eos_token_id";
constexpr int64_t kControlTokenType = 3;

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves,
// the other 68 bytes (controls, space, DEL, NBSP, soft hyphen) for U+0100
// onwards in byte order, so that every token is printable text.
std::array<UChar32, 256> ByteToCodePoint() {
  std::array<UChar32, 256> map{};
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) ||
                           (b >= 0xAE && b <= 0xFF);
    map[b] = printable ? b : 0x100 + next++;
  }
  return map;
}

void AppendUtf8(UChar32 c, std::string& out) {
  char buf[U8_MAX_LENGTH];
  int32_t len = 0;
  U8_APPEND_UNSAFE(buf, len, c);  // Only called with valid code points.
  out.append(buf, len);
}

// The pre-tokenizer's view of one character.
enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

struct CodePointRange {
  UChar32 first;
  UChar32 last;
};

// The reference (Hugging Face `tokenizers`, whose regex engine is Oniguruma)
// classifies by Unicode 16, the ICU this builds against may be older
// (ICU 72: Unicode 15). These are the Unicode 16 letters and numbers such an
// ICU reports as unassigned; they are consulted only for unassigned code
// points, so a newer ICU makes them moot.
constexpr CodePointRange kLettersSinceUnicode15[] = {
    {0x1C89, 0x1C8A},   {0xA7CB, 0xA7CD},   {0xA7DA, 0xA7DC},
    {0x105C0, 0x105F3}, {0x10D4A, 0x10D65}, {0x10D6F, 0x10D85},
    {0x10EC2, 0x10EC4}, {0x11380, 0x11389}, {0x1138B, 0x1138B},
    {0x1138E, 0x1138E}, {0x11390, 0x113B5}, {0x113B7, 0x113B7},
    {0x113D1, 0x113D1}, {0x113D3, 0x113D3}, {0x11BC0, 0x11BE0},
    {0x13460, 0x143FA}, {0x16100, 0x1611D}, {0x16D40, 0x16D6C},
    {0x18CFF, 0x18CFF}, {0x1E5D0, 0x1E5ED}, {0x1E5F0, 0x1E5F0},
    {0x2EBF0, 0x2EE5D},
};
constexpr CodePointRange kNumbersSinceUnicode15[] = {
    {0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9},
    {0x16130, 0x16139}, {0x16D70, 0x16D79}, {0x1CCF0, 0x1CCF9},
    {0x1E5F1, 0x1E5FA},
};
// The digit splitter is Rust's char::is_numeric, whose tables are newer still
// (Unicode 17): these are numeric to it but not \p{N} to the regex.
constexpr CodePointRange kSplitOnlyNumbers[] = {
    {0x11DE0, 0x11DE9},
    {0x16FF4, 0x16FF6},
};

template <size_t N>
bool InRanges(const CodePointRange (&ranges)[N], UChar32 c) {
  for (const CodePointRange& r : ranges) {
    if (c >= r.first && c <= r.last) return true;
  }
  return false;
}

struct CharInfo {
  size_t offset;    // Of the first byte in the text.
  UChar32 c;        // Negative for an ill-formed sequence.
  CharClass cls;
  bool split_digit;  // The digit splitter isolates it.
};

CharInfo Classify(UChar32 c) {
  CharInfo info{0, c, CharClass::kOther, false};
  if (c < 0) return info;  // Ill-formed UTF-8: a symbol, as U+FFFD would be.
  if (c < 0x80) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      info.cls = CharClass::kLetter;
    } else if (c >= '0' && c <= '9') {
      info.cls = CharClass::kNumber;
      info.split_digit = true;
    } else if (c == ' ' || (c >= 0x09 && c <= 0x0D)) {
      info.cls = CharClass::kSpace;
    }
    return info;
  }
  // \s in the reference is the White_Space property (U+0085, U+00A0, U+2028,
  // ... but not the U+001C..U+001F separators).
  if (u_isUWhiteSpace(c)) {
    info.cls = CharClass::kSpace;
    return info;
  }
  switch (u_charType(c)) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      info.cls = CharClass::kLetter;
      break;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      info.cls = CharClass::kNumber;
      info.split_digit = true;
      break;
    case U_UNASSIGNED:
      if (InRanges(kLettersSinceUnicode15, c)) {
        info.cls = CharClass::kLetter;
      } else if (InRanges(kNumbersSinceUnicode15, c)) {
        info.cls = CharClass::kNumber;
        info.split_digit = true;
      } else if (InRanges(kSplitOnlyNumbers, c)) {
        info.split_digit = true;
      }
      break;
    default:
      break;
  }
  return info;
}

// Decodes `text` into `chars`, followed by a sentinel whose offset is
// text.size().
void DecodeChars(absl::string_view text, std::vector<CharInfo>& chars) {
  chars.clear();
  chars.reserve(text.size() + 1);
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const int64_t length = static_cast<int64_t>(text.size());
  int64_t i = 0;
  while (i < length) {
    const int64_t start = i;
    UChar32 c;
    // Ill-formed sequences come back as c < 0, consuming their maximal
    // valid prefix (at least one byte).
    U8_NEXT(s, i, length, c);
    CharInfo info = Classify(c);
    info.offset = static_cast<size_t>(start);
    chars.push_back(info);
  }
  chars.push_back(CharInfo{text.size(), 0, CharClass::kOther, false});
}

// End (char index) of the GPT-2 pattern's match at chars[p], p < end; `end`
// bounds the stretch between isolated digits, which the pattern sees as the
// end of its input.
size_t MatchGpt2(const std::vector<CharInfo>& chars, size_t p, size_t end) {
  const CharInfo& first = chars[p];
  // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive).
  if (first.c == '\'' && p + 1 < end) {
    const UChar32 a = chars[p + 1].c;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return p + 2;
    if (p + 2 < end) {
      const UChar32 b = chars[p + 2].c;
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        return p + 3;
      }
    }
  }
  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: a run of one class,
  // optionally led by one space.
  size_t run = p;
  if (first.c == ' ' && p + 1 < end && chars[p + 1].cls != CharClass::kSpace) {
    run = p + 1;
  }
  const CharClass cls = chars[run].cls;
  if (cls != CharClass::kSpace) {
    size_t q = run + 1;
    while (q < end && chars[q].cls == cls) ++q;
    return q;
  }
  // `\s+(?!\S)|\s+`: a whitespace run, less its last character when a
  // non-space follows and that leaves at least one (the last one then leads
  // the next piece, e.g. " the").
  size_t q = p + 1;
  while (q < end && chars[q].cls == CharClass::kSpace) ++q;
  if (q < end && q - p >= 2) return q - 1;
  return q;
}

}  // namespace

struct BpeTokenizer::EncodeScratch {
  struct Symbol {
    int32_t id;
    int32_t prev;  // -1: none.
    int32_t next;  // -1: none.
    bool merged_away;
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t id;
    // std::priority_queue pops the largest: make that the lowest rank, then
    // the leftmost position, the order the reference merges in.
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
};

absl::StatusOr<BpeTokenizer> BpeTokenizer::FromGguf(const GgufFile& file) {
  auto with_key = [](const absl::Status& s, absl::string_view key) {
    return absl::Status(s.code(), absl::StrCat("tokenizer: ", key, ": ", s.message()));
  };
  auto model = file.GetString(kModelKey);
  if (!model.ok()) return with_key(model.status(), kModelKey);
  if (*model != "gpt2") {
    return absl::UnimplementedError(absl::StrCat(
        "tokenizer: ", kModelKey, " = \"", *model, "\" is not supported (only \"gpt2\")"));
  }
  auto pre = file.GetString(kPreKey);
  if (!pre.ok()) return with_key(pre.status(), kPreKey);
  if (*pre != "smollm") {
    return absl::UnimplementedError(absl::StrCat(
        "tokenizer: ", kPreKey, " = \"", *pre, "\" is not supported (only \"smollm\")"));
  }

  BpeTokenizer tok;
  auto tokens = file.GetStringArray(kTokensKey);
  if (!tokens.ok()) return with_key(tokens.status(), kTokensKey);
  tok.tokens_ = *std::move(tokens);
  const int64_t n = static_cast<int64_t>(tok.tokens_.size());
  if (n == 0 || n > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer: ", kTokensKey, " has ", n, " tokens, want 1..", INT32_MAX));
  }
  tok.token_ids_.reserve(n);
  // A duplicate spelling maps to its last id, as a Python dict built from the
  // list would.
  for (int32_t id = 0; id < n; ++id) tok.token_ids_[tok.tokens_[id]] = id;

  tok.is_control_.assign(n, false);
  if (file.Has(kTokenTypeKey)) {
    auto types = file.GetIntArray(kTokenTypeKey);
    if (!types.ok()) return with_key(types.status(), kTokenTypeKey);
    if (static_cast<int64_t>(types->size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer: ", kTokenTypeKey, " has ",
                                                     types->size(), " entries, ", kTokensKey,
                                                     " has ", n));
    }
    for (int64_t i = 0; i < n; ++i) tok.is_control_[i] = (*types)[i] == kControlTokenType;
  }

  // Byte alphabet: the token of every byte, and each token's bytes. A vocab
  // may lack some byte symbols (SmolLM2 lacks 21: six rare C0 controls such
  // as U+0004, and 0xC0, 0xC1, 0xF1, 0xF2, 0xF5..0xFF, which UTF-8 text of
  // assigned characters never holds); those bytes are dropped when encoding,
  // as the reference does.
  const std::array<UChar32, 256> byte_cp = ByteToCodePoint();
  absl::flat_hash_map<UChar32, uint8_t> cp_byte;
  for (int b = 0; b < 256; ++b) {
    cp_byte[byte_cp[b]] = static_cast<uint8_t>(b);
    std::string symbol;
    AppendUtf8(byte_cp[b], symbol);
    auto it = tok.token_ids_.find(symbol);
    tok.byte_tokens_[b] = it == tok.token_ids_.end() ? -1 : it->second;
  }
  tok.token_bytes_.resize(n);
  for (int64_t id = 0; id < n; ++id) {
    // A token outside the byte alphabet (none in SmolLM2) decodes to its own
    // UTF-8, as the reference's ByteLevel decoder does.
    const std::string& text = tok.tokens_[id];
    std::string bytes;
    bool all_mapped = true;
    const auto* s = reinterpret_cast<const uint8_t*>(text.data());
    const int64_t len = static_cast<int64_t>(text.size());
    for (int64_t i = 0; i < len && all_mapped;) {
      UChar32 c;
      U8_NEXT(s, i, len, c);
      auto it = c < 0 ? cp_byte.end() : cp_byte.find(c);
      if (it == cp_byte.end()) {
        all_mapped = false;
      } else {
        bytes.push_back(static_cast<char>(it->second));
      }
    }
    tok.token_bytes_[id] = all_mapped ? std::move(bytes) : text;
  }

  auto merges = file.GetStringArray(kMergesKey);
  if (!merges.ok()) return with_key(merges.status(), kMergesKey);
  if (merges->size() > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: ", kMergesKey, " has ", merges->size(), " entries"));
  }
  tok.merges_.reserve(merges->size());
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const std::string& merge = (*merges)[rank];
    std::vector<absl::string_view> parts = absl::StrSplit(merge, ' ');
    if (parts.size() != 2 || parts[0].empty() || parts[1].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer: ", kMergesKey, "[", rank,
                                                     "] = \"", merge, "\" is not \"left right\""));
    }
    auto left = tok.token_ids_.find(parts[0]);
    auto right = tok.token_ids_.find(parts[1]);
    auto merged = tok.token_ids_.find(absl::StrCat(parts[0], parts[1]));
    if (left == tok.token_ids_.end() || right == tok.token_ids_.end() ||
        merged == tok.token_ids_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer: ", kMergesKey, "[", rank, "] = \"", merge,
                       "\" names or makes a token not in ", kTokensKey));
    }
    // A repeated pair keeps its last rank, as the reference's map does.
    tok.merges_[PairKey(left->second, right->second)] =
        Merge{static_cast<int32_t>(rank), merged->second};
  }

  for (auto [key, out] : {std::pair{kBosKey, &tok.bos_id_}, std::pair{kEosKey, &tok.eos_id_}}) {
    auto id = file.GetInt(key);
    if (!id.ok()) return with_key(id.status(), key);
    if (*id < 0 || *id >= n) {
      return absl::OutOfRangeError(
          absl::StrCat("tokenizer: ", key, " = ", *id, " is outside the vocabulary [0, ", n, ")"));
    }
    *out = static_cast<int32_t>(*id);
  }
  return tok;
}

void BpeTokenizer::EncodePiece(absl::string_view piece, EncodeScratch& scratch,
                               std::vector<int32_t>& ids) const {
  using Symbol = EncodeScratch::Symbol;
  using Candidate = EncodeScratch::Candidate;
  auto& symbols = scratch.symbols;
  symbols.clear();
  // Bytes without a symbol are left out before merging, so their neighbours
  // may merge across the gap (as in the reference).
  for (char byte : piece) {
    const int32_t id = byte_tokens_[static_cast<uint8_t>(byte)];
    if (id < 0) continue;
    const int32_t at = static_cast<int32_t>(symbols.size());
    if (at > 0) symbols.back().next = at;
    symbols.push_back(Symbol{id, at - 1, -1, false});
  }
  const int32_t n = static_cast<int32_t>(symbols.size());
  auto& heap = scratch.heap;
  heap.clear();
  auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    auto it = merges_.find(PairKey(symbols[pos].id, symbols[next].id));
    if (it != merges_.end()) {
      heap.push_back(Candidate{it->second.rank, pos, it->second.id});
      std::push_heap(heap.begin(), heap.end());
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);

  // A heap of candidate merges rather than rescanning the piece each round:
  // long pieces (a run of spaces, a base64 blob) stay O(n log n). Candidates
  // go stale as neighbours merge; a popped one is applied only if its pair
  // still yields the same token.
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (left.merged_away || left.next < 0) continue;
    const int32_t right_pos = left.next;
    auto it = merges_.find(PairKey(left.id, symbols[right_pos].id));
    if (it == merges_.end() || it->second.id != top.id) continue;
    left.id = top.id;
    left.next = symbols[right_pos].next;
    symbols[right_pos].merged_away = true;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    if (left.next >= 0) push_pair(top.pos);
  }
  for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

std::vector<int32_t> BpeTokenizer::Encode(absl::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 16);
  std::vector<CharInfo> chars;
  DecodeChars(text, chars);
  EncodeScratch scratch;
  // Ids of pieces already encoded in this call, as their [begin, end) in
  // `ids`. Text is Zipfian, so most pieces repeat; a cache scoped to the call
  // keeps Encode() const and thread-safe without a lock.
  absl::flat_hash_map<absl::string_view, std::pair<size_t, size_t>> cache;

  auto emit = [&](size_t first_char, size_t end_char) {
    const absl::string_view piece =
        text.substr(chars[first_char].offset, chars[end_char].offset - chars[first_char].offset);
    auto [it, inserted] = cache.try_emplace(piece);
    if (!inserted) {
      const auto [begin, end] = it->second;
      const size_t at = ids.size();
      ids.resize(at + (end - begin));
      std::copy(ids.begin() + begin, ids.begin() + end, ids.begin() + at);
      return;
    }
    const size_t begin = ids.size();
    EncodePiece(piece, scratch, ids);
    it->second = {begin, ids.size()};
  };

  const size_t count = chars.size() - 1;  // Less the sentinel.
  size_t p = 0;
  while (p < count) {
    if (chars[p].split_digit) {
      emit(p, p + 1);
      ++p;
      continue;
    }
    size_t end = p + 1;
    while (end < count && !chars[end].split_digit) ++end;
    while (p < end) {
      const size_t q = MatchGpt2(chars, p, end);
      emit(p, q);
      p = q;
    }
  }
  return ids;
}

std::string BpeTokenizer::Decode(absl::Span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && id < vocab_size()) out += token_bytes_[id];
  }
  return out;
}

std::string BpeTokenizer::TokenText(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return "";
  return tokens_[id];
}

absl::StatusOr<int32_t> BpeTokenizer::TokenId(absl::string_view text) const {
  auto it = token_ids_.find(text);
  if (it == token_ids_.end()) {
    return absl::NotFoundError(absl::StrCat("tokenizer: no token \"", text, "\""));
  }
  return it->second;
}

bool BpeTokenizer::IsControl(int32_t id) const {
  return id >= 0 && id < vocab_size() && is_control_[id];
}

}  // namespace kvq::eval
