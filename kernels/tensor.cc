#include "kernels/tensor.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/simd_kernels.h"
#include "kernels/numeric.h"
#include "kernels/quoted.h"

namespace kvq {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "fp32" || name == "float32") return DType::kFloat32;
  if (name == "fp16" || name == "float16") return DType::kFloat16;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", Quoted(name), " is not one of fp32, fp16, bf16"));
}

void RowToFloat(const void* src, DType dtype, int n, float* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, sizeof(float) * n);
      return;
    case DType::kFloat16:
      cpu::HalfToFloatSimd(static_cast<const uint16_t*>(src), n, dst);
      return;
    case DType::kBFloat16:
      for (int i = 0; i < n; ++i) dst[i] = Bf16ToFloat(Load16(src, i));
      return;
  }
}

void FloatToRow(const float* src, int n, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, sizeof(float) * n);
      return;
    case DType::kFloat16:
      cpu::FloatToHalfSimd(src, n, static_cast<uint16_t*>(dst));
      return;
    case DType::kBFloat16:
      for (int i = 0; i < n; ++i) Store16(dst, i, FloatToBf16(src[i]));
      return;
  }
}

}  // namespace kvq
