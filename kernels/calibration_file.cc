#include "kernels/calibration_file.h"

#include <xxhash.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "kernels/quoted.h"

namespace kvq {
namespace {

// Bounds of the header's shape: those of a ModelLayout (service/sequence.h),
// with head_dim left to ModelCalibration::Validate beyond its range.
constexpr int kMaxLayers = 1024;
constexpr int kMaxKvHeads = 256;
constexpr int kMaxHeadDim = 1024;
// Magic, version, two lengths, three shape fields.
constexpr size_t kFixedHeaderBytes = 8 + 4 + 4 + 4 + 3 * 4;
constexpr size_t kChecksumBytes = 8;

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutF32(std::string* out, float f) {
  uint32_t v;
  std::memcpy(&v, &f, 4);
  PutU32(out, v);
}

// Reads little-endian fields from the front of a byte range the caller has
// checked is long enough.
class Cursor {
 public:
  explicit Cursor(absl::string_view bytes) : p_(bytes.data()) {}
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p_[i])) << (8 * i);
    p_ += 4;
    return v;
  }
  float F32() {
    const uint32_t v = U32();
    float f;
    std::memcpy(&f, &v, 4);
    return f;
  }
  absl::string_view Bytes(size_t n) {
    absl::string_view s(p_, n);
    p_ += n;
    return s;
  }

 private:
  const char* p_;
};

uint64_t LoadU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

absl::Status WithPath(const std::string& path, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
}

}  // namespace

absl::Status CheckCalibrationShape(const ModelCalibration& c, int num_layers, int num_kv_heads,
                                   int head_dim) {
  if (c.num_layers == num_layers && c.num_kv_heads == num_kv_heads && c.head_dim == head_dim) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "calibration ", Quoted(c.name), " is for ", c.num_layers, " layers x ", c.num_kv_heads,
      " KV heads x head_dim ", c.head_dim, "; the layout is ", num_layers, " layers x ",
      num_kv_heads, " KV heads x head_dim ", head_dim));
}

absl::Status CheckCalibrationName(absl::string_view name, absl::string_view field) {
  if (name.empty() || name.size() > kMaxCalibrationNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must have 1 to ",
                                                   kMaxCalibrationNameBytes, " bytes, got ",
                                                   name.size()));
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == ':')) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " ", Quoted(name), " may hold only letters, digits and - _ . :"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeCalibration(const ModelCalibration& calibration,
                                                 absl::string_view model) {
  if (absl::Status s = CheckCalibrationName(calibration.name, "calibration name"); !s.ok()) {
    return s;
  }
  if (model.size() > kMaxCalibrationModelBytes) {
    return absl::InvalidArgumentError(absl::StrCat("calibration model has ", model.size(),
                                                   " bytes; the limit is ",
                                                   kMaxCalibrationModelBytes));
  }
  if (absl::Status s = calibration.Validate(); !s.ok()) return s;
  std::string out(kCalibrationMagic, sizeof(kCalibrationMagic));
  PutU32(&out, kCalibrationFileVersion);
  PutU32(&out, static_cast<uint32_t>(calibration.name.size()));
  out += calibration.name;
  PutU32(&out, static_cast<uint32_t>(model.size()));
  out.append(model.data(), model.size());
  PutU32(&out, static_cast<uint32_t>(calibration.num_layers));
  PutU32(&out, static_cast<uint32_t>(calibration.num_kv_heads));
  PutU32(&out, static_cast<uint32_t>(calibration.head_dim));
  for (const HeadCalibration& h : calibration.heads) {
    for (const std::vector<float>* v : {&h.key_mean, &h.key_scale, &h.value_mean, &h.value_scale}) {
      for (float f : *v) PutF32(&out, f);
    }
  }
  const uint64_t checksum = XXH3_64bits(out.data(), out.size());
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((checksum >> (8 * i)) & 0xff));
  return out;
}

