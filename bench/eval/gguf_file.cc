#include "bench/eval/gguf_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/status_macros.h"

namespace kvq::eval {

// The reader copies fields straight out of the mapping; GGUF is little-endian
// (big-endian files exist but are rare and would need byte swapping).
static_assert(std::endian::native == std::endian::little,
              "GGUF reader assumes a little-endian host");

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32.
constexpr uint64_t kDefaultAlignment = 32;
// GGML_MAX_DIMS: ggml tensors have at most 4 dimensions.
constexpr uint32_t kMaxDims = 4;
// Arrays of arrays are legal GGUF but unused by models; bound the nesting so a
// hostile file cannot recurse the parser off the stack.
constexpr int kMaxArrayDepth = 8;

// Smallest encodings, used to bound counts before reserving memory for them.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;              // Key length, type, 1-byte value.
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // Name length, n_dims, type, offset.

// Indexed by GGML type id; block layouts from ggml's type_traits (and the
// gguf Python package's GGML_QUANT_SIZES). Removed ids (4, 5, 31-33) and
// unknown ones have no entry.
struct TypeEntry {
  uint32_t id;
  GgmlTypeInfo info;
};
constexpr TypeEntry kTypes[] = {
    {0, {"F32", 1, 4}},         {1, {"F16", 1, 2}},         {2, {"Q4_0", 32, 18}},
    {3, {"Q4_1", 32, 20}},      {6, {"Q5_0", 32, 22}},      {7, {"Q5_1", 32, 24}},
    {8, {"Q8_0", 32, 34}},      {9, {"Q8_1", 32, 40}},      {10, {"Q2_K", 256, 84}},
    {11, {"Q3_K", 256, 110}},   {12, {"Q4_K", 256, 144}},   {13, {"Q5_K", 256, 176}},
    {14, {"Q6_K", 256, 210}},   {15, {"Q8_K", 256, 292}},   {16, {"IQ2_XXS", 256, 66}},
    {17, {"IQ2_XS", 256, 74}},  {18, {"IQ3_XXS", 256, 98}}, {19, {"IQ1_S", 256, 50}},
    {20, {"IQ4_NL", 32, 18}},   {21, {"IQ3_S", 256, 110}},  {22, {"IQ2_S", 256, 82}},
    {23, {"IQ4_XS", 256, 136}}, {24, {"I8", 1, 1}},         {25, {"I16", 1, 2}},
    {26, {"I32", 1, 4}},        {27, {"I64", 1, 8}},        {28, {"F64", 1, 8}},
    {29, {"IQ1_M", 256, 56}},   {30, {"BF16", 1, 2}},       {34, {"TQ1_0", 256, 54}},
    {35, {"TQ2_0", 256, 66}},   {39, {"MXFP4", 32, 17}},
};

// Bytes of one scalar value type; 0 for string and array (variable size).
size_t ScalarBytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    case GgufValueType::kString:
    case GgufValueType::kArray:
      return 0;
  }
  return 0;
}

bool IsKnownValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kFloat64); }

bool IsIntegerType(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kBool:
      return true;
    default:
      return false;
  }
}

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Decodes one integer (or bool) of `type` at `p`; INVALID_ARGUMENT for a u64
// that int64 cannot hold. `what` names the value for that message.
absl::StatusOr<int64_t> DecodeInt(GgufValueType type, const uint8_t* p, absl::string_view what) {
  switch (type) {
    case GgufValueType::kUint8:
      return Load<uint8_t>(p);
    case GgufValueType::kInt8:
      return Load<int8_t>(p);
    case GgufValueType::kUint16:
      return Load<uint16_t>(p);
    case GgufValueType::kInt16:
      return Load<int16_t>(p);
    case GgufValueType::kUint32:
      return Load<uint32_t>(p);
    case GgufValueType::kInt32:
      return Load<int32_t>(p);
    case GgufValueType::kInt64:
      return Load<int64_t>(p);
    case GgufValueType::kBool:
      return Load<uint8_t>(p) != 0 ? 1 : 0;
    case GgufValueType::kUint64: {
      const uint64_t v = Load<uint64_t>(p);
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: u64 value %d does not fit in int64", what, v));
      }
      return static_cast<int64_t>(v);
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("%s is %s, wanted an integer", what, GgufValueTypeName(type)));
  }
}

