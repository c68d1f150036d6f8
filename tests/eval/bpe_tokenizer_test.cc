#include "bench/eval/bpe_tokenizer.h"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/eval/eval_data.h"
#include "bench/eval/gguf_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvq::eval {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// The eval model's tokenizer, loaded once. Absent model: every test using it
// fails (not skips), since the real-model checks are the point of this file.
const BpeTokenizer* ModelTokenizer() {
  static const auto* const loaded = []() -> absl::StatusOr<BpeTokenizer>* {
    const std::string path = EvalModelPath();
    auto file = GgufFile::Open(path);
    if (!file.ok()) {
      return new absl::StatusOr<BpeTokenizer>(absl::Status(
          file.status().code(), absl::StrCat("cannot open the eval model ", path, " (",
                                             file.status().message(),
                                             "): run scripts/fetch_eval_data.sh")));
    }
    return new absl::StatusOr<BpeTokenizer>(BpeTokenizer::FromGguf(**file));
  }();
  EXPECT_TRUE(loaded->ok()) << loaded->status();
  return loaded->ok() ? &**loaded : nullptr;
}

#define KVQ_MODEL_TOKENIZER_OR_RETURN(tok)       \
  const BpeTokenizer* tok = ModelTokenizer();    \
  if (tok == nullptr) return

// Ids from the Hugging Face `tokenizers` library (0.23) built from the
// model's vocab and merges with SmolLM2's pre-tokenizer, as
// tests/python/test_tokenizer_parity.py builds it.
TEST(BpeTokenizerTest, KnownIds) {
  KVQ_MODEL_TOKENIZER_OR_RETURN(tok);
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"Hello, world!", {19556, 28, 905, 17}},
      {"The quick brown fox jumps over the lazy dog.",
       {504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30}},
      {"12345", {33, 34, 35, 36, 37}},
      {" 3.14", {216, 35, 30, 33, 36}},
      {"I'm sure they'll say it's fine, DON'T",
       {57, 5248, 2090, 502, 3060, 1643, 357, 506, 4979, 28, 422, 2154, 23, 68}},
      {"a    b\n\n\tc  ", {81, 333, 278, 1116, 197, 83, 256}},
      {"def foo(x):\n    return x ** 2\n",
       {1604, 29856, 24, 104, 727, 472, 1003, 1792, 1903, 216, 34, 198}},
      {"Привет, мир!", {155, 249, 46879, 16464, 32547, 28, 41337, 7872, 9175, 17}},
      {"你好，世界", {18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230}},
      {"naïve café", {3546, 46494, 37366}},
      {"Hello 👋🌍!", {19556, 15107, 235, 229, 10813, 230, 231, 17}},
      {"<|im_start|>user", {44, 108, 306, 79, 3738, 108, 46, 4093}},
      {"   ", {333}},
      {"", {}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_THAT(tok->Encode(text), ElementsAreArray(ids)) << "text: \"" << text << "\"";
  }
}

TEST(BpeTokenizerTest, Metadata) {
  KVQ_MODEL_TOKENIZER_OR_RETURN(tok);
  EXPECT_EQ(tok->vocab_size(), 49152);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->TokenText(1), "<|im_start|>");
  EXPECT_EQ(tok->TokenText(260), "Ġthe");
  EXPECT_EQ(tok->TokenText(-1), "");
  EXPECT_EQ(tok->TokenText(49152), "");
  EXPECT_EQ(tok->TokenId("<|im_end|>").value_or(-1), 2);
  EXPECT_EQ(tok->TokenId("no such token").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(tok->IsControl(1));
  EXPECT_FALSE(tok->IsControl(260));
  EXPECT_FALSE(tok->IsControl(-5));
}

TEST(BpeTokenizerTest, RoundTrip) {
  KVQ_MODEL_TOKENIZER_OR_RETURN(tok);
  const std::vector<std::string> texts = {
      "Hello, world!",
      "12345 and 3.14159 and 1,000,000",
      "Élève café naïve résumé façade Ångström; Straße",
      "Привет, мир! Καλημέρα κόσμε. مرحبا بالعالم. שלום. नमस्ते दुनिया.",
      "你好，世界！こんにちは世界。안녕하세요",
      "emoji 👋🌍 👨‍👩‍👧‍👦 👍🏽 🇫🇷 ❤️",
      "x² ½ Ⅻ ①②③ ١٢٣ १२३ １２３",
      "a    b",
      "trailing spaces   ",
      "   leading spaces",
      "\ttabs\t\tand\nnewlines\n\n\r\n",
      std::string(300, ' '),
      "\u00a0nbsp\u3000ideographic\u2028ls\u0085nel",
      "int main() {\n  for (int i = 0; i < 10; ++i) {\n    printf(\"%d\\n\", i);\n  }\n}\n",
      "def foo(x):\n    return x ** 2  \n",
      "<|im_start|>user\nHi<|im_end|>",
      std::string("nul\0byte", 8),
      "'s 't 're 've 'm 'll 'd DON'T",
  };
  for (const std::string& text : texts) {
    EXPECT_EQ(tok->Decode(tok->Encode(text)), text);
  }
}

