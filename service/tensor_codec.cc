#include "service/tensor_codec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvq {

absl::StatusOr<DType> FromWire(v1::DType d, absl::string_view field) {
  switch (d) {
    case v1::DTYPE_FP32: return DType::kFloat32;
    case v1::DTYPE_FP16: return DType::kFloat16;
    case v1::DTYPE_BF16: return DType::kBFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, " = ", static_cast<int>(d), " is not one of fp32, fp16, bf16"));
  }
}

v1::DType ToWire(DType d) {
  switch (d) {
    case DType::kFloat32: return v1::DTYPE_FP32;
    case DType::kFloat16: return v1::DTYPE_FP16;
    case DType::kBFloat16: return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

namespace {

// Most dimensions of a client's shape a message repeats.
constexpr size_t kMaxEchoedDims = 8;

}  // namespace

absl::StatusOr<WireTensor> CheckTensor(const v1::Tensor& t, absl::string_view field,
                                       const std::vector<int64_t>& expected) {
  WireTensor out;
  auto dtype = FromWire(t.dtype(), "dtype");
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".", dtype.status().message()));
  }
  out.dtype = *dtype;
  out.shape.assign(t.shape().begin(), t.shape().end());
  bool ok = out.shape.size() == expected.size();
  for (size_t i = 0; ok && i < expected.size(); ++i) {
    ok = out.shape[i] > 0 && (expected[i] < 0 || out.shape[i] == expected[i]);
  }
  if (!ok) {
    std::vector<std::string> want;
    for (int64_t e : expected) want.push_back(e < 0 ? "n" : absl::StrCat(e));
    // A shape of thousands of dimensions is not repeated whole (kernels/quoted.h).
    if (out.shape.size() > kMaxEchoedDims) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape has ", out.shape.size(),
                                                     " dimensions, expected [",
                                                     absl::StrJoin(want, ", "), "]"));
    }
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape = [",
                                                   absl::StrJoin(out.shape, ", "), "], expected [",
                                                   absl::StrJoin(want, ", "), "]"));
  }
  int64_t elements = 1;
  for (int64_t s : out.shape) {
    // Checked before multiplying: a product past int64 is undefined.
    if (s > (int64_t{1} << 40) / elements) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape is too large"));
    }
    elements *= s;
  }
  const uint64_t bytes = static_cast<uint64_t>(elements) * DTypeBytes(out.dtype);
  if (t.data().size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data has ", t.data().size(),
                                                   " bytes; shape and dtype need ", bytes));
  }
  out.data = reinterpret_cast<const uint8_t*>(t.data().data());
  return out;
}

std::vector<float> ToFloats(const WireTensor& t) {
  size_t n = 1;
  for (int64_t s : t.shape) n *= static_cast<size_t>(s);
  std::vector<float> out(n);
  RowToFloat(t.data, t.dtype, static_cast<int>(n), out.data());
  return out;
}

float* ResizeFloat32Tensor(v1::Tensor* out, std::initializer_list<int64_t> shape) {
  out->set_dtype(v1::DTYPE_FP32);
  out->mutable_shape()->Assign(shape.begin(), shape.end());
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  std::string* data = out->mutable_data();
  data->resize(n * sizeof(float));
  return reinterpret_cast<float*>(data->data());
}

}  // namespace kvq
