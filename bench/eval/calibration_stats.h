// Calibration of a calibrated (crq) scheme from a model run: per layer and KV
// head, the channel means of pre-RoPE keys and of values, key scales that
// minimize the expected error of q.k and value scales that minimize the
// error after the output projection. docs/QUALITY.md derives the scales.
#ifndef KVQ_BENCH_EVAL_CALIBRATION_STATS_H_
#define KVQ_BENCH_EVAL_CALIBRATION_STATS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "bench/eval/attention_cache.h"
#include "bench/eval/llama_model.h"
#include "kernels/calibration.h"

namespace kvq::eval {

// Key scales, one per channel, equal on both channels of each RoPE pair of
// `rope` (channels past its rotary_dim are scaled alone): with
// K_j = sum over the pair's channels of key_var and Q_j the same of
// query_sq, s_j = (K_j / Q_j)^(1/4), normalized to geometric mean 1. A
// zero moment is raised to 1e-6 of the mean so every scale is finite.
std::vector<float> KeyScales(absl::Span<const double> key_var, absl::Span<const double> query_sq,
                             const RopeConfig& rope, int head_dim);
// Value scales: s_c = (value_var_c / out_sq_c)^(1/4), normalized to
// geometric mean 1 (out_sq_c: the squared norm of the output-projection
// columns channel c feeds, over the group's query heads).
std::vector<float> ValueScales(absl::Span<const double> value_var,
                               absl::Span<const double> out_sq);

// Sums of first and second moments per (layer, KV head) over the tokens a
// forward pass appends.
class CalibrationStats {
 public:
  explicit CalibrationStats(const CacheShape& shape);
  // k (pre-RoPE) and v: [n][kv_heads * head_dim]; q (post-RoPE: pair norms
  // do not depend on the position): [n][q_heads * head_dim].
  void Add(int layer, int n, const float* k, const float* v, const float* q);
  // The calibration named `name`; `out_sq` per layer: [q_heads *
  // head_dim], the squared norm of each output-projection column.
  // FAILED_PRECONDITION when a layer saw no tokens.
  absl::StatusOr<ModelCalibration> Finish(const std::string& name,
                                          const std::vector<std::vector<double>>& out_sq) const;

 private:
  struct Sums {
    std::vector<double> k, k2, v, v2, q2;  // [head_dim] each
  };
  CacheShape shape_;
  std::vector<Sums> sums_;         // [layer][kv_head]
  std::vector<int64_t> tokens_;    // [layer]
};

// Runs `tokens` through `model` (chunked prefill, fp16 cache) and returns
// the calibration named `name`.
absl::StatusOr<ModelCalibration> ComputeCalibration(LlamaModel& model,
                                                    absl::Span<const int32_t> tokens, int chunk,
                                                    const std::string& name);

// What a calibration file records as its model: the file name and the
// attention shape, e.g. "SmolLM2-135M.gguf layers=30 kv_heads=3 q_heads=9
// head_dim=64 rope=adjacent/64/100000".
std::string ModelFingerprint(const std::string& model_file, const LlamaConfig& config);

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_CALIBRATION_STATS_H_
