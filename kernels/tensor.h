// Element types and a non-owning view of a row-major [rows, cols] tensor.
#ifndef KVQ_KERNELS_TENSOR_H_
#define KVQ_KERNELS_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace kvq {

enum class DType { kFloat32, kFloat16, kBFloat16 };

inline size_t DTypeBytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }
absl::string_view DTypeName(DType t);
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Rows of `cols` elements; row r starts at data + r * row_stride elements.
struct ConstTensorView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rows = 0;
  int cols = 0;
  int row_stride = 0;  // In elements; 0 means cols.

  int stride() const { return row_stride ? row_stride : cols; }
  const uint8_t* row(int r) const {
    return static_cast<const uint8_t*>(data) +
           static_cast<size_t>(r) * stride() * DTypeBytes(dtype);
  }
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rows = 0;
  int cols = 0;
  int row_stride = 0;

  int stride() const { return row_stride ? row_stride : cols; }
  uint8_t* row(int r) const {
    return static_cast<uint8_t*>(data) +
           static_cast<size_t>(r) * stride() * DTypeBytes(dtype);
  }
  operator ConstTensorView() const { return {data, dtype, rows, cols, row_stride}; }
};

inline ConstTensorView Floats(const float* data, int rows, int cols) {
  return {data, DType::kFloat32, rows, cols, 0};
}
inline TensorView Floats(float* data, int rows, int cols) {
  return {data, DType::kFloat32, rows, cols, 0};
}

// Converts one row to float; `n` elements.
void RowToFloat(const void* src, DType dtype, int n, float* dst);
// Converts floats to one row of `dtype` (round to nearest even).
void FloatToRow(const float* src, int n, DType dtype, void* dst);

}  // namespace kvq

#endif  // KVQ_KERNELS_TENSOR_H_
