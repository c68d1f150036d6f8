#include "client/host_tensor.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/numeric.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

constexpr uintptr_t kHugePageBytes = uintptr_t{2} << 20;

// Sets `data` to `bytes` zero bytes. Fresh memory is faulted in page by page
// as it is first written, and a fetched prompt's KV is tens of MiB:
// thousands of 4 KiB faults (measured: a third of FetchDequant's client CPU,
// docs/BENCHMARKS.md section 7). Large buffers ask for transparent huge pages before
// the first write, which matters where the kernel only gives them on request
// (Debian's "madvise" default); elsewhere madvise is a no-op.
void AssignZeros(std::string& data, size_t bytes) {
  if (bytes >= kHugePageBytes) {
    data.reserve(bytes);
    const uintptr_t begin = reinterpret_cast<uintptr_t>(data.data());
    const uintptr_t first = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
    const uintptr_t last = (begin + bytes) & ~(kHugePageBytes - 1);
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
  data.assign(bytes, '\0');
}

// RowToFloat / FloatToRow take an int count: convert in blocks.
constexpr int64_t kBlock = int64_t{1} << 20;

absl::StatusOr<int64_t> CountElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape[", i, "] = ", shape[i], " is negative"));
    }
    if (shape[i] != 0 && n > (int64_t{1} << 62) / shape[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape [", absl::StrJoin(shape, ", "), "] is too large"));
    }
    n *= shape[i];
  }
  return n;
}

void ConvertToFloats(const uint8_t* src, DType dtype, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int count = static_cast<int>(std::min(kBlock, n - i));
    RowToFloat(src + i * DTypeBytes(dtype), dtype, count, dst + i);
  }
}

void ConvertFromFloats(const float* src, int64_t n, DType dtype, uint8_t* dst) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int count = static_cast<int>(std::min(kBlock, n - i));
    FloatToRow(src + i, count, dtype, dst + i * DTypeBytes(dtype));
  }
}

absl::StatusOr<HostTensor> FromHalfBits(absl::Span<const uint16_t> bits,
                                        std::vector<int64_t> shape, DType dtype) {
  KVQ_ASSIGN_OR_RETURN(const int64_t n, CountElements(shape));
  if (n != static_cast<int64_t>(bits.size())) {
    return absl::InvalidArgumentError(absl::StrCat("shape [", absl::StrJoin(shape, ", "),
                                                   "] holds ", n, " elements, got ",
                                                   bits.size()));
  }
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(bits.size() * 2);
  if (!bits.empty()) std::memcpy(t.data.data(), bits.data(), t.data.size());
  return t;
}

std::vector<uint16_t> HalfBits(const HostTensor& t, DType want) {
  const int64_t n = t.num_elements();
  std::vector<uint16_t> out(n);
  if (t.dtype == want) {
    if (n > 0) std::memcpy(out.data(), t.data.data(), n * 2);
    return out;
  }
  const std::vector<float> f = t.ToFloats();
  ConvertFromFloats(f.data(), n, want, reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

}  // namespace

absl::StatusOr<HostTensor> HostTensor::FromFloats(absl::Span<const float> values,
                                                  std::vector<int64_t> shape, DType dtype) {
  KVQ_ASSIGN_OR_RETURN(const int64_t n, CountElements(shape));
  if (n != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(absl::StrCat("shape [", absl::StrJoin(shape, ", "),
                                                   "] holds ", n, " elements, got ",
                                                   values.size()));
  }
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(values.size() * DTypeBytes(dtype));
  ConvertFromFloats(values.data(), n, dtype, t.mutable_bytes());
  return t;
}

absl::StatusOr<HostTensor> HostTensor::FromFp16Bits(absl::Span<const uint16_t> bits,
                                                    std::vector<int64_t> shape) {
  return FromHalfBits(bits, std::move(shape), DType::kFloat16);
}

absl::StatusOr<HostTensor> HostTensor::FromBf16Bits(absl::Span<const uint16_t> bits,
                                                    std::vector<int64_t> shape) {
  return FromHalfBits(bits, std::move(shape), DType::kBFloat16);
}

HostTensor HostTensor::Zeros(DType dtype, std::vector<int64_t> shape) {
  HostTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  AssignZeros(t.data,
              static_cast<size_t>(std::max<int64_t>(t.num_elements(), 0)) * DTypeBytes(dtype));
  return t;
}

int64_t HostTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status HostTensor::Validate() const {
  KVQ_ASSIGN_OR_RETURN(const int64_t n, CountElements(shape));
  const int64_t want = n * static_cast<int64_t>(DTypeBytes(dtype));
  if (static_cast<int64_t>(data.size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor [", absl::StrJoin(shape, ", "), "] of ", DTypeName(dtype), " needs ", want,
        " bytes, has ", data.size()));
  }
  return absl::OkStatus();
}

std::vector<float> HostTensor::ToFloats() const {
  const int64_t n = std::min<int64_t>(num_elements(), data.size() / DTypeBytes(dtype));
  std::vector<float> out(std::max<int64_t>(n, 0));
  ConvertToFloats(bytes(), dtype, out.size(), out.data());
  return out;
}

std::vector<uint16_t> HostTensor::ToFp16Bits() const { return HalfBits(*this, DType::kFloat16); }

std::vector<uint16_t> HostTensor::ToBf16Bits() const { return HalfBits(*this, DType::kBFloat16); }

HostTensor HostTensor::Cast(DType to) const {
  if (to == dtype) return *this;
  HostTensor t;
  t.dtype = to;
  t.shape = shape;
  const std::vector<float> f = ToFloats();
  t.data.resize(f.size() * DTypeBytes(to));
  ConvertFromFloats(f.data(), f.size(), to, t.mutable_bytes());
  return t;
}

std::string HostTensor::DebugString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "] ", DTypeName(dtype));
}

v1::DType ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::DTYPE_FP32;
    case DType::kFloat16:
      return v1::DTYPE_FP16;
    case DType::kBFloat16:
      return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProtoDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return DType::kFloat32;
    case v1::DTYPE_FP16:
      return DType::kFloat16;
    case v1::DTYPE_BF16:
      return DType::kBFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", static_cast<int>(dtype), " is not fp32, fp16 or bf16"));
  }
}

void ToProto(const HostTensor& t, v1::Tensor* out) {
  out->set_dtype(ToProtoDType(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  out->set_data(t.data);
}

void ToProto(HostTensor&& t, v1::Tensor* out) {
  out->set_dtype(ToProtoDType(t.dtype));
  out->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
  out->mutable_data()->swap(t.data);
}

namespace {

absl::StatusOr<HostTensor> FromProtoImpl(const v1::Tensor& t, absl::string_view field,
                                         std::string* data) {
  absl::StatusOr<DType> dtype = FromProtoDType(t.dtype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".", dtype.status().message()));
  }
  HostTensor h;
  h.dtype = *dtype;
  h.shape.assign(t.shape().begin(), t.shape().end());
  h.data.swap(*data);
  if (absl::Status st = h.Validate(); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", st.message()));
  }
  return h;
}

}  // namespace

absl::StatusOr<HostTensor> FromProto(const v1::Tensor& t, absl::string_view field) {
  std::string copy = t.data();
  return FromProtoImpl(t, field, &copy);
}

absl::StatusOr<HostTensor> FromProto(v1::Tensor&& t, absl::string_view field) {
  std::string taken;
  taken.swap(*t.mutable_data());
  return FromProtoImpl(t, field, &taken);
}

}  // namespace kvq