// Ill-formed UTF-8 must not crash and, where the vocab has the byte symbols,
// must come back byte for byte.
TEST(BpeTokenizerTest, IllFormedUtf8RoundTrips) {
  KVQ_MODEL_TOKENIZER_OR_RETURN(tok);
  const std::vector<std::string> texts = {
      "\x80", "abc\x80\x81 def", "truncated \xE2\x82", "\xE2\x82", "at end \xC3",
      "surrogate \xED\xA0\x80 half", "overlong \xE0\x80\xAF", " \x9F 1\xBF" "2 ",
      "mixed \xE4\xBD\xA0\xE5 \xA5\xBD",
  };
  for (const std::string& text : texts) {
    std::string kept;
    for (char c : text) {
      if (tok->CanEncodeByte(static_cast<uint8_t>(c))) kept.push_back(c);
    }
    EXPECT_EQ(tok->Decode(tok->Encode(text)), kept);
  }
  // Bytes no UTF-8 text holds (0xFF, 0xC0) have no symbol in SmolLM2's vocab.
  EXPECT_FALSE(tok->CanEncodeByte(0xFF));
  EXPECT_FALSE(tok->CanEncodeByte(0xC0));
  EXPECT_THAT(tok->Encode("\xFF\xC0"), IsEmpty());
}

// The reference drops a byte whose symbol is missing before merging.
TEST(BpeTokenizerTest, DropsBytesWithoutSymbol) {
  KVQ_MODEL_TOKENIZER_OR_RETURN(tok);
  EXPECT_FALSE(tok->CanEncodeByte(0x04));
  EXPECT_TRUE(tok->CanEncodeByte('a'));
  EXPECT_THAT(tok->Encode("x\x04y"), ElementsAre(104, 105));
}

TEST(BpeTokenizerTest, DecodeSkipsIdsOutsideVocab) {
  KVQ_MODEL_TOKENIZER_OR_RETURN(tok);
  EXPECT_EQ(tok->Decode({19556, -1, 49152, 17}), "Hello!");
  EXPECT_EQ(tok->Decode({1, 4093, 2}), "<|im_start|>user<|im_end|>");
}

// ~1 MB of English-like text (word frequencies are skewed, as in real text,
// which the per-call piece cache relies on).
std::string EnglishLikeText(size_t bytes) {
  static const char* const kWords[] = {
      "the", "of", "and", "to", "a", "in", "that", "is", "was", "he", "for", "it", "with",
      "as", "his", "on", "be", "at", "by", "I", "had", "not", "are", "but", "from", "or",
      "have", "an", "they", "which", "one", "you", "were", "her", "all", "she", "there",
      "would", "their", "we", "him", "been", "has", "when", "who", "will", "more", "no",
      "if", "out", "so", "said", "what", "up", "its", "about", "into", "than", "them",
      "can", "only", "other", "new", "some", "could", "time", "these", "two", "may",
      "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man",
      "me", "even", "most", "made", "after", "also", "did", "many", "before", "must",
      "through", "back", "years", "where", "much", "your", "way", "well", "down",
      "should", "because", "each", "just", "those", "people", "Mr.", "how", "too",
      "little", "state", "good", "very", "make", "world", "still", "own", "see", "men",
      "work", "long", "get", "here", "between", "both", "life", "being", "under",
      "never", "day", "same", "another", "know", "while", "last", "might", "us",
      "great", "old", "year", "off", "come", "since", "against", "go", "came", "right",
      "used", "take", "three", "Elinor", "Marianne", "Dashwood", "Willoughby",
      "extraordinary", "nevertheless", "acquaintance", "consideration", "tokenizer",
      "quantization", "unquestionably", "circumstances", "don't", "it's", "they'll"};
  constexpr size_t kNumWords = sizeof(kWords) / sizeof(kWords[0]);
  std::string text;
  text.reserve(bytes + 64);
  uint64_t state = 88172645463325252ull;
  auto next = [&state]() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  size_t words_in_sentence = 0;
  while (text.size() < bytes) {
    // Zipf-like: the minimum of two uniform draws favours the first words.
    const size_t w = std::min(next() % kNumWords, next() % kNumWords);
    if (words_in_sentence == 0 && !text.empty()) text += (next() % 8 == 0) ? "\n\n" : " ";
    else if (words_in_sentence > 0) text += ' ';
    text += kWords[w];
    if (next() % 40 == 0) text += absl::StrCat(" ", next() % 2000);
    ++words_in_sentence;
    const uint64_t p = next() % 100;
    if (p < 6) text += ',';
    if (p >= 94 || words_in_sentence > 25) {
      text += (p % 3 == 0) ? "?" : ".";
      words_in_sentence = 0;
    }
  }
  return text;
}

