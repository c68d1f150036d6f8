// "cuda_host": the CUDA backend's per-element math (kernels/hd/*_hd.h)
// composed in plain loops on the CPU. It runs the exact functions the
// device kernels call, so the typed suites test them against the reference
// in every build, with or without a GPU.
#ifndef KVQ_KERNELS_CUDA_HOST_PROGRAM_BACKEND_H_
#define KVQ_KERNELS_CUDA_HOST_PROGRAM_BACKEND_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"

namespace kvq {

const KernelBackend& CudaHostBackend();

// Page `p` of a stream as host code may address it. Every cuda_host kernel
// reaches page bytes through this (or through a page pointer the backend
// interface passes, translated the same way), never stream.page(p)
// directly, so that cuda_host can also stand in for a device whose pages
// the host cannot address.
const uint8_t* HostPagePointer(const KvStream& s, int p);
uint8_t* HostPagePointer(const KvStream& s, uint8_t* page);

// The pieces, one file each (host_quantize.cc, host_attention.cc).
void HostQuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                      int row0);
void HostDequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                        float* out);
absl::Status HostAttend(absl::Span<const AttentionTask> tasks, const AttentionOptions& options);
// One crq task (host_crq_attention.cc); HostAttend sends crq tasks there.
void HostAttendCrq(const AttentionTask& task, const AttentionOptions& options);

}  // namespace kvq

#endif  // KVQ_KERNELS_CUDA_HOST_PROGRAM_BACKEND_H_
