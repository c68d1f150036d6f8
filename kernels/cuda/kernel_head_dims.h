// The head_dims the device kernels are compiled for. head_dim is a
// template parameter of the attention and quantize kernels, so every
// division by it in a loop is by a constant; a launch picks the instance
// with WithKernelHeadDim and refuses any other head_dim.
#ifndef KVQ_KERNELS_CUDA_KERNEL_HEAD_DIMS_H_
#define KVQ_KERNELS_CUDA_KERNEL_HEAD_DIMS_H_

#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvq {

inline constexpr int kKernelHeadDims[] = {64, 96, 128, 256};

constexpr bool KernelTakesHeadDim(int head_dim) {
  for (int d : kKernelHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

// "64, 96, 128, 256", for error messages.
inline std::string KernelHeadDimsText() {
  std::string s;
  for (int d : kKernelHeadDims) absl::StrAppend(&s, s.empty() ? "" : ", ", d);
  return s;
}

// OK, or INVALID_ARGUMENT "<field> must be one of 64, 96, 128, 256, got N".
inline absl::Status CheckKernelHeadDim(absl::string_view field, int head_dim) {
  if (KernelTakesHeadDim(head_dim)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be one of ", KernelHeadDimsText(), ", got ", head_dim));
}

// f(std::integral_constant<int, head_dim>{}); head_dim must be one of
// kKernelHeadDims (KernelTakesHeadDim).
template <class F>
decltype(auto) WithKernelHeadDim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 96:
      return f(std::integral_constant<int, 96>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    default:
      return f(std::integral_constant<int, 256>{});
  }
}

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_KERNEL_HEAD_DIMS_H_
