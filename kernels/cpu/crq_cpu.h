// crq on the "cpu" backend (docs/KERNELS.md, "crq"): coding rows with the
// shared per-element math (kernels/hd/crq_hd.h) and attention in the coded
// space: each code row decoded to levels once per block of queries (a
// decode step's GQA group, or up to 48 rows of a prefill chunk's queries)
// and scored by all of them a tile of keys at a time.
#ifndef KVQ_KERNELS_CPU_CRQ_CPU_H_
#define KVQ_KERNELS_CPU_CRQ_CPU_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"

namespace kvq::cpu {

// KernelBackend::QuantizeRows / DequantizeRows of a crq side (coded
// coordinates in, g * level out).
void QuantizeCrqRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                     int row0);
void DequantizeCrqRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                       float* out);

// Attention of crq tasks (every task's stream is crq; validated by the
// caller). Key ranges are split into chunks that merge by log-sum-exp and,
// when `parallel` (the backend's AttendUsesThreads: small calls lose more to
// waking threads than they gain), run on OpenMP threads; every page is passed
// to options.page_check before it is read.
void AttendCrq(absl::Span<const AttentionTask> tasks, const AttentionOptions& options,
               bool parallel);

}  // namespace kvq::cpu

#endif  // KVQ_KERNELS_CPU_CRQ_CPU_H_
