// `kvq-bench checksums`: what verifying page checksums costs a read.
//
// One layer of a long context (8 KV / 32 query heads, head_dim 128) is
// stored per scheme in one in-process store; two services share it, one
// verifying every read (--verify_fraction=1) and one none (0). Their calls
// alternate, so both see the same machine state: Attend (one query, the
// handler called directly), and FetchDequant dense (fp16) and raw over
// loopback gRPC. XXH3's own hash rate over the same pages, measured in the
// same run, bounds the cost: verifying adds about the call's sealed page
// bytes / that rate.
#ifndef KVQ_BENCH_CHECKSUM_BENCH_H_
#define KVQ_BENCH_CHECKSUM_BENCH_H_

#include <string>

namespace kvq {

// Runs the benchmark and prints its table; returns the exit code.
int ChecksumsMain(const std::string& command);

}  // namespace kvq

#endif  // KVQ_BENCH_CHECKSUM_BENCH_H_
