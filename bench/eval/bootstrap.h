// Pooled perplexity change and KL over evaluation windows, with percentile
// bootstrap intervals over windows: a difference between two schemes is
// only claimed where it is larger than the window-to-window noise.
#ifndef KVQ_BENCH_EVAL_BOOTSTRAP_H_
#define KVQ_BENCH_EVAL_BOOTSTRAP_H_

#include <cstdint>
#include <vector>

namespace kvq::eval {

// One window of one scheme, paired with the fp16 reference on the same
// window and metric.
struct WindowScore {
  double nll = 0.0;      // Summed over the window's scored positions.
  double ref_nll = 0.0;  // The reference's, on the same positions.
  double kl = 0.0;       // Summed KL(reference || scheme).
  int64_t scored = 0;
};

struct Interval {
  double lo = 0.0, hi = 0.0;
};

struct PooledScore {
  double delta_ppl_pct = 0.0;  // 100 * (exp((nll - ref_nll) / scored) - 1), pooled.
  double kl_mean = 0.0;        // Pooled KL per scored position.
  // 95% percentile intervals of both over `resamples` resamples of the
  // windows with replacement; set only with at least two windows.
  bool has_interval = false;
  Interval delta_ppl_pct_ci, kl_mean_ci;
};

// Deterministic for a given `seed`.
PooledScore Pool(const std::vector<WindowScore>& windows, int resamples, uint64_t seed);

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_BOOTSTRAP_H_
