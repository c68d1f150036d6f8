#include "kernels/page_layout.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvq {
namespace {

size_t AlignUp(size_t n, size_t align) { return (n + align - 1) / align * align; }

// Plane widths (bits) that make up a b-bit code.
int PlaneCount(int bits) { return bits == 3 ? 2 : 1; }
int PlaneBits(int bits, int plane) {
  if (bits == 3) return plane == 0 ? 2 : 1;
  return bits;
}
int PlaneShift(int bits, int plane) { return (bits == 3 && plane == 1) ? 2 : 0; }

void PackPlane(const uint8_t* codes, int n, int b, int shift, uint8_t* plane) {
  const int bytes = n * b / 8;
  const int per_byte = 8 / b;
  const uint8_t mask = static_cast<uint8_t>((1 << b) - 1);
  for (int j = 0; j < bytes; ++j) {
    uint8_t byte = 0;
    for (int m = 0; m < per_byte; ++m) {
      byte |= static_cast<uint8_t>(((codes[j + bytes * m] >> shift) & mask) << (m * b));
    }
    plane[j] = byte;
  }
}

// The plane width as a constant and eight plane bytes at a time in a
// 64-bit word: byte j of slot m is bit field m of plane byte j, so one shift
// and mask yields eight codes (crq's cpu attention unpacks a code row per key
// and per value).
template <int B>
void UnpackPlaneOf(const uint8_t* plane, int n, int shift, uint8_t* codes) {
  static_assert(std::endian::native == std::endian::little);
  constexpr int kPerByte = 8 / B;
  constexpr uint64_t kMask = 0x0101010101010101ull * ((1u << B) - 1);
  const int bytes = n * B / 8;
  int j = 0;
  for (; j + 8 <= bytes; j += 8) {
    uint64_t x;
    std::memcpy(&x, plane + j, 8);
    for (int m = 0; m < kPerByte; ++m) {
      uint64_t out;
      std::memcpy(&out, codes + j + bytes * m, 8);
      out |= ((x >> (m * B)) & kMask) << shift;
      std::memcpy(codes + j + bytes * m, &out, 8);
    }
  }
  for (; j < bytes; ++j) {
    for (int m = 0; m < kPerByte; ++m) {
      codes[j + bytes * m] |= static_cast<uint8_t>(((plane[j] >> (m * B)) & ((1 << B) - 1)) << shift);
    }
  }
}

void UnpackPlane(const uint8_t* plane, int n, int b, int shift, uint8_t* codes) {
  switch (b) {
    case 1: return UnpackPlaneOf<1>(plane, n, shift, codes);
    case 2: return UnpackPlaneOf<2>(plane, n, shift, codes);
    case 4: return UnpackPlaneOf<4>(plane, n, shift, codes);
    default: break;
  }
  const int bytes = n * b / 8;
  const int per_byte = 8 / b;
  const uint8_t mask = static_cast<uint8_t>((1 << b) - 1);
  for (int j = 0; j < bytes; ++j) {
    for (int m = 0; m < per_byte; ++m) {
      codes[j + bytes * m] |= static_cast<uint8_t>(((plane[j] >> (m * b)) & mask) << shift);
    }
  }
}

}  // namespace

void PackCodes(const uint8_t* codes, int n, int bits, uint8_t* row) {
  if (bits == 8) {
    std::memcpy(row, codes, n);
    return;
  }
  for (int p = 0; p < PlaneCount(bits); ++p) {
    const int b = PlaneBits(bits, p);
    PackPlane(codes, n, b, PlaneShift(bits, p), row);
    row += n * b / 8;
  }
}

void UnpackCodes(const uint8_t* row, int n, int bits, uint8_t* codes) {
  if (bits == 8) {
    std::memcpy(codes, row, n);
    return;
  }
  std::memset(codes, 0, n);
  for (int p = 0; p < PlaneCount(bits); ++p) {
    const int b = PlaneBits(bits, p);
    UnpackPlane(row, n, b, PlaneShift(bits, p), codes);
    row += n * b / 8;
  }
}

