// How fast this machine's cores issue the integer dot product the quantized
// attention kernels are built on (512-bit vpdpbusd, AVX-512 VNNI), measured
// beside the kernels: the floor under a kernel that must issue a given count
// of them, whatever else it does.
#ifndef KVQ_BENCH_DOT_RATE_H_
#define KVQ_BENCH_DOT_RATE_H_

#include <vector>

namespace kvq {

struct DotRate {
  // Seconds per instruction on each thread while `threads` threads issue
  // independent chains at once (median over the passes); 0 where the CPU has
  // no AVX-512 VNNI.
  double seconds = 0.0;
  std::vector<double> passes;
  int threads = 0;
};

// `passes` timed passes of 2^24 instructions per thread each.
DotRate MeasureDotRate(int passes, int threads);

// The vpdpbusd one decode call of the kivi integer paths issues per token of
// a KV head with `rows` query rows (GQA group, padded as the kernels pad it
// to 1, 2, 4 or 8) at head_dim `d`: the key scores take the int16 query as
// two signed bytes (2 rows x d / 64 instructions per token), the values the
// 15-bit weights likewise; kernels/cpu/simd_attention.cc, KiviKeyScoresLanes
// and KiviValueDot.
double KiviDotsPerToken(int rows, int d);

}  // namespace kvq

#endif  // KVQ_BENCH_DOT_RATE_H_
