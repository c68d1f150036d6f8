// Dequantization of GGML weight tensors (as stored in GGUF files) to fp32.
//
// Block formats (32 elements per block; `d`, `m` are IEEE fp16, `qs[j]` holds
// element j in its low nibble and element j + 16 in its high nibble, `qh` is
// a little-endian u32 whose bit j is the fifth bit of element j):
//   Q4_0 {d, qs[16]}          x = (q - 8) * d
//   Q4_1 {d, m, qs[16]}       x = q * d + m
//   Q5_0 {d, qh, qs[16]}      x = (q - 16) * d
//   Q5_1 {d, m, qh, qs[16]}   x = q * d + m
//   Q8_0 {d, int8 q[32]}      x = q * d
// F32, F16 and BF16 are plain arrays. The arithmetic is done in fp32 in that
// order (no fused multiply-add) so that results equal ggml's reference
// dequantize_row_* and the gguf Python package bit for bit.
#ifndef KVQ_BENCH_EVAL_GGML_DEQUANT_H_
#define KVQ_BENCH_EVAL_GGML_DEQUANT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/eval/gguf_file.h"

namespace kvq::eval {

// Bytes of `n` elements of `type`. INVALID_ARGUMENT when n is negative or not
// a multiple of the type's block size (the message names the type and the
// block size), or for a type id GGML does not define. Works for every type
// GgmlTypeInfo knows, including those DequantizeRow cannot decode.
absl::StatusOr<size_t> GgmlRowBytes(GgmlType type, int64_t n);

// True for the types DequantizeRow decodes.
bool CanDequantize(GgmlType type);

// Dequantizes n elements (a multiple of the block size) at `src` to fp32 at
// `dst`. UNIMPLEMENTED naming the type for types it cannot decode (K-quants,
// I-quants, ...); INVALID_ARGUMENT for a bad n as GgmlRowBytes.
absl::Status DequantizeRow(GgmlType type, const uint8_t* src, int64_t n, float* dst);

// A whole tensor to fp32 in its storage order, dims[0] contiguous (so a
// [in, out] GGUF matrix becomes row-major [out][in]). Rows are decoded in
// parallel (OpenMP). Errors as DequantizeRow, plus INVALID_ARGUMENT when
// t.bytes does not match the dims or t.data is null.
absl::StatusOr<std::vector<float>> DequantizeTensor(const GgufTensor& t);

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_GGML_DEQUANT_H_