absl::StatusOr<PageLayout> PageLayout::Make(const QuantSpec& spec, int head_dim,
                                            int page_tokens) {
  if (head_dim < 16 || head_dim > kMaxHeadDim || head_dim % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim must be a multiple of 16 in [16, ", kMaxHeadDim, "], got ", head_dim));
  }
  if (spec.is_kivi() && head_dim % std::min(spec.group, head_dim) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim ", head_dim, " must be a multiple of the value group size g=", spec.group));
  }
  PageLayout l;
  l.head_dim = head_dim;
  l.block_tokens = spec.is_kivi() ? spec.group : 1;
  if (page_tokens == 0) page_tokens = std::max(32, l.block_tokens);
  if (page_tokens < 1 || page_tokens > 4096 || page_tokens % l.block_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_tokens must be a multiple of the group size ", l.block_tokens,
        " in [1, 4096], got ", page_tokens));
  }
  l.page_tokens = page_tokens;
  const int t = page_tokens;
  const int d = head_dim;
  auto set_side = [&](SideLayout& s, bool is_key) {
    s.bits = is_key ? spec.key_bits() : spec.value_bits();
    switch (spec.kind) {
      case SchemeKind::kFp16:
        s.format = CodeFormat::kFp16;
        s.code_row_bytes = 2 * d;
        break;
      case SchemeKind::kBf16:
        s.format = CodeFormat::kBf16;
        s.code_row_bytes = 2 * d;
        break;
      case SchemeKind::kFp8E4m3:
        s.format = CodeFormat::kFp8E4m3;
        s.code_row_bytes = d;
        break;
      case SchemeKind::kInt8:
        s.format = CodeFormat::kInt8;
        s.code_row_bytes = d;
        s.axis = ParamAxis::kTokenGroups;
        s.group_channels = d;
        break;
      case SchemeKind::kCrq:
        s.format = CodeFormat::kCrq;
        s.half_bits = spec.crq_half_bits(is_key);
        s.bits = (s.half_bits + 1) / 2;
        s.code_row_bytes = static_cast<size_t>(d) / 2 * (s.half_bits / 2 + s.bits) / 8;
        s.axis = ParamAxis::kTokenGain;
        break;
      case SchemeKind::kKivi:
        s.format = CodeFormat::kPacked;
        s.code_row_bytes = static_cast<size_t>(d) * s.bits / 8;
        s.param_bits = spec.param_bits;
        if (is_key && spec.key_axis == KeyAxis::kPerChannel) {
          s.axis = ParamAxis::kChannelGroups;
        } else {
          s.axis = ParamAxis::kTokenGroups;
          s.group_channels = std::min(spec.group, d);
        }
        break;
    }
  };
  set_side(l.key, true);
  set_side(l.value, false);
  if (spec.has_outliers()) {
    l.outliers_per_block = static_cast<int>(
        std::ceil(spec.outlier_percent / 100.0 * l.block_tokens * d - 1e-9));
  }
  // Code rows start on a cache line (the kernels stream them); parameter and
  // outlier tables are read as bytes and 16-bit words, so they need only
  // kTableAlign and pack behind the codes instead of padding each to a line.
  size_t offset = 0;
  size_t used = 0;
  auto place = [&](size_t bytes, size_t align) {
    const size_t at = AlignUp(offset, align);
    offset = at + bytes;
    used += bytes;
    return at;
  };
  // Both sides' code rows first: their sizes are multiples of 64 bytes
  // (page_tokens >= 32 rows of an even number of bytes), so the tables that
  // follow share one alignment gap at the end of the page.
  for (SideLayout* s : {&l.key, &l.value}) {
    s->codes_offset = place(s->code_row_bytes * t, kPageAlign);
  }
  for (SideLayout* s : {&l.key, &l.value}) {
    if (s->axis != ParamAxis::kNone) {
      s->params_bytes = static_cast<size_t>(l.blocks_per_page()) * l.ParamBlockBytes(*s);
    }
    if (s->params_bytes) s->params_offset = place(s->params_bytes, kTableAlign);
    s->outliers_bytes =
        static_cast<size_t>(l.blocks_per_page()) * l.outliers_per_block * 2 * 2;
    if (s->outliers_bytes) s->outliers_offset = place(s->outliers_bytes, kTableAlign);
  }
  offset = AlignUp(offset, kPageAlign);
  l.page_bytes = offset;
  l.padding_bytes = offset - used;
  if (absl::Status st = l.CheckVectorLoads(); !st.ok()) return st;
  return l;
}

absl::Status PageLayout::CheckVectorLoads() const {
  const struct {
    const char* name;
    size_t value;
  } fields[] = {{"page_bytes", page_bytes},
                {"key.codes_offset", key.codes_offset},
                {"value.codes_offset", value.codes_offset}};
  for (const auto& f : fields) {
    if (f.value % kVectorLoadBytes != 0) {
      return absl::InternalError(absl::StrCat("page layout: ", f.name, " ", f.value,
                                              " is not a multiple of ", kVectorLoadBytes,
                                              " (the device kernels' load width)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvq
