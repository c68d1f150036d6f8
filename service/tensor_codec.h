// Checking and converting the wire tensors (kvq.v1.Tensor) at the RPC edge.
#ifndef KVQ_SERVICE_TENSOR_CODEC_H_
#define KVQ_SERVICE_TENSOR_CODEC_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {

struct WireTensor {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
};

absl::StatusOr<DType> FromWire(v1::DType d, absl::string_view field);
v1::DType ToWire(DType d);

// Checks dtype, rank, each dimension against `expected` (-1 matches any
// positive size) and that data holds exactly the elements. INVALID_ARGUMENT
// names `field`, e.g. "items[2].q.shape = [1, 9, 32], expected [n, 9, 64]".
absl::StatusOr<WireTensor> CheckTensor(const v1::Tensor& t, absl::string_view field,
                                       const std::vector<int64_t>& expected);

// The tensor's elements as floats (any accepted dtype).
std::vector<float> ToFloats(const WireTensor& t);

// Makes `out` an fp32 tensor of `shape` (zeros) and returns its data, for a
// kernel to write into: a std::string's buffer is aligned for floats.
float* ResizeFloat32Tensor(v1::Tensor* out, std::initializer_list<int64_t> shape);

}  // namespace kvq

#endif  // KVQ_SERVICE_TENSOR_CODEC_H_
