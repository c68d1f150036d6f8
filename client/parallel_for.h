// A minimal fork-join loop for the client library's per-stream work
// (quantizing before an append, dequantizing after a fetch). Streams are
// independent and few (layers x KV heads), so plain threads and an atomic
// counter are enough; results must not depend on the thread count.
#ifndef KVQ_CLIENT_PARALLEL_FOR_H_
#define KVQ_CLIENT_PARALLEL_FOR_H_

#include <functional>

namespace kvq {

// Runs fn(i) for every i in [0, count) on up to `threads` threads (<= 0: one
// per hardware thread), the calling thread included; returns when all are
// done. fn must be safe to call concurrently for different i.
void ParallelFor(int count, int threads, const std::function<void(int)>& fn);

}  // namespace kvq

#endif  // KVQ_CLIENT_PARALLEL_FOR_H_