absl::StatusOr<CalibrationFile> ParseCalibration(absl::string_view bytes) {
  auto truncated = [&](size_t want) {
    return absl::DataLossError(absl::StrCat("calibration file is truncated: ", bytes.size(),
                                            " bytes, its header needs ", want));
  };
  if (bytes.size() < sizeof(kCalibrationMagic) ||
      std::memcmp(bytes.data(), kCalibrationMagic, sizeof(kCalibrationMagic)) != 0) {
    return absl::InvalidArgumentError(
        "not a kvq calibration file: it does not start with the magic \"KVQCAL\"");
  }
  if (bytes.size() < kFixedHeaderBytes + kChecksumBytes) {
    return truncated(kFixedHeaderBytes + kChecksumBytes);
  }
  Cursor in(bytes.substr(sizeof(kCalibrationMagic)));
  const uint32_t version = in.U32();
  if (version != kCalibrationFileVersion) {
    return absl::InvalidArgumentError(absl::StrCat("calibration file version ", version,
                                                   "; this build reads version ",
                                                   kCalibrationFileVersion));
  }
  const uint32_t name_bytes = in.U32();
  if (name_bytes == 0 || name_bytes > kMaxCalibrationNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("calibration file name length ", name_bytes,
                                                   " is outside [1, ", kMaxCalibrationNameBytes,
                                                   "]"));
  }
  size_t header = kFixedHeaderBytes + name_bytes;
  if (bytes.size() < header + kChecksumBytes) return truncated(header + kChecksumBytes);
  CalibrationFile file;
  file.calibration.name = std::string(in.Bytes(name_bytes));
  const uint32_t model_bytes = in.U32();
  if (model_bytes > kMaxCalibrationModelBytes) {
    return absl::InvalidArgumentError(absl::StrCat("calibration file model length ", model_bytes,
                                                   " is over its limit ",
                                                   kMaxCalibrationModelBytes));
  }
  header += model_bytes;
  if (bytes.size() < header + kChecksumBytes) return truncated(header + kChecksumBytes);
  file.model = std::string(in.Bytes(model_bytes));
  ModelCalibration& c = file.calibration;
  c.num_layers = static_cast<int32_t>(in.U32());
  c.num_kv_heads = static_cast<int32_t>(in.U32());
  c.head_dim = static_cast<int32_t>(in.U32());
  if (c.num_layers < 1 || c.num_layers > kMaxLayers || c.num_kv_heads < 1 ||
      c.num_kv_heads > kMaxKvHeads || c.head_dim < 1 || c.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration file shape ", c.num_layers, " layers x ", c.num_kv_heads,
        " KV heads x head_dim ", c.head_dim, " is outside [1, ", kMaxLayers, "] x [1, ",
        kMaxKvHeads, "] x [1, ", kMaxHeadDim, "]"));
  }
  const size_t heads = static_cast<size_t>(c.num_layers) * c.num_kv_heads;
  const size_t want = header + heads * 4 * c.head_dim * sizeof(float) + kChecksumBytes;
  if (bytes.size() < want) return truncated(want);
  if (bytes.size() > want) {
    return absl::DataLossError(absl::StrCat("calibration file has ", bytes.size() - want,
                                            " bytes after its checksum (", bytes.size(),
                                            " bytes, its header describes ", want, ")"));
  }
  const size_t body = want - kChecksumBytes;
  file.checksum = LoadU64(bytes.data() + body);
  const uint64_t actual = XXH3_64bits(bytes.data(), body);
  if (actual != file.checksum) {
    return absl::DataLossError(absl::StrCat("calibration file checksum mismatch: stored ",
                                            absl::Hex(file.checksum, absl::kZeroPad16),
                                            ", computed ", absl::Hex(actual, absl::kZeroPad16)));
  }
  c.heads.resize(heads);
  for (HeadCalibration& h : c.heads) {
    for (std::vector<float>* v : {&h.key_mean, &h.key_scale, &h.value_mean, &h.value_scale}) {
      v->resize(c.head_dim);
      for (float& f : *v) f = in.F32();
    }
  }
  if (absl::Status s = CheckCalibrationName(c.name, "calibration file name"); !s.ok()) return s;
  if (absl::Status s = c.Validate(); !s.ok()) return s;
  return file;
}

absl::Status WriteCalibrationFile(const std::string& path, const ModelCalibration& calibration,
                                  absl::string_view model) {
  absl::StatusOr<std::string> bytes = SerializeCalibration(calibration, model);
  if (!bytes.ok()) return WithPath(path, bytes.status());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat(tmp, ": cannot write"));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::UnavailableError(absl::StrCat(path, ": cannot rename into place: ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<CalibrationFile> ReadCalibrationFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<CalibrationFile> file = ParseCalibration(ss.str());
  if (!file.ok()) return WithPath(path, file.status());
  return file;
}

}  // namespace kvq
