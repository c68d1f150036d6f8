// A small reader/writer for NumPy .npy files, as the kvq CLI uses them.
//
// Supported: format versions 1.0 and 2.0, little-endian float32 ('<f4') and
// float16 ('<f2'), C order, any rank. Everything else (other dtypes,
// big-endian, Fortran order, version 3.0, pickled objects, truncated or
// oversized data) is rejected with INVALID_ARGUMENT naming what was found.
// The writer emits version 1.0 (2.0 only for a header over 64 KiB) with the
// header padded to a multiple of 64 bytes, as NumPy does.
#ifndef KVQ_CLIENT_NPY_H_
#define KVQ_CLIENT_NPY_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/host_tensor.h"

namespace kvq {

absl::StatusOr<HostTensor> ParseNpy(absl::string_view bytes);
// NOT_FOUND when the file cannot be opened; ParseNpy's errors prefixed with
// the path.
absl::StatusOr<HostTensor> ReadNpy(const std::string& path);

// INVALID_ARGUMENT for bf16 (NumPy has no bfloat16: cast first) or a tensor
// whose data does not match its shape.
absl::StatusOr<std::string> SerializeNpy(const HostTensor& tensor);
absl::Status WriteNpy(const std::string& path, const HostTensor& tensor);

}  // namespace kvq

#endif  // KVQ_CLIENT_NPY_H_
