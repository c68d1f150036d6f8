#include "service/tokens_file.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvq {
namespace {

constexpr int kMaxNameChars = 64;
constexpr int kMinTokenChars = 16;
constexpr int kMaxTokenChars = 512;

bool IsNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
}

absl::Status LineError(int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokens file line ", line, ": ", what));
}

absl::StatusOr<TenantSpec> ParseLine(int line, absl::string_view text) {
  absl::flat_hash_map<std::string, std::string> fields;
  for (absl::string_view part : absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
    const size_t eq = part.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      return LineError(line, absl::StrCat("\"", part.substr(0, 32), "\" is not key=value"));
    }
    const std::string key(part.substr(0, eq));
    if (key != "tenant" && key != "token" && key != "quota_bytes" && key != "rate_rps" &&
        key != "burst") {
      return LineError(line, absl::StrCat("unknown key \"", key.substr(0, 32),
                                          "\" (known: tenant, token, quota_bytes, rate_rps, "
                                          "burst)"));
    }
    if (!fields.emplace(key, part.substr(eq + 1)).second) {
      return LineError(line, absl::StrCat(key, " is given twice"));
    }
  }
  TenantSpec spec;
  auto it = fields.find("tenant");
  if (it == fields.end()) return LineError(line, "tenant is missing");
  spec.name = it->second;
  if (spec.name.empty() || spec.name.size() > kMaxNameChars) {
    return LineError(line, absl::StrCat("tenant must have 1 to ", kMaxNameChars,
                                        " characters, got ", spec.name.size()));
  }
  for (char c : spec.name) {
    if (!IsNameChar(c)) return LineError(line, "tenant may hold only letters, digits and - _ .");
  }
  it = fields.find("token");
  if (it == fields.end()) return LineError(line, "token is missing");
  spec.token = it->second;
  if (spec.token.size() < kMinTokenChars || spec.token.size() > kMaxTokenChars) {
    // Never echo the token itself.
    return LineError(line, absl::StrCat("token must have ", kMinTokenChars, " to ", kMaxTokenChars,
                                        " characters, got ", spec.token.size()));
  }
  for (char c : spec.token) {
    if (c < 0x21 || c > 0x7e) return LineError(line, "token may hold only printable ASCII");
  }
  if ((it = fields.find("quota_bytes")) != fields.end()) {
    if (!absl::SimpleAtoi(it->second, &spec.quota_bytes) || spec.quota_bytes < 0) {
      return LineError(line, absl::StrCat("quota_bytes = \"", it->second.substr(0, 32),
                                          "\" is not an integer >= 0"));
    }
  }
  if ((it = fields.find("rate_rps")) != fields.end()) {
    if (!absl::SimpleAtod(it->second, &spec.rate_rps) || !std::isfinite(spec.rate_rps) ||
        spec.rate_rps < 0) {
      return LineError(line, absl::StrCat("rate_rps = \"", it->second.substr(0, 32),
                                          "\" is not a finite number >= 0"));
    }
  }
  if ((it = fields.find("burst")) != fields.end()) {
    if (spec.rate_rps == 0) return LineError(line, "burst needs rate_rps > 0");
    if (!absl::SimpleAtod(it->second, &spec.burst) || !std::isfinite(spec.burst) ||
        spec.burst < 1) {
      return LineError(line, absl::StrCat("burst = \"", it->second.substr(0, 32),
                                          "\" is not a finite number >= 1"));
    }
  } else if (spec.rate_rps > 0) {
    spec.burst = std::max(1.0, spec.rate_rps);
  }
  return spec;
}

}  // namespace

absl::StatusOr<std::vector<TenantSpec>> ParseTokensFile(absl::string_view text) {
  std::vector<TenantSpec> out;
  absl::flat_hash_set<std::string> names, tokens;
  int line = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line;
    absl::string_view l = absl::StripAsciiWhitespace(raw);
    if (l.empty() || l.front() == '#') continue;
    absl::StatusOr<TenantSpec> spec = ParseLine(line, l);
    if (!spec.ok()) return spec.status();
    if (!names.insert(spec->name).second) {
      return LineError(line, absl::StrCat("tenant \"", spec->name, "\" is given twice"));
    }
    if (!tokens.insert(spec->token).second) {
      return LineError(line, "token is the same as another tenant's");
    }
    out.push_back(std::move(*spec));
  }
  return out;
}

absl::StatusOr<std::vector<TenantSpec>> ReadTokensFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string what = absl::StrCat("tokens file ", path, ": ", std::strerror(err));
    return err == EACCES ? absl::PermissionDeniedError(what) : absl::NotFoundError(what);
  }
  std::ostringstream text;
  text << in.rdbuf();
  return ParseTokensFile(text.str());
}

}  // namespace kvq
