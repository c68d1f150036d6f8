#include "kernels/cpu/simd_dispatch.h"

// HWY_TARGETS (the compiled set) must match the kernels' translation units.
#include "kernels/cpu/simd_targets.h"

#include <cstdint>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "hwy/targets.h"

namespace kvq {
namespace cpu {
namespace {

// Compiled targets the CPU supports now (a pin leaves only itself).
std::vector<int64_t> SupportedCompiled() {
  std::vector<int64_t> out;
  const int64_t mask = hwy::SupportedTargets() & HWY_TARGETS;
  // Highway's bits: a lower bit is a better target.
  for (int64_t t = mask; t != 0; t &= t - 1) out.push_back(t & ~(t - 1));
  return out;
}

// The same before any pin: read once, on the first call, which every pin
// goes through (this file is the only one that pins).
const std::vector<int64_t>& Unpinned() {
  static const std::vector<int64_t> all = SupportedCompiled();
  return all;
}

}  // namespace

std::vector<std::string> AvailableSimdTargets() {
  std::vector<std::string> names;
  for (int64_t t : Unpinned()) names.push_back(hwy::TargetName(t));
  return names;
}

std::string ActiveSimdTarget() {
  const std::vector<int64_t> active = SupportedCompiled();
  return active.empty() ? "none" : hwy::TargetName(active.front());
}

absl::Status PinSimdTarget(absl::string_view name) {
  const std::string want = absl::AsciiStrToUpper(name);
  if (want.empty() || want == "BEST") {
    hwy::SetSupportedTargetsForTest(0);
    return absl::OkStatus();
  }
  for (int64_t t : Unpinned()) {
    if (want == hwy::TargetName(t)) {
      hwy::SetSupportedTargetsForTest(t);
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("SIMD target \"", name, "\" is not available here; available: ",
                   absl::StrJoin(AvailableSimdTargets(), ", "), " (or best)"));
}

absl::Status PinSimdTargetFromEnv() {
  static const absl::Status status = [] {
    const char* env = std::getenv("KVQ_SIMD_TARGET");
    if (env == nullptr) return absl::OkStatus();
    absl::Status s = PinSimdTarget(env);
    return s.ok() ? s : absl::Status(s.code(), absl::StrCat("KVQ_SIMD_TARGET: ", s.message()));
  }();
  return status;
}

}  // namespace cpu
}  // namespace kvq
