#include "bench/eval/eval_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/codebook_learner.h"
#include "kernels/status_macros.h"

namespace kvq::eval {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// Forward of `tokens` on `cache`, timed.
absl::StatusOr<double> TimedForward(LlamaModel& model, absl::Span<const int32_t> tokens,
                                    AttentionCache* cache, bool all_logits,
                                    std::vector<float>* logits) {
  const auto t0 = std::chrono::steady_clock::now();
  KVQ_RETURN_IF_ERROR(model.Forward(tokens, cache, all_logits, logits));
  return Seconds(t0);
}

// Records the K/V rows the model appends (in the basis `spec` stores them:
// pre-RoPE keys for pre_rope schemes) while an fp16 kvq cache attends.
class RecordingCache : public AttentionCache {
 public:
  RecordingCache(const CacheShape& shape, bool keys_before_rope,
                 std::unique_ptr<AttentionCache> inner)
      : shape_(shape),
        keys_before_rope_(keys_before_rope),
        rope_(shape.rope, shape.head_dim),
        inner_(std::move(inner)),
        k_(shape.num_layers),
        v_(shape.num_layers) {}

  bool KeysBeforeRope() const override { return keys_before_rope_; }
  absl::Status AppendAttend(int layer, int n, const float* k, const float* v, const float* q,
                            float* out) override {
    const int row = shape_.num_kv_heads * shape_.head_dim;
    const int start = inner_->num_tokens();
    k_[layer].insert(k_[layer].end(), k, k + static_cast<size_t>(n) * row);
    v_[layer].insert(v_[layer].end(), v, v + static_cast<size_t>(n) * row);
    if (!keys_before_rope_) return inner_->AppendAttend(layer, n, k, v, q, out);
    std::vector<float> rotated(k, k + static_cast<size_t>(n) * row);
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        rope_.Apply(&rotated[static_cast<size_t>(i) * row + h * shape_.head_dim], start + i);
      }
    }
    return inner_->AppendAttend(layer, n, rotated.data(), v, q, out);
  }
  int num_tokens() const override { return inner_->num_tokens(); }
  // Calibration runs one straight prefill and never forks.
  absl::StatusOr<std::unique_ptr<AttentionCache>> Fork() const override {
    return absl::FailedPreconditionError("RecordingCache: calibration does not fork");
  }
  absl::StatusOr<ByteBreakdown> Bytes() const override { return inner_->Bytes(); }

  const std::vector<float>& keys(int layer) const { return k_[layer]; }
  const std::vector<float>& values(int layer) const { return v_[layer]; }

 private:
  CacheShape shape_;
  bool keys_before_rope_;
  Rope rope_;
  std::unique_ptr<AttentionCache> inner_;
  std::vector<std::vector<float>> k_, v_;
};

}  // namespace

void LogSoftmax(const float* logits, int n, float* out) {
  float max = logits[0];
  for (int i = 1; i < n; ++i) max = std::max(max, logits[i]);
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - max);
  const double lse = max + std::log(sum);
  for (int i = 0; i < n; ++i) out[i] = static_cast<float>(logits[i] - lse);
}

double KlDivergence(const float* log_p, const float* log_q, int n) {
  double kl = 0.0;
  for (int i = 0; i < n; ++i) {
    const double lp = log_p[i];
    kl += std::exp(lp) * (lp - log_q[i]);
  }
  return std::max(0.0, kl);
}

int ArgMax(const float* x, int n) { return static_cast<int>(std::max_element(x, x + n) - x); }

void ScorePositions(absl::Span<const int32_t> window, int pos, int rows, int vocab,
                    const std::vector<float>& logits, const Reference* reference,
                    Reference* reference_out, std::vector<float>* lp, WindowResult* r) {
  const int C = static_cast<int>(window.size());
  const int V = vocab;
  lp->resize(static_cast<size_t>(rows) * V);
  double nll = 0.0, kl = 0.0;
  int64_t scored = 0;
#pragma omp parallel for schedule(static) reduction(+ : nll, kl, scored)
  for (int i = 0; i < rows; ++i) {
    const int p = pos + i;
    float* row = &(*lp)[static_cast<size_t>(i) * V];
    LogSoftmax(&logits[static_cast<size_t>(i) * V], V, row);
    if (p >= C - 1) continue;  // The last token predicts nothing in the window.
    nll -= row[window[p + 1]];
    ++scored;
    const size_t at = static_cast<size_t>(p) * V;
    if (reference) kl += KlDivergence(&reference->logprobs[at], row, V);
    if (reference_out) std::copy_n(row, V, &reference_out->logprobs[at]);
  }
  r->nll_sum += nll;
  r->kl_sum += kl;
  r->scored += scored;
}