// Reads a GGUF string at `p` (already bounds-checked at Open).
absl::string_view DecodeString(const uint8_t* p) {
  const uint64_t len = Load<uint64_t>(p);
  return absl::string_view(reinterpret_cast<const char*>(p + 8), len);
}

}  // namespace

const GgmlTypeInfo* FindGgmlTypeInfo(GgmlType type) {
  const uint32_t id = static_cast<uint32_t>(type);
  for (const TypeEntry& e : kTypes) {
    if (e.id == id) return &e.info;
  }
  return nullptr;
}

std::string GgmlTypeName(GgmlType type) {
  if (const GgmlTypeInfo* info = FindGgmlTypeInfo(type)) return info->name;
  return absl::StrFormat("ggml type %d", static_cast<uint32_t>(type));
}

std::string GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
      return "u8";
    case GgufValueType::kInt8:
      return "i8";
    case GgufValueType::kUint16:
      return "u16";
    case GgufValueType::kInt16:
      return "i16";
    case GgufValueType::kUint32:
      return "u32";
    case GgufValueType::kInt32:
      return "i32";
    case GgufValueType::kFloat32:
      return "f32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "u64";
    case GgufValueType::kInt64:
      return "i64";
    case GgufValueType::kFloat64:
      return "f64";
  }
  return absl::StrFormat("value type %d", static_cast<uint32_t>(type));
}

int64_t GgufTensor::elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// A bounds-checked cursor over the mapping. Every read names what it reads so
// that a truncated or corrupt file reports the field and its offset.
class GgufFile::Parser {
 public:
  Parser(const std::string& path, const uint8_t* base, size_t size)
      : path_(path), base_(base), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  const uint8_t* here() const { return base_ + pos_; }

  absl::Status Need(uint64_t n, absl::string_view what) const {
    if (n > remaining()) {
      return absl::DataLossError(absl::StrFormat(
          "%s: %s at offset %d needs %d bytes but the %d-byte file ends %d bytes later "
          "(truncated?)",
          path_, what, pos_, n, size_, remaining()));
    }
    return absl::OkStatus();
  }

  template <typename T>
  absl::StatusOr<T> Read(absl::string_view what) {
    KVQ_RETURN_IF_ERROR(Need(sizeof(T), what));
    const T v = Load<T>(here());
    pos_ += sizeof(T);
    return v;
  }

  absl::Status Skip(uint64_t n, absl::string_view what) {
    KVQ_RETURN_IF_ERROR(Need(n, what));
    pos_ += n;
    return absl::OkStatus();
  }

  absl::StatusOr<absl::string_view> ReadString(absl::string_view what) {
    const uint64_t at = pos_;
    KVQ_ASSIGN_OR_RETURN(const uint64_t len, Read<uint64_t>(absl::StrCat(what, " length")));
    if (len > remaining()) {
      return absl::DataLossError(absl::StrFormat(
          "%s: %s at offset %d has length %d but only %d bytes remain in the %d-byte file", path_,
          what, at, len, remaining(), size_));
    }
    absl::string_view s(reinterpret_cast<const char*>(here()), len);
    pos_ += len;
    return s;
  }

