// Quoted: client input as an error message may repeat it.
//
// A message travels back in the gRPC status (a header): one that repeats a
// 20,000-character id is more than a standard client reads (its metadata
// limit is 16 KiB), and it reports RESOURCE_EXHAUSTED instead of the error.
// Every message that names client input quotes it through this, so no
// message carries more than a short, printable prefix of it.
#ifndef KVQ_KERNELS_QUOTED_H_
#define KVQ_KERNELS_QUOTED_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace kvq {

// Most bytes of client input a message repeats.
inline constexpr size_t kQuotedPrefixBytes = 32;

// `input` in double quotes, C-escaped (non-printable bytes as \xNN), cut to
// its first kQuotedPrefixBytes bytes, "..." and its full length when it is
// longer: "abc", or "abcdef..." (20000 bytes). At most
// 4 * kQuotedPrefixBytes + 32 characters.
std::string Quoted(absl::string_view input);

}  // namespace kvq

#endif  // KVQ_KERNELS_QUOTED_H_
