// HostTensor: a dense row-major tensor in host memory, the client's typed
// form of kvq::v1::Tensor.
//
// Elements are little-endian fp32, fp16 or bf16 held as raw bytes in `data`
// (a std::string, so that moving into and out of protobuf messages does not
// copy). Conversions round to nearest even and are bit-exact against
// kernels/numeric.h.
#ifndef KVQ_CLIENT_HOST_TENSOR_H_
#define KVQ_CLIENT_HOST_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/tensor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {

struct HostTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string data;  // num_elements() * DTypeBytes(dtype) bytes.

  // Converts `values` to `dtype` (round to nearest even). INVALID_ARGUMENT
  // when the shape does not hold values.size() elements or has a negative
  // dimension.
  static absl::StatusOr<HostTensor> FromFloats(absl::Span<const float> values,
                                               std::vector<int64_t> shape,
                                               DType dtype = DType::kFloat32);
  // Takes fp16 / bf16 bit patterns as they are.
  static absl::StatusOr<HostTensor> FromFp16Bits(absl::Span<const uint16_t> bits,
                                                 std::vector<int64_t> shape);
  static absl::StatusOr<HostTensor> FromBf16Bits(absl::Span<const uint16_t> bits,
                                                 std::vector<int64_t> shape);
  // Zero-filled tensor.
  static HostTensor Zeros(DType dtype, std::vector<int64_t> shape);

  // Product of the shape (1 for a scalar shape {}).
  int64_t num_elements() const;
  size_t byte_size() const { return data.size(); }
  int rank() const { return static_cast<int>(shape.size()); }

  // OK when no dimension is negative and data holds exactly
  // num_elements() elements of dtype; INVALID_ARGUMENT naming both sizes
  // otherwise.
  absl::Status Validate() const;

  // Element conversions from any dtype.
  std::vector<float> ToFloats() const;
  std::vector<uint16_t> ToFp16Bits() const;
  std::vector<uint16_t> ToBf16Bits() const;
  // This tensor in `dtype` (a copy; the same bytes when dtype is unchanged).
  HostTensor Cast(DType dtype) const;

  const uint8_t* bytes() const { return reinterpret_cast<const uint8_t*>(data.data()); }
  uint8_t* mutable_bytes() { return reinterpret_cast<uint8_t*>(data.data()); }
  // "[2, 3, 4] float16" for messages.
  std::string DebugString() const;

  friend bool operator==(const HostTensor&, const HostTensor&) = default;
};

// kvq::DType <-> the wire enum. INVALID_ARGUMENT for DTYPE_UNSPECIFIED or an
// unknown value.
v1::DType ToProtoDType(DType dtype);
absl::StatusOr<DType> FromProtoDType(v1::DType dtype);

// Copies (or moves, for the rvalue overload) into a wire tensor.
void ToProto(const HostTensor& t, v1::Tensor* out);
void ToProto(HostTensor&& t, v1::Tensor* out);
// Validates dtype, shape and byte count; `field` names the tensor in errors.
// The rvalue overload takes the bytes out of `t`.
absl::StatusOr<HostTensor> FromProto(const v1::Tensor& t, absl::string_view field = "tensor");
absl::StatusOr<HostTensor> FromProto(v1::Tensor&& t, absl::string_view field = "tensor");

}  // namespace kvq

#endif  // KVQ_CLIENT_HOST_TENSOR_H_