  // Checks a value of `type` at the cursor and moves past it; fills `value`
  // with where it lies.
  absl::Status ParseValue(GgufValueType type, absl::string_view what, int depth, Value* value) {
    value->type = type;
    if (type == GgufValueType::kString) {
      value->payload = here();
      return ReadString(what).status();
    }
    if (type != GgufValueType::kArray) {
      value->payload = here();
      return Skip(ScalarBytes(type), absl::StrCat(what, " (", GgufValueTypeName(type), ")"));
    }
    if (depth >= kMaxArrayDepth) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s at offset %d nests arrays deeper than %d", path_, what, pos_, kMaxArrayDepth));
    }
    const uint64_t type_at = pos_;
    KVQ_ASSIGN_OR_RETURN(const uint32_t raw_elem,
                         Read<uint32_t>(absl::StrCat(what, " element type")));
    if (!IsKnownValueType(raw_elem)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s at offset %d has unknown array element type %d (known: 0..12)",
                          path_, what, type_at, raw_elem));
    }
    const auto elem = static_cast<GgufValueType>(raw_elem);
    const uint64_t count_at = pos_;
    KVQ_ASSIGN_OR_RETURN(const uint64_t count, Read<uint64_t>(absl::StrCat(what, " count")));
    value->element_type = elem;
    value->count = count;
    value->payload = here();
    // Strings take at least their 8-byte length, nested arrays their 12-byte
    // header: bound the count by that before walking.
    const size_t scalar = ScalarBytes(elem);
    const uint64_t min_elem = scalar != 0 ? scalar : (elem == GgufValueType::kString ? 8 : 12);
    if (count > remaining() / min_elem) {
      return absl::DataLossError(absl::StrFormat(
          "%s: %s at offset %d holds %d %s elements (at least %d bytes each) but only %d bytes "
          "remain in the %d-byte file",
          path_, what, count_at, count, GgufValueTypeName(elem), min_elem, remaining(), size_));
    }
    if (scalar != 0) {
      pos_ += count * scalar;
      return absl::OkStatus();
    }
    if (elem == GgufValueType::kString) {
      // The tokenizer arrays hold ~50k strings each: check them without
      // building a message per element.
      for (uint64_t i = 0; i < count; ++i) {
        const uint64_t len = remaining() >= 8 ? Load<uint64_t>(here()) : 0;
        if (remaining() < 8 || len > remaining() - 8) {
          return ReadString(absl::StrFormat("%s[%d]", what, i)).status();
        }
        pos_ += 8 + len;
      }
      return absl::OkStatus();
    }
    Value element;
    for (uint64_t i = 0; i < count; ++i) {
      KVQ_RETURN_IF_ERROR(
          ParseValue(elem, absl::StrFormat("%s[%d]", what, i), depth + 1, &element));
    }
    return absl::OkStatus();
  }

 private:
  const std::string& path_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return absl::Status(absl::ErrnoToStatusCode(err),
                        absl::StrFormat("cannot open GGUF file %s: %s", path, std::strerror(err)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::Status(absl::ErrnoToStatusCode(err),
                        absl::StrFormat("cannot stat GGUF file %s: %s", path, std::strerror(err)));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return absl::DataLossError(absl::StrFormat("%s: empty file, not GGUF", path));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // The mapping keeps the file alive.
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrFormat("cannot mmap GGUF file %s (%d bytes): %s", path,
                                               size, std::strerror(map_err)));
  }
  // From here the destructor unmaps on every error path.
  std::unique_ptr<GgufFile> file(new GgufFile(static_cast<const uint8_t*>(map), size));
  KVQ_RETURN_IF_ERROR(file->Parse(path));
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBytes(absl::Span<const uint8_t> bytes,
                                                              const std::string& name) {
  if (bytes.empty()) return absl::DataLossError(absl::StrFormat("%s: empty file, not GGUF", name));
  std::unique_ptr<GgufFile> file(new GgufFile(bytes.data(), bytes.size()));
  file->owns_map_ = false;
  KVQ_RETURN_IF_ERROR(file->Parse(name));
  return file;
}

