#include "client/npy.h"

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
constexpr size_t kAlign = 64;

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("npy: ", what));
}

// Parses the header dict, e.g. {'descr': '<f4', 'fortran_order': False,
// 'shape': (2, 3), }.
class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : s_(text) {}

  absl::Status Parse(std::string* descr, bool* fortran, std::vector<int64_t>* shape) {
    bool have_descr = false, have_fortran = false, have_shape = false;
    SkipSpace();
    if (!Eat('{')) return Bad("header does not start with '{'");
    while (true) {
      SkipSpace();
      if (Eat('}')) break;
      KVQ_ASSIGN_OR_RETURN(const std::string key, String());
      SkipSpace();
      if (!Eat(':')) return Bad(absl::StrCat("expected ':' after '", key, "' in the header"));
      SkipSpace();
      if (key == "descr") {
        KVQ_ASSIGN_OR_RETURN(*descr, String());
        have_descr = true;
      } else if (key == "fortran_order") {
        KVQ_ASSIGN_OR_RETURN(*fortran, Bool());
        have_fortran = true;
      } else if (key == "shape") {
        KVQ_ASSIGN_OR_RETURN(*shape, Tuple());
        have_shape = true;
      } else {
        return Bad(absl::StrCat("unknown header key '", key, "'"));
      }
      SkipSpace();
      if (Eat('}')) break;
      if (!Eat(',')) return Bad("expected ',' or '}' in the header");
    }
    SkipSpace();
    if (pos_ != s_.size()) return Bad("unexpected text after the header dict");
    if (!have_descr || !have_fortran || !have_shape) {
      return Bad("header lacks one of 'descr', 'fortran_order', 'shape'");
    }
    return absl::OkStatus();
  }

 private:
  void SkipSpace() {
    while (pos_ < s_.size() && absl::ascii_isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool Eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  absl::StatusOr<std::string> String() {
    if (pos_ >= s_.size() || (s_[pos_] != '\'' && s_[pos_] != '"')) {
      return Bad("expected a quoted string in the header");
    }
    const char quote = s_[pos_++];
    const size_t end = s_.find(quote, pos_);
    if (end == absl::string_view::npos) return Bad("unterminated string in the header");
    std::string out(s_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return out;
  }
  absl::StatusOr<bool> Bool() {
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    return Bad("fortran_order must be True or False");
  }
  absl::StatusOr<std::vector<int64_t>> Tuple() {
    if (!Eat('(')) return Bad("shape must be a tuple");
    std::vector<int64_t> dims;
    while (true) {
      SkipSpace();
      if (Eat(')')) break;
      if (pos_ >= s_.size() || !absl::ascii_isdigit(static_cast<unsigned char>(s_[pos_]))) {
        return Bad("shape holds something other than non-negative integers");
      }
      int64_t v = 0;
      while (pos_ < s_.size() && absl::ascii_isdigit(static_cast<unsigned char>(s_[pos_]))) {
        if (v > (int64_t{1} << 50)) return Bad("shape dimension is too large");
        v = v * 10 + (s_[pos_++] - '0');
      }
      Eat('L');  // Python 2 longs.
      dims.push_back(v);
      SkipSpace();
      if (Eat(')')) break;
      if (!Eat(',')) return Bad("expected ',' or ')' in the shape");
    }
    return dims;
  }

  absl::string_view s_;
  size_t pos_ = 0;
};

uint32_t ReadLe(const char* p, int bytes) {
  uint32_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

}  // namespace

absl::StatusOr<HostTensor> ParseNpy(absl::string_view bytes) {
  if (bytes.size() < kMagicLen + 2 || bytes.substr(0, kMagicLen) != absl::string_view(kMagic, kMagicLen)) {
    return Bad("not an .npy file (the magic string \\x93NUMPY is missing)");
  }
  const int major = static_cast<uint8_t>(bytes[6]);
  const int minor = static_cast<uint8_t>(bytes[7]);
  if ((major != 1 && major != 2) || minor != 0) {
    return Bad(absl::StrCat("format version ", major, ".", minor,
                            " is not supported (only 1.0 and 2.0)"));
  }
  const size_t len_bytes = major == 1 ? 2 : 4;
  const size_t prefix = kMagicLen + 2 + len_bytes;
  if (bytes.size() < prefix) return Bad("file ends inside the header length");
  const size_t header_len = ReadLe(bytes.data() + 8, static_cast<int>(len_bytes));
  if (bytes.size() < prefix + header_len) {
    return Bad(absl::StrCat("file ends inside the header (", header_len, " bytes declared)"));
  }
  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
  HeaderParser parser(bytes.substr(prefix, header_len));
  KVQ_RETURN_IF_ERROR(parser.Parse(&descr, &fortran, &shape));

  HostTensor t;
  if (descr == "<f4") {
    t.dtype = DType::kFloat32;
  } else if (descr == "<f2") {
    t.dtype = DType::kFloat16;
  } else {
    return Bad(absl::StrCat("dtype '", descr,
                            "' is not supported: use little-endian float32 ('<f4') or "
                            "float16 ('<f2')"));
  }
  if (fortran) return Bad("Fortran-order arrays are not supported: save a C-order array");
  t.shape = shape;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d != 0 && n > (int64_t{1} << 50) / d) return Bad("shape is too large");
    n *= d;
  }
  const size_t data_bytes = static_cast<size_t>(n) * DTypeBytes(t.dtype);
  const size_t have = bytes.size() - prefix - header_len;
  if (have != data_bytes) {
    return Bad(absl::StrCat("shape (", absl::StrJoin(shape, ", "), ") of ", descr, " needs ",
                            data_bytes, " data bytes, the file has ", have));
  }
  t.data.assign(bytes.data() + prefix + header_len, data_bytes);
  return t;
}

absl::StatusOr<HostTensor> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  absl::StatusOr<HostTensor> t = ParseNpy(bytes);
  if (!t.ok()) return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  return t;
}

absl::StatusOr<std::string> SerializeNpy(const HostTensor& tensor) {
  KVQ_RETURN_IF_ERROR(tensor.Validate());
  const char* descr = nullptr;
  switch (tensor.dtype) {
    case DType::kFloat32:
      descr = "<f4";
      break;
    case DType::kFloat16:
      descr = "<f2";
      break;
    case DType::kBFloat16:
      return Bad("NumPy has no bfloat16: cast the tensor to float32 first");
  }
  std::string shape = absl::StrJoin(tensor.shape, ", ");
  if (tensor.shape.size() == 1) shape += ",";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (", shape, "), }");
  int major = 1;
  size_t prefix = kMagicLen + 2 + 2;
  if ((prefix + header.size() + 1 + kAlign - 1) / kAlign * kAlign - prefix > 65535) {
    major = 2;
    prefix = kMagicLen + 2 + 4;
  }
  const size_t total = (prefix + header.size() + 1 + kAlign - 1) / kAlign * kAlign;
  header.append(total - prefix - header.size() - 1, ' ');
  header.push_back('\n');
  std::string out(kMagic, kMagicLen);
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  const uint32_t len = static_cast<uint32_t>(header.size());
  for (size_t i = 0; i < (major == 1 ? 2u : 4u); ++i) out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  out += header;
  out += tensor.data;
  return out;
}

absl::Status WriteNpy(const std::string& path, const HostTensor& tensor) {
  KVQ_ASSIGN_OR_RETURN(const std::string bytes, SerializeNpy(tensor));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace kvq
