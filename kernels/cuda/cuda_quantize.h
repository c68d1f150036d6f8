// Quantize (append) and dequantize (fetch) on the device: page rows in
// device memory written from device rows, and read back to device rows.
//
// One launch runs a batch of jobs (a page, its rows, the input or output
// rows, the stream's extras), so an append over every layer and KV head of
// a request is one launch per side. The launch functions only enqueue on
// `stream`; the caller decides when to synchronise. The bytes written are
// QuantizeRowsRef's and the floats read DequantizeRowsRef's: the kernels run
// the quant_hd.h / dequant_hd.h functions that the "cuda_host" backend runs
// on the CPU (docs/CUDA.md, "Quantize and dequantize on the device").
#ifndef KVQ_KERNELS_CUDA_CUDA_QUANTIZE_H_
#define KVQ_KERNELS_CUDA_CUDA_QUANTIZE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/cpu/range_fit.h"
#include "kernels/hd/dequant_hd.h"
#include "kernels/page_layout.h"
#include "kernels/quant_spec.h"

namespace kvq {

// Element type of the device rows a launch reads or writes.
enum class DeviceRowType { kFloat32, kFloat16 };

// What every job of one launch shares: the streams' layout and scheme, one side.
struct DeviceQuantSide {
  PageLayout layout;
  Side side = Side::kKey;
  bool nuq = false;
  bool fit = false;  // Fitted ranges (`fit`, keys only: FitsRanges).
};
inline DeviceQuantSide DeviceQuantSideOf(const QuantSpec& spec, const PageLayout& layout,
                                         Side side) {
  return {layout, side, spec.nuq, FitsRanges(spec, side)};
}

// Rows [row0, row0 + n) of one page from `rows` ([n][head_dim], device).
// For block-quantized sides (kivi) row0 and n are multiples of the block.
struct QuantizeJob {
  uint8_t* page = nullptr;
  const void* rows = nullptr;
  hd::SideExtras extras;  // Device nuq levels of this stream's side; fp8 scale.
  int row0 = 0;
  int n = 0;
};

// Rows [row0, row0 + n) of one page to `out` (device; row r at
// out + r * out_stride elements, out_stride 0 meaning head_dim).
struct DequantizeJob {
  const uint8_t* page = nullptr;
  void* out = nullptr;
  hd::SideExtras extras;
  int row0 = 0;
  int n = 0;
  int out_stride = 0;
};

// Jobs one kernel launch carries in its parameters (the batch is passed by
// value, so nothing is copied to the device first); longer spans take one
// launch per this many jobs.
inline constexpr int kMaxJobsPerLaunch = 512;

// INVALID_ARGUMENT naming the job and the field when a job cannot run
// (null pointers, rows outside the page, a partial block, nuq without
// levels, an fp8 scale that is not a positive finite number); OK for an
// empty span. Host-side checks only: the pointers are not dereferenced.
absl::Status ValidateQuantizeJobs(const DeviceQuantSide& side, absl::Span<const QuantizeJob> jobs);
absl::Status ValidateDequantizeJobs(const DeviceQuantSide& side,
                                    absl::Span<const DequantizeJob> jobs);

// Validates, then enqueues the kernels on `stream` (no synchronisation).
// Launch failures come back through CudaStatus.
absl::Status LaunchQuantizeRows(const DeviceQuantSide& side, DeviceRowType input,
                                absl::Span<const QuantizeJob> jobs, cudaStream_t stream);
absl::Status LaunchDequantizeRows(const DeviceQuantSide& side, DeviceRowType output,
                                  absl::Span<const DequantizeJob> jobs, cudaStream_t stream);

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_CUDA_QUANTIZE_H_