absl::StatusOr<WindowResult> RunWindow(LlamaModel& model, absl::Span<const int32_t> window,
                                       AttentionCache* cache, const WindowOptions& options,
                                       const Reference* reference, Reference* reference_out) {
  const int C = static_cast<int>(window.size());
  const int V = model.config().vocab;
  if (reference && reference->logprobs.size() != static_cast<size_t>(C - 1) * V) {
    return absl::InvalidArgumentError("reference: computed for a different window");
  }
  const int G = reference ? reference->gen_tokens : std::min(options.gen_tokens, C / 2);
  if (C < 2 || G < 1 || options.chunk < 1) {
    return absl::InvalidArgumentError(absl::StrCat("window: ", C, " tokens is too short"));
  }
  // Teacher forcing needs the reference's tokens: a reference that did not
  // generate leaves this run's generation out too.
  const bool generate =
      options.generate && (!reference || static_cast<int>(reference->greedy.size()) == G);
  if (reference_out) {
    reference_out->logprobs.assign(static_cast<size_t>(C - 1) * V, 0.0f);
    reference_out->greedy.clear();
    reference_out->gen_tokens = G;
  }
  const int prefix = C - G;
  WindowResult r;
  r.tokens = C;
  std::vector<float> logits, lp;
  std::vector<float> last_lp(V);  // Next-token log-probs after the prefix.

  auto score = [&](int pos, int rows) {
    ScorePositions(window, pos, rows, V, logits, reference, reference_out, &lp, &r);
    if (pos <= prefix - 1 && prefix - 1 < pos + rows) {
      std::copy_n(&lp[static_cast<size_t>(prefix - 1 - pos) * V], V, last_lp.begin());
    }
  };
  auto prefill = [&](int begin, int end) -> absl::Status {
    for (int pos = begin; pos < end; pos += options.chunk) {
      const int n = std::min(options.chunk, end - pos);
      KVQ_ASSIGN_OR_RETURN(double s, TimedForward(model, window.subspan(pos, n), cache, true,
                                                  &logits));
      r.prefill_seconds += s;
      score(pos, n);
    }
    return absl::OkStatus();
  };

  KVQ_RETURN_IF_ERROR(prefill(0, prefix));
  if (generate) {
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<AttentionCache> fork, cache->Fork());
    std::vector<float> step_lp = last_lp;
    for (int s = 0; s < G; ++s) {
      const int predicted = ArgMax(step_lp.data(), V);
      int32_t next = predicted;
      if (reference) {
        next = reference->greedy[s];
        r.agree += predicted == next;
      } else {
        reference_out->greedy.push_back(predicted);
        ++r.agree;
      }
      ++r.generated;
      if (s + 1 == G) break;
      KVQ_ASSIGN_OR_RETURN(double sec, TimedForward(model, absl::MakeConstSpan(&next, 1),
                                                    fork.get(), false, &logits));
      r.decode_seconds.push_back(sec);
      LogSoftmax(logits.data(), V, step_lp.data());
    }
  }
  KVQ_RETURN_IF_ERROR(prefill(prefix, C));
  KVQ_ASSIGN_OR_RETURN(r.bytes, cache->Bytes());
  return r;
}

