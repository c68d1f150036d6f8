// BuildInfo: what a kvq binary is, for its --version: the project version,
// the git revision it was configured from, the kernel backends compiled in
// and the SIMD target Highway dispatches to on this machine.
#ifndef KVQ_KERNELS_BUILD_INFO_H_
#define KVQ_KERNELS_BUILD_INFO_H_

#include <string>

#include "absl/strings/string_view.h"

namespace kvq {

// The project's VERSION (CMakeLists.txt), e.g. "0.1.0".
absl::string_view KvqVersion();
// The git revision the build was configured from; "unknown" outside a
// checkout.
absl::string_view KvqGitRevision();

// The --version text of `program`:
//   kvq-server 0.1.0
//   git revision: 836c412abcde
//   backends: ref, cpu, cuda_host
//   SIMD target: AVX2
std::string VersionText(absl::string_view program);

// When an argument before any "--" is --version (or -version): prints
// VersionText(program) to stdout and returns true (the caller exits 0).
// Checked before the flags are parsed, so it works with any command or
// subcommand a binary needs otherwise.
bool PrintVersionIfAsked(int argc, char** argv, absl::string_view program);

}  // namespace kvq

#endif  // KVQ_KERNELS_BUILD_INFO_H_