absl::Status GgufFile::Parse(const std::string& path) {
  GgufFile* file = this;
  const size_t size = size_;
  Parser p(path, file->map_, size);

  // --- Header ---
  KVQ_ASSIGN_OR_RETURN(const uint32_t magic, p.Read<uint32_t>("magic"));
  if (magic != kGgufMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: bad magic 0x%08x at offset 0, wanted 0x%08x (\"GGUF\"): not a GGUF file", path, magic,
        kGgufMagic));
  }
  KVQ_ASSIGN_OR_RETURN(file->version_, p.Read<uint32_t>("version"));
  if (file->version_ != 2 && file->version_ != 3) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: GGUF version %d at offset 4 is not supported (wanted 2 or 3%s)", path, file->version_,
        file->version_ == 1 ? "; version 1 used 32-bit counts" : ""));
  }
  KVQ_ASSIGN_OR_RETURN(const uint64_t tensor_count, p.Read<uint64_t>("tensor_count"));
  KVQ_ASSIGN_OR_RETURN(const uint64_t kv_count, p.Read<uint64_t>("metadata_kv_count"));
  if (kv_count > p.remaining() / kMinKvBytes) {
    return absl::DataLossError(absl::StrFormat(
        "%s: metadata_kv_count %d at offset 16 cannot fit: each entry takes at least %d bytes "
        "and only %d remain",
        path, kv_count, kMinKvBytes, p.remaining()));
  }
  if (tensor_count > p.remaining() / kMinTensorInfoBytes) {
    return absl::DataLossError(absl::StrFormat(
        "%s: tensor_count %d at offset 8 cannot fit: each tensor info takes at least %d bytes "
        "and only %d remain",
        path, tensor_count, kMinTensorInfoBytes, p.remaining()));
  }

  // --- Metadata ---
  file->keys_.reserve(kv_count);
  file->values_.reserve(kv_count);
  for (uint64_t i = 0; i < kv_count; ++i) {
    const uint64_t key_at = p.pos();
    KVQ_ASSIGN_OR_RETURN(const absl::string_view key,
                         p.ReadString(absl::StrFormat("metadata key #%d", i)));
    const std::string what = absl::StrFormat("metadata '%s'", key);
    const uint64_t type_at = p.pos();
    KVQ_ASSIGN_OR_RETURN(const uint32_t raw_type, p.Read<uint32_t>(what + " value type"));
    if (!IsKnownValueType(raw_type)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s at offset %d has unknown value type %d (known: 0..12)", path,
                          what, type_at, raw_type));
    }
    Value value;
    KVQ_RETURN_IF_ERROR(p.ParseValue(static_cast<GgufValueType>(raw_type), what, 0, &value));
    if (!file->values_.emplace(std::string(key), value).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: duplicate metadata key '%s' at offset %d", path, key, key_at));
    }
    file->keys_.emplace_back(key);
  }

  if (file->Has("general.alignment")) {
    KVQ_ASSIGN_OR_RETURN(const int64_t alignment, file->GetInt("general.alignment"));
    if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: general.alignment %d is not a positive power of two", path, alignment));
    }
    file->alignment_ = static_cast<uint64_t>(alignment);
  } else {
    file->alignment_ = kDefaultAlignment;
  }

  // --- Tensor directory ---
  struct PendingTensor {
    uint64_t offset;
    uint64_t info_at;
  };
  std::vector<PendingTensor> pending;
  pending.reserve(tensor_count);
  file->tensors_.reserve(tensor_count);
  file->tensor_index_.reserve(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    const uint64_t info_at = p.pos();
    KVQ_ASSIGN_OR_RETURN(const absl::string_view name,
                         p.ReadString(absl::StrFormat("tensor #%d name", i)));
    const std::string what = absl::StrFormat("tensor '%s'", name);
    const uint64_t ndims_at = p.pos();
    KVQ_ASSIGN_OR_RETURN(const uint32_t n_dims, p.Read<uint32_t>(what + " n_dims"));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s at offset %d has n_dims %d, wanted 1..%d", path, what, ndims_at,
                          n_dims, kMaxDims));
    }
    GgufTensor t;
    t.name = std::string(name);
    int64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim_at = p.pos();
      KVQ_ASSIGN_OR_RETURN(const uint64_t dim,
                           p.Read<uint64_t>(absl::StrFormat("%s dims[%d]", what, d)));
      constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
      if (dim > static_cast<uint64_t>(kMax) ||
          (dim != 0 && elements > kMax / static_cast<int64_t>(dim))) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: %s dims[%d] = %d at offset %d overflows int64 elements", path,
                            what, d, dim, dim_at));
      }
      t.dims.push_back(static_cast<int64_t>(dim));
      elements *= static_cast<int64_t>(dim);
    }
    const uint64_t type_at = p.pos();
    KVQ_ASSIGN_OR_RETURN(const uint32_t raw_type, p.Read<uint32_t>(what + " type"));
    t.type = static_cast<GgmlType>(raw_type);
    const GgmlTypeInfo* info = FindGgmlTypeInfo(t.type);
    if (info == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s at offset %d has unknown ggml type %d", path, what, type_at, raw_type));
    }
    if (t.dims[0] % info->block_elements != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s is %s but dims[0] = %d is not a multiple of its block size %d",
                          path, what, info->name, t.dims[0], info->block_elements));
    }
    const uint64_t blocks = static_cast<uint64_t>(elements / info->block_elements);
    if (blocks > std::numeric_limits<uint64_t>::max() / info->block_bytes) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: %s byte size overflows", path, what));
    }
    t.bytes = blocks * info->block_bytes;
    const uint64_t offset_at = p.pos();
    KVQ_ASSIGN_OR_RETURN(const uint64_t offset, p.Read<uint64_t>(what + " offset"));
    if (offset % file->alignment_ != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: %s offset %d (at file offset %d) is not a multiple of the alignment %d", path, what,
          offset, offset_at, file->alignment_));
    }
    if (!file->tensor_index_.emplace(t.name, file->tensors_.size()).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: duplicate tensor name '%s' at offset %d", path, name, info_at));
    }
    file->tensors_.push_back(std::move(t));
    pending.push_back({offset, info_at});
  }

  // --- Data section ---
  const uint64_t a = file->alignment_;
  file->data_offset_ = (p.pos() + a - 1) / a * a;
  // Even a tensor of no bytes points into the data section, which must
  // then start inside the file (a truncated file can lose its padding).
  if (!file->tensors_.empty() && file->data_offset_ > size) {
    return absl::DataLossError(absl::StrFormat(
        "%s: the data section starts at offset %d (the tensor directory ends at %d, aligned to "
        "%d), past the end of the %d-byte file (truncated?)",
        path, file->data_offset_, p.pos(), a, size));
  }
  for (size_t i = 0; i < file->tensors_.size(); ++i) {
    GgufTensor& t = file->tensors_[i];
    const uint64_t offset = pending[i].offset;
    // Compared by subtraction so a huge offset cannot wrap the sum.
    const uint64_t room = size >= file->data_offset_ ? size - file->data_offset_ : 0;
    if (offset > room || t.bytes > room - offset) {
      return absl::DataLossError(absl::StrFormat(
          "%s: tensor '%s' (%s, %d bytes) at data offset %d (file offset %d) runs past the end "
          "of the %d-byte file (truncated?)",
          path, t.name, GgmlTypeName(t.type), t.bytes, offset, file->data_offset_ + offset, size));
    }
    t.data = file->map_ + file->data_offset_ + offset;
  }
  return absl::OkStatus();
}

