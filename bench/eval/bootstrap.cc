#include "bench/eval/bootstrap.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace kvq::eval {
namespace {

struct Sums {
  double dnll = 0.0, kl = 0.0;
  int64_t scored = 0;
  void Add(const WindowScore& w) {
    dnll += w.nll - w.ref_nll;
    kl += w.kl;
    scored += w.scored;
  }
  double DeltaPplPct() const { return scored ? 100.0 * std::expm1(dnll / scored) : 0.0; }
  double KlMean() const { return scored ? kl / scored : 0.0; }
};

// The q-quantile of sorted `v` (linear interpolation between ranks).
double Quantile(const std::vector<double>& v, double q) {
  const double at = q * (v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(at));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (at - lo) * (v[hi] - v[lo]);
}

}  // namespace

PooledScore Pool(const std::vector<WindowScore>& windows, int resamples, uint64_t seed) {
  Sums all;
  for (const WindowScore& w : windows) all.Add(w);
  PooledScore out;
  out.delta_ppl_pct = all.DeltaPplPct();
  out.kl_mean = all.KlMean();
  if (windows.size() < 2 || resamples < 1) return out;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, windows.size() - 1);
  std::vector<double> dppl(resamples), kl(resamples);
  for (int b = 0; b < resamples; ++b) {
    Sums s;
    for (size_t i = 0; i < windows.size(); ++i) s.Add(windows[pick(rng)]);
    dppl[b] = s.DeltaPplPct();
    kl[b] = s.KlMean();
  }
  std::sort(dppl.begin(), dppl.end());
  std::sort(kl.begin(), kl.end());
  out.has_interval = true;
  out.delta_ppl_pct_ci = {Quantile(dppl, 0.025), Quantile(dppl, 0.975)};
  out.kl_mean_ci = {Quantile(kl, 0.025), Quantile(kl, 0.975)};
  return out;
}

}  // namespace kvq::eval