TEST(BpeTokenizerTest, EncodesOneMegabyteQuickly) {
  KVQ_MODEL_TOKENIZER_OR_RETURN(tok);
  const std::string text = EnglishLikeText(1 << 20);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok->Encode(text);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("encoded %zu bytes into %zu tokens in %.3f s\n", text.size(), ids.size(), seconds);
  EXPECT_EQ(tok->Decode(ids), text);
#ifdef NDEBUG
  // The budget kvq-eval needs for its corpora; optimized builds only.
  EXPECT_LT(seconds, 2.0);
#endif
}

// --- FromGguf on small synthetic files. ---

// Writes a GGUF v3 file with metadata only.
class TinyGguf {
 public:
  TinyGguf& String(const std::string& key, const std::string& value) {
    Key(key, 8);
    Str(value);
    ++count_;
    return *this;
  }
  TinyGguf& U32(const std::string& key, uint32_t value) {
    Key(key, 4);
    Raw(value);
    ++count_;
    return *this;
  }
  TinyGguf& Strings(const std::string& key, const std::vector<std::string>& values) {
    Key(key, 9);
    Raw(uint32_t{8});
    Raw(uint64_t{values.size()});
    for (const std::string& v : values) Str(v);
    ++count_;
    return *this;
  }
  TinyGguf& I32s(const std::string& key, const std::vector<int32_t>& values) {
    Key(key, 9);
    Raw(uint32_t{5});
    Raw(uint64_t{values.size()});
    for (int32_t v : values) Raw(v);
    ++count_;
    return *this;
  }
  // Writes the file and opens it.
  std::unique_ptr<GgufFile> Open() {
    std::string file = "GGUF";
    AppendRaw(file, uint32_t{3});
    AppendRaw(file, uint64_t{0});  // Tensors.
    AppendRaw(file, count_);
    file += body_;
    file.resize((file.size() + 31) / 32 * 32, '\0');
    const std::string path = absl::StrCat(::testing::TempDir(), "/bpe_tokenizer_test_", getpid(),
                                          "_", serial_++, ".gguf");
    std::ofstream(path, std::ios::binary) << file;
    auto opened = GgufFile::Open(path);
    std::remove(path.c_str());
    EXPECT_TRUE(opened.ok()) << opened.status();
    return opened.ok() ? *std::move(opened) : nullptr;
  }

 private:
  template <typename T>
  static void AppendRaw(std::string& out, T value) {
    out.append(reinterpret_cast<const char*>(&value), sizeof(value));  // Little-endian hosts.
  }
  template <typename T>
  void Raw(T value) {
    AppendRaw(body_, value);
  }
  void Str(const std::string& s) {
    Raw(uint64_t{s.size()});
    body_ += s;
  }
  void Key(const std::string& key, uint32_t type) {
    Str(key);
    Raw(type);
  }

  std::string body_;
  uint64_t count_ = 0;
  static inline int serial_ = 0;
};