GgufFile::~GgufFile() {
  if (map_ != nullptr && owns_map_) ::munmap(const_cast<uint8_t*>(map_), size_);
}

bool GgufFile::Has(absl::string_view key) const { return values_.contains(key); }

absl::StatusOr<const GgufFile::Value*> GgufFile::Find(absl::string_view key) const {
  auto it = values_.find(key);
  if (it == values_.end()) {
    return absl::NotFoundError(absl::StrFormat("GGUF metadata key '%s' not found", key));
  }
  return &it->second;
}

absl::StatusOr<GgufValueType> GgufFile::Type(absl::string_view key) const {
  KVQ_ASSIGN_OR_RETURN(const Value* v, Find(key));
  return v->type;
}

absl::StatusOr<const GgufFile::Value*> GgufFile::FindArray(absl::string_view key,
                                                           const char* wanted) const {
  KVQ_ASSIGN_OR_RETURN(const Value* v, Find(key));
  if (v->type != GgufValueType::kArray) {
    return absl::InvalidArgumentError(absl::StrFormat("GGUF metadata '%s' is %s, wanted %s", key,
                                                      GgufValueTypeName(v->type), wanted));
  }
  return v;
}

absl::StatusOr<int64_t> GgufFile::GetInt(absl::string_view key) const {
  KVQ_ASSIGN_OR_RETURN(const Value* v, Find(key));
  if (!IsIntegerType(v->type)) {
    return absl::InvalidArgumentError(absl::StrFormat("GGUF metadata '%s' is %s, wanted an integer",
                                                      key, GgufValueTypeName(v->type)));
  }
  return DecodeInt(v->type, v->payload, absl::StrFormat("GGUF metadata '%s'", key));
}

