// crq on the device (docs/CUDA.md "crq"): coding rows of calibrated,
// rotated coordinates into pages, reading them back, and decode attention
// in the coded space. Every value comes from kernels/hd/crq_hd.h, the
// functions the "cuda_host" backend runs on the CPU (host_quantize.cc,
// host_crq_attention.cc), which the typed suites check in every build.
//
// What the host does once per call: KvStream maps appended rows to coded
// coordinates (CrqTransform::Forward) before QuantizeRows, as for every
// backend, and the cuda backend transforms each query row once
// (CrqTransform::AttentionQuery); each head's calibration and Hadamard
// signs are uploaded once (CrqDeviceStatistics).
#ifndef KVQ_KERNELS_CUDA_CUDA_CRQ_H_
#define KVQ_KERNELS_CUDA_CUDA_CRQ_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_quantize.h"
#include "kernels/hd/crq_hd.h"

namespace kvq {

// head_dims the crq kernels are compiled for: the powers of two of
// kKernelHeadDims (crq's Hadamard rotation needs one).
bool CrqKernelTakesHeadDim(int head_dim);

// Rows of coded coordinates (fp32, [n][head_dim], device) coded into
// their page rows: hd::CrqStoreRow per row. `codebooks` is a device copy
// of CrqCodebooks(). Jobs as LaunchQuantizeRows validates them.
absl::Status LaunchCrqQuantizeRows(const DeviceQuantSide& side,
                                   const hd::CrqCodebooks* codebooks,
                                   absl::Span<const QuantizeJob> jobs, cudaStream_t stream);
// Page rows back to coded coordinates (gain x level, hd::CrqDequant).
absl::Status LaunchCrqDequantizeRows(const DeviceQuantSide& side, DeviceRowType output,
                                     const hd::CrqCodebooks* codebooks,
                                     absl::Span<const DequantizeJob> jobs, cudaStream_t stream);

// One crq AttentionTask on the device. task.q holds each row's query with
// the softmax scale folded in (CrqTransform::AttentionQuery's q), rows
// compacted (q_stride = group_size * head_dim), and task.stream.rotation_signs
// is null: the split kernel rotates back itself.
struct DeviceCrqTask {
  DeviceAttentionTask task;
  const float* qr = nullptr;  // The rows' H (s_k q), laid out as task.q.
  // [4][head_dim]: key_mean, value_mean, value_scale, the Hadamard signs.
  const float* calibration = nullptr;
};

// Enqueues the crq split kernel and the merge kernel. shape as for
// LaunchDecodeAttention (softmax_scale is ignored: it is in the queries;
// tensor_cores must be false), workspace DecodeAttentionWorkspaceBytes.
// INVALID_ARGUMENT names the field for a shape the kernels do not take.
absl::Status LaunchCrqAttention(const DeviceCrqTask* tasks, const DecodeAttentionShape& shape,
                                const hd::CrqCodebooks* codebooks, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_CUDA_CRQ_H_
