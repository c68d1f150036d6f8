// Fused decode attention on the device, for every scheme: the kernels read
// quantized pages through a DeviceStreamView and dequantize inside the
// attention loop, so no fp16 copy of the KV is ever written to global
// memory. One launch covers a whole request's tasks (sequence x KV head);
// each task's key range is split into chunks sized from the batch and the
// SM count (flash-decoding) whose partials a second kernel merges.
// docs/CUDA.md "Kernels" has the design, "Decode attention" the error
// contract.
#ifndef KVQ_KERNELS_CUDA_CUDA_ATTENTION_H_
#define KVQ_KERNELS_CUDA_CUDA_ATTENTION_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/hd/device_stream_view.h"

namespace kvq {

// One AttentionTask (kernels/backend.h) with device pointers: the same
// addressing (query i, head g at q + i * q_stride + g * head_dim; lse + i *
// lse_stride + g) and the same causal rule.
struct DeviceAttentionTask {
  DeviceStreamView stream;
  int key_begin = 0;
  int key_end = 0;  // Resolved: no -1.
  int num_queries = 1;
  const float* q = nullptr;
  int q_stride = 0;
  const int32_t* q_positions = nullptr;  // Device, or null: every key visible.
  float* out = nullptr;
  int out_stride = 0;
  float* lse = nullptr;
  int lse_stride = 0;
};

// What one launch needs to know about all of its tasks (they share the
// head_dim, the GQA group and the layout's kind).
struct DecodeAttentionShape {
  int num_tasks = 0;
  int head_dim = 0;
  int group_size = 1;
  float softmax_scale = 0.0f;  // Resolved: > 0.
  int max_rows = 0;            // Largest num_queries * group_size of a task.
  int max_keys = 0;            // Largest key_end - key_begin of a task.
  // Streaming multiprocessors of the device (cudaDevAttrMultiProcessorCount,
  // DeviceInfo::multiprocessors): the splits are sized to fill them.
  int sm_count = 0;
  // Largest page_tokens and page_bytes of the tasks' layouts: splits start
  // on page boundaries, and each block stages whole pages in shared memory.
  int max_page_tokens = 1;
  int max_page_bytes = 0;
  // Run QK^T and PV on tensor cores with fp16 operands (the GQA group as
  // MMA rows). Set for packed codes of 4 bits and below; UseTensorCores()
  // says when a layout may.
  bool tensor_cores = false;
};

// The kernels are compiled per head_dim: 64, 96, 128 and 256. GQA groups
// of up to kMaxAttentionGroup query heads per KV head (the rows of a task
// are tiled 16 at a time).
inline constexpr int kMaxAttentionGroup = 64;
bool DecodeAttentionTakesHeadDim(int head_dim);

// Whether the tensor-core kernel takes this layout: both sides packed
// codes of at most 4 bits, and a head_dim the warps' tiles divide.
bool UseTensorCores(const PageLayout& layout);

// Keys per split: enough splits that the launch has about two blocks per
// SM (batch x row tiles x splits), at least 256 keys, a multiple of
// max_page_tokens, and at most 1024 splits.
int DecodeAttentionSplitTokens(const DecodeAttentionShape& shape);
// Splits of the longest task: the grid's x extent.
int DecodeAttentionSplits(const DecodeAttentionShape& shape);
// Bytes of device workspace a launch of `shape` needs for its partials.
size_t DecodeAttentionWorkspaceBytes(const DecodeAttentionShape& shape);

// Enqueues the split kernel and the merge kernel on `stream`. `tasks` is a
// device array of shape.num_tasks tasks; `workspace` holds at least
// DecodeAttentionWorkspaceBytes(shape) bytes. Only enqueues: results are
// ready when the stream reaches them. INVALID_ARGUMENT names the field and
// its limit for a shape the kernels do not take; launch errors come back
// through CudaStatus.
absl::Status LaunchDecodeAttention(const DeviceAttentionTask* tasks,
                                   const DecodeAttentionShape& shape, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_CUDA_ATTENTION_H_
