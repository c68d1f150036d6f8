// A read-only GGUF (llama.cpp model file) reader: metadata and tensor
// directory, with tensor data left in the memory-mapped file.
//
// Format (little-endian, versions 2 and 3):
//   "GGUF" u32 version, u64 tensor_count, u64 metadata_kv_count,
//   metadata_kv_count x { string key, u32 value_type, value },
//   tensor_count x { string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type,
//                    u64 offset },
//   padding to general.alignment (default 32), then the data section; each
//   tensor's offset is relative to the data section and aligned.
// A string is a u64 length and that many bytes (no terminator); an array is a
// u32 element type, a u64 count and the elements.
#ifndef KVQ_BENCH_EVAL_GGUF_FILE_H_
#define KVQ_BENCH_EVAL_GGUF_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvq::eval {

// GGML tensor types, in GGML's numbering. Only the named ones can be
// dequantized (ggml_dequant.h); the reader accepts every type whose block
// layout it knows (GgmlTypeInfo) so that a file with, say, K-quants still opens.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kBF16 = 30,
};

// Storage layout of one GGML type: `block_bytes` bytes hold `block_elements`
// consecutive elements of a row.
struct GgmlTypeInfo {
  const char* name;
  int64_t block_elements;
  size_t block_bytes;
};

// Layout of `type`, or nullptr for a type id GGML does not define (or has
// removed).
const GgmlTypeInfo* FindGgmlTypeInfo(GgmlType type);

// "Q4_1", or "ggml type 42" for an unknown id: for error messages.
std::string GgmlTypeName(GgmlType type);

struct GgufTensor {
  std::string name;
  GgmlType type;
  // GGML order: dims[0] is the contiguous (fastest) dimension.
  std::vector<int64_t> dims;
  // Into the mapped file, aligned per general.alignment (default 32); valid
  // while the GgufFile lives.
  const uint8_t* data = nullptr;
  size_t bytes = 0;

  int64_t elements() const;
};

// GGUF metadata value types, in the format's numbering.
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// "u32", "array", ... or "value type 99": for error messages.
std::string GgufValueTypeName(GgufValueType type);

class GgufFile {
 public:
  // Maps `path` read-only and parses the header, metadata and tensor
  // directory. Errors:
  //   NOT_FOUND / PERMISSION_DENIED (from the OS) when the file cannot be
  //     opened; INTERNAL when it cannot be mapped;
  //   INVALID_ARGUMENT for a file that is not GGUF (bad magic), an
  //     unsupported version (not 2 or 3), an unknown value or tensor type,
  //     bad dims, a misaligned offset, a bad general.alignment, or a
  //     duplicate key or tensor name;
  //   DATA_LOSS when a field, string, array or tensor runs past the end of
  //     the file, or a count cannot fit in it.
  // Messages name the field or tensor, its file offset and the bound.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // The same parse of a file's bytes held by the caller, which must outlive
  // the GgufFile (tensor data points into them); `name` stands for the path
  // in messages. For tests and the fuzzer (tests/fuzz/gguf_fuzz.cc), where a
  // buffer of exactly the file's size lets the sanitizer see any read past
  // its end (a mapping reads zeros up to the end of its last page).
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBytes(absl::Span<const uint8_t> bytes,
                                                             const std::string& name);

  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;
  ~GgufFile();  // Unmaps the file.

  uint32_t version() const { return version_; }
  // general.alignment, or 32 when absent.
  uint64_t alignment() const { return alignment_; }
  // File offset of the data section.
  uint64_t data_offset() const { return data_offset_; }

  bool Has(absl::string_view key) const;
  // Type of the value at `key`; NOT_FOUND when absent.
  absl::StatusOr<GgufValueType> Type(absl::string_view key) const;
  // Metadata keys in file order.
  const std::vector<std::string>& keys() const { return keys_; }

  // Getters: NOT_FOUND when `key` is absent; INVALID_ARGUMENT when it holds
  // another type (the message names the key, the actual and the wanted type)
  // or a u64 beyond int64.
  // Any integer type or bool (as 0/1).
  absl::StatusOr<int64_t> GetInt(absl::string_view key) const;
  // f32 or f64; integers convert.
  absl::StatusOr<double> GetFloat(absl::string_view key) const;
  absl::StatusOr<std::string> GetString(absl::string_view key) const;
  // An array of strings.
  absl::StatusOr<std::vector<std::string>> GetStringArray(absl::string_view key) const;
  // An array of any integer type or bool.
  absl::StatusOr<std::vector<int64_t>> GetIntArray(absl::string_view key) const;
  // An array of f32 or f64.
  absl::StatusOr<std::vector<double>> GetFloatArray(absl::string_view key) const;

  // Tensors in file order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  // NOT_FOUND naming the tensor when absent.
  absl::StatusOr<const GgufTensor*> Tensor(absl::string_view name) const;

 private:
  // Where a metadata value lies in the mapping; getters decode on demand so
  // that the 49k-entry tokenizer arrays are not copied twice.
  struct Value {
    GgufValueType type;
    GgufValueType element_type;        // Arrays only.
    uint64_t count = 0;                // Arrays only.
    const uint8_t* payload = nullptr;  // The value (for arrays: the elements).
  };
  class Parser;

  GgufFile(const uint8_t* map, size_t size) : map_(map), size_(size) {}
  // Parses header, metadata and tensor directory of map_ (Open's errors).
  absl::Status Parse(const std::string& path);
  absl::StatusOr<const Value*> Find(absl::string_view key) const;
  // The array at `key`, INVALID_ARGUMENT unless it is an array.
  absl::StatusOr<const Value*> FindArray(absl::string_view key, const char* wanted) const;

  const uint8_t* map_;
  size_t size_;
  bool owns_map_ = true;  // Unmapped by the destructor (Open; not FromBytes).
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<std::string> keys_;
  absl::flat_hash_map<std::string, Value> values_;
  std::vector<GgufTensor> tensors_;
  absl::flat_hash_map<std::string, size_t> tensor_index_;
};

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_GGUF_FILE_H_
