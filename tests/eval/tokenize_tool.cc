// kvq_tokenize_tool: tokenizes strings with the eval model's BpeTokenizer so
// that tests/python/test_tokenizer_parity.py can compare the ids with the
// Hugging Face `tokenizers` library.
//
// Reads the model from EvalModelPath(). Each stdin line is one string as
// hex-encoded bytes (an empty line is the empty string): hex keeps newlines,
// NULs and ill-formed UTF-8 out of any escaping rules. Prints one line per
// input: the ids separated by spaces, a tab, and Decode(ids) in hex.
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "bench/eval/bpe_tokenizer.h"
#include "bench/eval/eval_data.h"
#include "bench/eval/gguf_file.h"

int main() {
  using kvq::eval::BpeTokenizer;
  const std::string path = kvq::eval::EvalModelPath();
  auto file = kvq::eval::GgufFile::Open(path);
  if (!file.ok()) {
    std::cerr << "kvq_tokenize_tool: " << path << ": " << file.status()
              << " (run scripts/fetch_eval_data.sh)\n";
    return 1;
  }
  auto tokenizer = BpeTokenizer::FromGguf(**file);
  if (!tokenizer.ok()) {
    std::cerr << "kvq_tokenize_tool: " << path << ": " << tokenizer.status() << "\n";
    return 1;
  }
  std::string line;
  int64_t line_number = 0;
  while (std::getline(std::cin, line)) {
    ++line_number;
    absl::string_view hex = absl::StripAsciiWhitespace(line);
    bool is_hex = hex.size() % 2 == 0;
    for (char c : hex) is_hex = is_hex && absl::ascii_isxdigit(static_cast<unsigned char>(c));
    if (!is_hex) {
      std::cerr << "kvq_tokenize_tool: line " << line_number << " is not hex\n";
      return 1;
    }
    const std::string text = absl::HexStringToBytes(hex);
    const std::vector<int32_t> ids = tokenizer->Encode(text);
    std::cout << absl::StrJoin(ids, " ") << '\t'
              << absl::BytesToHexString(tokenizer->Decode(ids)) << '\n';
  }
  std::cout.flush();
  return std::cout.good() ? 0 : 1;
}
