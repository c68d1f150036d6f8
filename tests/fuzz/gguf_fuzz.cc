// Fuzz target: the GGUF reader of kvq-eval (bench/eval/gguf_file.h).
//
// Input: the file's bytes, parsed in place (GgufFile::FromBytes: libFuzzer's
// buffer has exactly the input's size, so any read past the end is a
// sanitizer report). Checked beyond "no crash, no sanitizer report":
// refusals use the documented codes; every key of an opened file answers
// every getter (its value or a typed refusal); every tensor lies inside the
// data section, aligned, and its bytes can be read.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/types/span.h"
#include "bench/eval/gguf_file.h"

namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "gguf_fuzz: %s\n", absl::CEscape(what).c_str());
  std::abort();
}

template <typename T>
void CheckGetter(const absl::StatusOr<T>& r, const std::string& key) {
  if (!r.ok() && r.status().code() != absl::StatusCode::kInvalidArgument) {
    Fail("a getter of key '" + key + "' failed with " + r.status().ToString());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<std::unique_ptr<kvq::eval::GgufFile>> file =
      kvq::eval::GgufFile::FromBytes(absl::MakeConstSpan(data, size), "fuzz.gguf");
  if (!file.ok()) {
    const absl::StatusCode c = file.status().code();
    if (c != absl::StatusCode::kInvalidArgument && c != absl::StatusCode::kDataLoss) {
      Fail("a refusal is " + file.status().ToString());
    }
    return 0;
  }
  const kvq::eval::GgufFile& f = **file;
  if (f.version() != 2 && f.version() != 3) Fail("opened an unsupported version");
  if (f.alignment() == 0 || (f.alignment() & (f.alignment() - 1)) != 0) {
    Fail("alignment is not a power of two");
  }
  for (const std::string& key : f.keys()) {
    if (!f.Has(key) || !f.Type(key).ok()) Fail("listed key '" + key + "' is not found");
    CheckGetter(f.GetInt(key), key);
    CheckGetter(f.GetFloat(key), key);
    CheckGetter(f.GetString(key), key);
    CheckGetter(f.GetStringArray(key), key);
    CheckGetter(f.GetIntArray(key), key);
    CheckGetter(f.GetFloatArray(key), key);
  }
  uint64_t checksum = 0;  // Of bytes read, so the reads stay.
  for (const kvq::eval::GgufTensor& t : f.tensors()) {
    absl::StatusOr<const kvq::eval::GgufTensor*> found = f.Tensor(t.name);
    if (!found.ok() || *found != &t) Fail("tensor '" + t.name + "' is not found by name");
    const uint8_t* begin = data + f.data_offset();
    if (t.data < begin || t.bytes > size || t.data > data + size - t.bytes) {
      Fail("tensor '" + t.name + "' lies outside the data section");
    }
    if ((t.data - begin) % f.alignment() != 0) Fail("tensor '" + t.name + "' is not aligned");
    if (t.elements() < 0) Fail("tensor '" + t.name + "' has a negative element count");
    // Read the first and last byte: the sanitizer sees a tensor that ends
    // past the buffer.
    if (t.bytes > 0) checksum += t.data[0] + t.data[t.bytes - 1];
  }
  static volatile uint64_t sink;
  sink = sink + checksum;
  return 0;
}
