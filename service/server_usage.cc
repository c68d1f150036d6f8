#include "service/server_usage.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvq {
namespace {

struct FlagGroup {
  const char* title;
  std::vector<const char*> flags;
};

const std::vector<FlagGroup>& Groups() {
  static const auto* groups = new std::vector<FlagGroup>{
      {"Listening", {"address", "port_file", "metrics_address", "shutdown_grace_seconds"}},
      {"Backend and pool",
       {"backend", "capacity_bytes", "capacity_fraction", "slab_bytes", "pool_huge_pages", "evict",
        "verify_fraction", "retain_message_buffers", "device_capacity_bytes",
        "device_capacity_fraction", "device_page_bytes"}},
      {"Security",
       {"tls_cert", "tls_key", "tls_client_ca", "tls_refresh_seconds", "metrics_tls_cert",
        "metrics_tls_key", "insecure", "tokens_file", "tokens_reload_ms"}},
      {"Limits",
       {"default_ttl_seconds", "max_ttl_seconds", "max_sequences", "max_message_bytes",
        "fetch_chunk_bytes"}},
      {"Calibrations", {"calibration_dir", "calibration_reload_seconds"}},
  };
  return *groups;
}

void AppendFlag(const absl::CommandLineFlag& flag, std::string* out) {
  absl::StrAppend(out, "  --", flag.Name(),
                  " (default: ", flag.DefaultValue().empty() ? "\"\"" : flag.DefaultValue(),
                  ")\n      ", flag.Help(), "\n");
}

}  // namespace

std::string ServerUsage() {
  std::string out =
      "kvq-server: a quantized KV-cache service over gRPC.\n"
      "Usage: kvq-server [--flag=value ...]\n";
  std::set<std::string> listed;
  for (const FlagGroup& g : Groups()) {
    absl::StrAppend(&out, "\n", g.title, ":\n");
    for (const char* name : g.flags) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag == nullptr) continue;
      AppendFlag(*flag, &out);
      listed.insert(name);
    }
  }
  std::vector<const absl::CommandLineFlag*> others;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "server_config.cc") &&
        !listed.contains(std::string(name))) {
      others.push_back(flag);
    }
  }
  if (!others.empty()) {
    std::sort(others.begin(), others.end(),
              [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
    absl::StrAppend(&out, "\nOther:\n");
    for (const absl::CommandLineFlag* flag : others) AppendFlag(*flag, &out);
  }
  absl::StrAppend(&out,
                  "\n--version prints the version, git revision, backends and SIMD target;\n"
                  "--helpfull lists every flag, the libraries' included.\n");
  return out;
}

bool IsHelpArg(const char* arg) {
  const absl::string_view a(arg);
  return a == "--help" || a == "-help" || a == "-h";
}

}  // namespace kvq
