#include "bench/eval/ggml_dequant.h"

#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "kernels/numeric.h"
#include "kernels/status_macros.h"

namespace kvq::eval {
namespace {

constexpr int kQk = 32;  // Elements per block of the 4/5/8-bit formats.

inline float LoadHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return HalfToFloat(h);
}

inline uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One block each: `b` points at the block, `y` receives kQk floats. These
// mirror ggml's dequantize_row_* reference loops.

void BlockQ4_0(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < kQk / 2; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0f) - 8) * d;
    y[j + kQk / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void BlockQ4_1(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const float m = LoadHalf(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < kQk / 2; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
    y[j + kQk / 2] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void BlockQ5_0(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const uint32_t qh = LoadU32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < kQk / 2; ++j) {
    const int hi0 = static_cast<int>((qh >> j) & 1u) << 4;
    const int hi1 = static_cast<int>((qh >> (j + kQk / 2)) & 1u) << 4;
    y[j] = static_cast<float>(((qs[j] & 0x0f) | hi0) - 16) * d;
    y[j + kQk / 2] = static_cast<float>(((qs[j] >> 4) | hi1) - 16) * d;
  }
}

void BlockQ5_1(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const float m = LoadHalf(b + 2);
  const uint32_t qh = LoadU32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < kQk / 2; ++j) {
    const int hi0 = static_cast<int>((qh >> j) & 1u) << 4;
    const int hi1 = static_cast<int>((qh >> (j + kQk / 2)) & 1u) << 4;
    y[j] = static_cast<float>((qs[j] & 0x0f) | hi0) * d + m;
    y[j + kQk / 2] = static_cast<float>((qs[j] >> 4) | hi1) * d + m;
  }
}

void BlockQ8_0(const uint8_t* b, float* y) {
  const float d = LoadHalf(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < kQk; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// Decodes `blocks` whole blocks (already validated) of a supported type.
void DecodeBlocks(GgmlType type, const uint8_t* src, int64_t blocks, size_t block_bytes,
                  float* dst) {
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(blocks) * sizeof(float));
      return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < blocks; ++i) dst[i] = LoadHalf(src + 2 * i);
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < blocks; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, sizeof(b));
        dst[i] = Bf16ToFloat(b);
      }
      return;
    default:
      break;
  }
  void (*block_fn)(const uint8_t*, float*) = nullptr;
  switch (type) {
    case GgmlType::kQ4_0:
      block_fn = BlockQ4_0;
      break;
    case GgmlType::kQ4_1:
      block_fn = BlockQ4_1;
      break;
    case GgmlType::kQ5_0:
      block_fn = BlockQ5_0;
      break;
    case GgmlType::kQ5_1:
      block_fn = BlockQ5_1;
      break;
    case GgmlType::kQ8_0:
      block_fn = BlockQ8_0;
      break;
    default:
      return;  // Unreachable: callers check CanDequantize first.
  }
  for (int64_t i = 0; i < blocks; ++i) block_fn(src + i * block_bytes, dst + i * kQk);
}

absl::Status CheckDequantizable(GgmlType type) {
  if (FindGgmlTypeInfo(type) == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s is not a GGML type", GgmlTypeName(type)));
  }
  if (!CanDequantize(type)) {
    return absl::UnimplementedError(absl::StrFormat(
        "dequantizing GGML type %s is not implemented (supported: F32, F16, BF16, Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q8_0)",
        GgmlTypeName(type)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<size_t> GgmlRowBytes(GgmlType type, int64_t n) {
  const GgmlTypeInfo* info = FindGgmlTypeInfo(type);
  if (info == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GgmlRowBytes: %s is not a GGML type", GgmlTypeName(type)));
  }
  if (n < 0 || n % info->block_elements != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "GgmlRowBytes: n = %d elements of %s is not a non-negative multiple of its block size "
        "%d",
        n, info->name, info->block_elements));
  }
  return static_cast<size_t>(n / info->block_elements) * info->block_bytes;
}

bool CanDequantize(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ8_0:
      return true;
  }
  return false;
}

absl::Status DequantizeRow(GgmlType type, const uint8_t* src, int64_t n, float* dst) {
  KVQ_RETURN_IF_ERROR(CheckDequantizable(type));
  KVQ_RETURN_IF_ERROR(GgmlRowBytes(type, n).status());
  const GgmlTypeInfo* info = FindGgmlTypeInfo(type);
  DecodeBlocks(type, src, n / info->block_elements, info->block_bytes, dst);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> DequantizeTensor(const GgufTensor& t) {
  KVQ_RETURN_IF_ERROR(CheckDequantizable(t.type));
  const GgmlTypeInfo* info = FindGgmlTypeInfo(t.type);
  if (t.dims.empty() || t.dims[0] % info->block_elements != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s' (%s): dims[0] = %d is not a multiple of the block size %d",
                        t.name, info->name, t.dims.empty() ? 0 : t.dims[0], info->block_elements));
  }
  const int64_t n = t.elements();
  const int64_t blocks = n / info->block_elements;
  const size_t want_bytes = static_cast<size_t>(blocks) * info->block_bytes;
  if (t.bytes != want_bytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s' (%s, %d elements) holds %d bytes, wanted %d", t.name,
                        info->name, n, t.bytes, want_bytes));
  }
  if (n > 0 && t.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor '%s' has no data", t.name));
  }
  std::vector<float> out(static_cast<size_t>(n));
  // GGML rows are stored back to back, so the tensor is one run of blocks;
  // split it in chunks regardless of row boundaries. One thread decodes
  // ~500M weights/s, so only tensors far larger than a layer's matrices
  // (the embedding) are worth a parallel region: on a loaded machine each
  // fork/join can wait a scheduler tick for a descheduled thread, which made
  // a threaded load of all 272 tensors several times slower than a serial one.
  constexpr int64_t kChunkBlocks = 16384;
  constexpr int64_t kMinParallelBlocks = int64_t{1} << 18;  // 8M weights of a 32-block type.
  const int64_t chunks = (blocks + kChunkBlocks - 1) / kChunkBlocks;
  const bool parallel = blocks >= kMinParallelBlocks;
  const uint8_t* src = t.data;
  float* dst = out.data();
  const GgmlType type = t.type;
  const size_t block_bytes = info->block_bytes;
  const int64_t block_elements = info->block_elements;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = c * kChunkBlocks;
    const int64_t count = std::min(kChunkBlocks, blocks - first);
    DecodeBlocks(type, src + first * block_bytes, count, block_bytes, dst + first * block_elements);
  }
  return out;
}

}  // namespace kvq::eval