PasskeyPrompt MakePasskeyPrompt(const BpeTokenizer& tokenizer, int context, double depth,
                                uint64_t seed) {
  std::mt19937_64 rng(seed);
  PasskeyPrompt p;
  p.key = absl::StrFormat("%05d", static_cast<int>(rng() % 90000) + 10000);
  const std::vector<int32_t> intro = tokenizer.Encode(kPasskeyIntro);
  const std::vector<int32_t> needle = tokenizer.Encode(
      absl::StrCat(kPasskeyNeedle[0], p.key, kPasskeyNeedle[1], p.key, kPasskeyNeedle[2]));
  const std::vector<int32_t> question = tokenizer.Encode(kPasskeyQuestion);
  const std::vector<int32_t> filler = tokenizer.Encode(kPasskeyFiller);
  const int budget = context - static_cast<int>(intro.size() + needle.size() + question.size());
  const int units = std::max(0, budget / static_cast<int>(filler.size()));
  const int before = static_cast<int>(std::lround(depth * units));
  p.tokens = intro;
  for (int u = 0; u < units; ++u) {
    if (u == before) p.tokens.insert(p.tokens.end(), needle.begin(), needle.end());
    p.tokens.insert(p.tokens.end(), filler.begin(), filler.end());
  }
  if (before >= units) p.tokens.insert(p.tokens.end(), needle.begin(), needle.end());
  p.tokens.insert(p.tokens.end(), question.begin(), question.end());
  return p;
}

absl::StatusOr<bool> RunPasskey(LlamaModel& model, const BpeTokenizer& tokenizer,
                                const PasskeyPrompt& prompt, AttentionCache* cache, int chunk,
                                std::string* answer) {
  const int V = model.config().vocab;
  const int n = static_cast<int>(prompt.tokens.size());
  std::vector<float> logits;
  for (int pos = 0; pos < n; pos += chunk) {
    const int len = std::min(chunk, n - pos);
    KVQ_RETURN_IF_ERROR(model.Forward(absl::MakeConstSpan(prompt.tokens).subspan(pos, len), cache,
                                      false, &logits));
  }
  std::vector<int32_t> out;
  for (int s = 0; s < kPasskeyAnswerTokens; ++s) {
    const int32_t next = ArgMax(logits.data(), V);
    out.push_back(next);
    if (s + 1 < kPasskeyAnswerTokens) {
      KVQ_RETURN_IF_ERROR(model.Forward(absl::MakeConstSpan(&next, 1), cache, false, &logits));
    }
  }
  *answer = tokenizer.Decode(out);
  // The first run of digits is the answer.
  std::string digits;
  for (char ch : *answer) {
    if (ch >= '0' && ch <= '9') {
      digits += ch;
    } else if (!digits.empty()) {
      break;
    }
  }
  return digits == prompt.key;
}

absl::StatusOr<std::vector<Codebook>> LearnCodebooks(LlamaModel& model,
                                                     absl::Span<const int32_t> calibration,
                                                     const QuantSpec& spec, int chunk) {
  const CacheShape shape = model.config().cache_shape();
  KVQ_ASSIGN_OR_RETURN(QuantSpec fp16, QuantSpec::Parse("fp16"));
  KVQ_ASSIGN_OR_RETURN(auto inner, KvqAttentionCache::Create(shape, fp16, nullptr, &CpuBackend()));
  RecordingCache recorder(shape, spec.pre_rope, std::move(inner));
  std::vector<float> logits;
  for (size_t pos = 0; pos < calibration.size(); pos += chunk) {
    const size_t len = std::min<size_t>(chunk, calibration.size() - pos);
    KVQ_RETURN_IF_ERROR(model.Forward(calibration.subspan(pos, len), &recorder, false, &logits));
  }
  const StreamConfig config = MakeStreamConfig(shape, spec);
  const int rows = static_cast<int>(calibration.size());
  const int stride = shape.num_kv_heads * shape.head_dim;
  std::vector<Codebook> codebooks;
  for (int l = 0; l < shape.num_layers; ++l) {
    for (int h = 0; h < shape.num_kv_heads; ++h) {
      const ConstTensorView k{recorder.keys(l).data() + h * shape.head_dim, DType::kFloat32, rows,
                              shape.head_dim, stride};
      const ConstTensorView v{recorder.values(l).data() + h * shape.head_dim, DType::kFloat32,
                              rows, shape.head_dim, stride};
      KVQ_ASSIGN_OR_RETURN(Codebook cb, LearnCodebook(config, k, v));
      codebooks.push_back(std::move(cb));
    }
  }
  return codebooks;
}

}  // namespace kvq::eval