absl::StatusOr<double> GgufFile::GetFloat(absl::string_view key) const {
  KVQ_ASSIGN_OR_RETURN(const Value* v, Find(key));
  if (v->type == GgufValueType::kFloat32) return Load<float>(v->payload);
  if (v->type == GgufValueType::kFloat64) return Load<double>(v->payload);
  if (IsIntegerType(v->type) && v->type != GgufValueType::kBool) {
    if (v->type == GgufValueType::kUint64) return static_cast<double>(Load<uint64_t>(v->payload));
    KVQ_ASSIGN_OR_RETURN(const int64_t i, GetInt(key));
    return static_cast<double>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("GGUF metadata '%s' is %s, wanted a float", key, GgufValueTypeName(v->type)));
}

absl::StatusOr<std::string> GgufFile::GetString(absl::string_view key) const {
  KVQ_ASSIGN_OR_RETURN(const Value* v, Find(key));
  if (v->type != GgufValueType::kString) {
    return absl::InvalidArgumentError(absl::StrFormat("GGUF metadata '%s' is %s, wanted string",
                                                      key, GgufValueTypeName(v->type)));
  }
  return std::string(DecodeString(v->payload));
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(absl::string_view key) const {
  KVQ_ASSIGN_OR_RETURN(const Value* v, FindArray(key, "array of string"));
  if (v->element_type != GgufValueType::kString) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF metadata '%s' is array of %s, wanted array of string", key,
                        GgufValueTypeName(v->element_type)));
  }
  std::vector<std::string> out;
  out.reserve(v->count);
  const uint8_t* p = v->payload;
  for (uint64_t i = 0; i < v->count; ++i) {
    const absl::string_view s = DecodeString(p);
    out.emplace_back(s);
    p += 8 + s.size();
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(absl::string_view key) const {
  KVQ_ASSIGN_OR_RETURN(const Value* v, FindArray(key, "array of integers"));
  if (!IsIntegerType(v->element_type)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF metadata '%s' is array of %s, wanted array of integers", key,
                        GgufValueTypeName(v->element_type)));
  }
  const size_t stride = ScalarBytes(v->element_type);
  const std::string what = absl::StrFormat("GGUF metadata '%s' element", key);
  std::vector<int64_t> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    KVQ_ASSIGN_OR_RETURN(out[i], DecodeInt(v->element_type, v->payload + i * stride, what));
  }
  return out;
}

absl::StatusOr<std::vector<double>> GgufFile::GetFloatArray(absl::string_view key) const {
  KVQ_ASSIGN_OR_RETURN(const Value* v, FindArray(key, "array of floats"));
  std::vector<double> out(v->count);
  if (v->element_type == GgufValueType::kFloat32) {
    for (uint64_t i = 0; i < v->count; ++i) out[i] = Load<float>(v->payload + 4 * i);
  } else if (v->element_type == GgufValueType::kFloat64) {
    for (uint64_t i = 0; i < v->count; ++i) out[i] = Load<double>(v->payload + 8 * i);
  } else {
    return absl::InvalidArgumentError(
        absl::StrFormat("GGUF metadata '%s' is array of %s, wanted array of floats", key,
                        GgufValueTypeName(v->element_type)));
  }
  return out;
}

absl::StatusOr<const GgufTensor*> GgufFile::Tensor(absl::string_view name) const {
  auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) {
    return absl::NotFoundError(absl::StrFormat("GGUF tensor '%s' not found", name));
  }
  return &tensors_[it->second];
}

}  // namespace kvq::eval