// GPT-2's symbol for each byte.
std::string ByteSymbol(int b) {
  const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  int cp = b;
  if (!printable) {
    int extra = 0;
    for (int i = 0; i < b; ++i) {
      extra += !((i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE);
    }
    cp = 0x100 + extra;
  }
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

// Ids 0..255: the byte symbols; then the tokens `merges` make; then one
// control token, the BOS and EOS unless `bos` is given. The file lists
// `file_merges` when given, else `merges`.
TinyGguf TinyTokenizerFile(const std::vector<std::string>& merges,
                           const std::vector<std::string>* file_merges = nullptr,
                           int64_t bos = -1) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(ByteSymbol(b));
  for (const std::string& m : merges) {
    const size_t space = m.find(' ');
    tokens.push_back(m.substr(0, space) + m.substr(space + 1));
  }
  tokens.push_back("<|x|>");
  std::vector<int32_t> types(tokens.size(), 1);
  types.back() = 3;
  const uint32_t control = static_cast<uint32_t>(tokens.size() - 1);
  TinyGguf gguf;
  gguf.String("tokenizer.ggml.model", "gpt2")
      .String("tokenizer.ggml.pre", "smollm")
      .Strings("tokenizer.ggml.tokens", tokens)
      .Strings("tokenizer.ggml.merges", file_merges != nullptr ? *file_merges : merges)
      .I32s("tokenizer.ggml.token_type", types)
      .U32("tokenizer.ggml.bos_token_id", bos >= 0 ? static_cast<uint32_t>(bos) : control)
      .U32("tokenizer.ggml.eos_token_id", control);
  return gguf;
}

TEST(BpeTokenizerTest, MergesByRankThenLeftmost) {
  // Ranks: "b c" < "a b" < "a a" < "aa aa"; ids 256.. in that order.
  auto file = TinyTokenizerFile({"b c", "a b", "a a", "aa aa"}).Open();
  ASSERT_NE(file, nullptr);
  auto tok = BpeTokenizer::FromGguf(*file);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(tok->vocab_size(), 261);
  EXPECT_EQ(tok->bos_id(), 260);
  EXPECT_TRUE(tok->IsControl(260));
  // "b c" outranks "a b", so "abc" is a + bc, not ab + c.
  EXPECT_THAT(tok->Encode("abc"), ElementsAre('a', 256));
  // Ties go to the leftmost pair.
  EXPECT_THAT(tok->Encode("aaa"), ElementsAre(258, 'a'));
  EXPECT_THAT(tok->Encode("aaaa"), ElementsAre(259));
  EXPECT_THAT(tok->Encode("aaaaa"), ElementsAre(259, 'a'));
  EXPECT_EQ(tok->Decode(tok->Encode("aaaaa bc")), "aaaaa bc");
}

TEST(BpeTokenizerTest, RejectsUnsupportedModelAndPreTokenizer) {
  TinyGguf llama;
  llama.String("tokenizer.ggml.model", "llama");
  auto file = llama.Open();
  ASSERT_NE(file, nullptr);
  absl::Status st = BpeTokenizer::FromGguf(*file).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(st.message(), HasSubstr("tokenizer.ggml.model"));
  EXPECT_THAT(st.message(), HasSubstr("llama"));

  TinyGguf llama3;
  llama3.String("tokenizer.ggml.model", "gpt2").String("tokenizer.ggml.pre", "llama-bpe");
  file = llama3.Open();
  ASSERT_NE(file, nullptr);
  st = BpeTokenizer::FromGguf(*file).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(st.message(), HasSubstr("tokenizer.ggml.pre"));
  EXPECT_THAT(st.message(), HasSubstr("llama-bpe"));
}

TEST(BpeTokenizerTest, RejectsMissingKeys) {
  TinyGguf empty;
  empty.String("general.name", "nothing");
  auto file = empty.Open();
  ASSERT_NE(file, nullptr);
  absl::Status st = BpeTokenizer::FromGguf(*file).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("tokenizer.ggml.model"));

  TinyGguf no_tokens;
  no_tokens.String("tokenizer.ggml.model", "gpt2").String("tokenizer.ggml.pre", "smollm");
  file = no_tokens.Open();
  ASSERT_NE(file, nullptr);
  st = BpeTokenizer::FromGguf(*file).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("tokenizer.ggml.tokens"));
}

TEST(BpeTokenizerTest, RejectsBadMergesAndIds) {
  for (const std::vector<std::string>& bad : std::vector<std::vector<std::string>>{
           {"a b", "ab"}, {"a b", "a  b"}, {"a b", "a q"}, {"a b", "b a"}}) {
    // "ab": no space; "a  b": an empty side; "a q": "aq" is not a token;
    // "b a": "ba" is not a token.
    auto file = TinyTokenizerFile({"a b"}, &bad).Open();
    ASSERT_NE(file, nullptr);
    const absl::Status st = BpeTokenizer::FromGguf(*file).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad.back();
    EXPECT_THAT(st.message(), HasSubstr("tokenizer.ggml.merges[1]"));
  }

  auto file = TinyTokenizerFile({"a b"}, nullptr, /*bos=*/258).Open();
  ASSERT_NE(file, nullptr);
  const absl::Status st = BpeTokenizer::FromGguf(*file).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(st.message(), HasSubstr("tokenizer.ggml.bos_token_id"));
}

}  // namespace
}  // namespace kvq::eval
