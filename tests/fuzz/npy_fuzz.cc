// Fuzz target: the .npy reader of the kvq CLI (client/npy.h).
//
// Input: the file's bytes. Checked beyond "no crash, no sanitizer report":
// a refusal is INVALID_ARGUMENT; what parses is a valid tensor whose data
// is the file's tail, and writing it and parsing that again gives the same
// tensor.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "client/npy.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "npy_fuzz: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvq::HostTensor> t = kvq::ParseNpy(bytes);
  if (!t.ok()) {
    if (t.status().code() != absl::StatusCode::kInvalidArgument) Fail("refusal is not INVALID_ARGUMENT");
    return 0;
  }
  if (!t->Validate().ok()) Fail("parsed tensor does not validate");
  if (t->data.size() > size || bytes.substr(size - t->data.size()) != t->data) {
    Fail("parsed data is not the file's tail");
  }
  absl::StatusOr<std::string> written = kvq::SerializeNpy(*t);
  if (!written.ok()) Fail("a parsed tensor does not serialize");
  absl::StatusOr<kvq::HostTensor> again = kvq::ParseNpy(*written);
  if (!again.ok()) Fail("the written file does not parse");
  if (again->dtype != t->dtype || again->shape != t->shape || again->data != t->data) {
    Fail("the written file holds another tensor");
  }
  return 0;
}
