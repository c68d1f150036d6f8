#include "kernels/quoted.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace kvq {

std::string Quoted(absl::string_view input) {
  if (input.size() <= kQuotedPrefixBytes) return absl::StrCat("\"", absl::CHexEscape(input), "\"");
  return absl::StrCat("\"", absl::CHexEscape(input.substr(0, kQuotedPrefixBytes)), "...\" (",
                      input.size(), " bytes)");
}

}  // namespace kvq
