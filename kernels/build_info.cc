#include "kernels/build_info.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cpu/simd_dispatch.h"

namespace kvq {

absl::string_view KvqVersion() { return KVQ_VERSION; }

absl::string_view KvqGitRevision() { return KVQ_GIT_REVISION; }

std::string VersionText(absl::string_view program) {
  return absl::StrCat(program, " ", KvqVersion(), "\ngit revision: ", KvqGitRevision(),
                      "\nbackends: ", CompiledBackendNames(),
                      "\nSIMD target: ", cpu::ActiveSimdTarget(), "\n");
}

bool PrintVersionIfAsked(int argc, char** argv, absl::string_view program) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") return false;
    if (arg == "--version" || arg == "-version") {
      std::fputs(VersionText(program).c_str(), stdout);
      std::fflush(stdout);
      return true;
    }
  }
  return false;
}

}  // namespace kvq
