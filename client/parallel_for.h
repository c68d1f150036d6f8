// A fork-join loop for the client library's per-stream work (quantizing
// before an append, dequantizing each message of a fetch). Streams are
// independent and few (layers x KV heads); results must not depend on the
// thread count.
//
// The helpers come from one process-wide pool that is started on first use
// and kept: a fetch calls this once per message, and a thread started per
// call (as this did before) cost a clone, a join and, on every new thread,
// fresh thread-local scratch faulted in again.
#ifndef KVQ_CLIENT_PARALLEL_FOR_H_
#define KVQ_CLIENT_PARALLEL_FOR_H_

#include <functional>

namespace kvq {

// Runs fn(i) for every i in [0, count) on up to `threads` threads (<= 0: one
// per hardware thread), the calling thread included; returns when all are
// done. fn must be safe to call concurrently for different i. Calls made
// while the pool serves another (from another thread, or from inside fn)
// start threads of their own instead, so they never wait on each other.
void ParallelFor(int count, int threads, const std::function<void(int)>& fn);

}  // namespace kvq

#endif  // KVQ_CLIENT_PARALLEL_FOR_H_
