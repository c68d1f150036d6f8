// The scalar reference kernels as free functions.
//
// RefBackend() is a thin wrapper over these; the optimized "cpu" backend calls
// them for the rare cases it does not specialise, so both backends share one
// definition of the slow path.
#ifndef KVQ_KERNELS_CPU_REF_KERNELS_H_
#define KVQ_KERNELS_CPU_REF_KERNELS_H_

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kernels/page_layout.h"

namespace kvq {

// KernelBackend::QuantizeRows of the reference: `n` float rows (stored basis)
// into rows [row0, row0 + n) of `page`.
void QuantizeRowsRef(const KvStream& stream, Side side, const float* rows, int n,
                     uint8_t* page, int row0);

// KernelBackend::DequantizeRows of the reference: page rows [row0, row0 + n)
// to floats (stored basis, outliers applied).
void DequantizeRowsRef(const KvStream& stream, Side side, const uint8_t* page, int row0,
                       int n, float* out);

// Attention of one task with fp64 accumulation. The task must have passed
// ValidateAttention() with the same options.
void AttendRef(const AttentionTask& task, const AttentionOptions& options);

}  // namespace kvq

#endif  // KVQ_KERNELS_CPU_REF_KERNELS_H_
