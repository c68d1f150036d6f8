// The measurements kvq-eval takes on one window of text: perplexity, KL
// divergence and greedy agreement against the fp16-cache reference, prefill
// and decode timings; the passkey retrieval probe; codebook calibration.
#ifndef KVQ_BENCH_EVAL_EVAL_RUNNER_H_
#define KVQ_BENCH_EVAL_EVAL_RUNNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "bench/eval/attention_cache.h"
#include "bench/eval/bpe_tokenizer.h"
#include "bench/eval/llama_model.h"

namespace kvq::eval {

struct WindowOptions {
  int chunk = 512;        // Prefill chunk, as a serving engine prefills.
  int gen_tokens = 256;   // Greedy tokens generated after the window's prefix.
  // False leaves the generation out (no top-1 agreement or decode timing):
  // the window is still prefilled as size - gen_tokens tokens and then the
  // rest, so perplexity, KL and bytes are those of a run that generates.
  bool generate = true;
};

// What the fp16-cache run leaves for the others to compare against.
struct Reference {
  std::vector<float> logprobs;   // [scored][vocab] next-token log-probabilities.
  std::vector<int32_t> greedy;   // The fp16 cache's greedy continuation (if generated).
  int gen_tokens = 0;            // The window's split: prefix = size - gen_tokens.
};

struct WindowResult {
  double nll_sum = 0.0;     // Over every next-token prediction in the window.
  int64_t scored = 0;
  double kl_sum = 0.0;      // Sum over positions of KL(reference || this).
  int agree = 0;            // Greedy steps whose top-1 equals the reference's.
  int generated = 0;
  double prefill_seconds = 0.0;          // Whole window, chunked.
  std::vector<double> decode_seconds;    // Per generated token.
  ByteBreakdown bytes;                   // KV allocation with the whole window stored.
  int tokens = 0;
};

// Runs `window` through `model` with `cache` (empty on entry): chunked
// prefill of the first size - gen_tokens tokens, a fork that decodes
// gen_tokens tokens one at a time (greedy for the reference, teacher-forced
// on the reference's tokens otherwise), then the rest of the window. With
// `reference` null the run is the reference and fills `reference_out`.
absl::StatusOr<WindowResult> RunWindow(LlamaModel& model, absl::Span<const int32_t> window,
                                       AttentionCache* cache, const WindowOptions& options,
                                       const Reference* reference, Reference* reference_out);

// Scores the log-softmax of `rows` rows of logits [rows][vocab] for window
// positions pos.. (row i predicts window[pos + i + 1]; the window's last
// position predicts nothing): adds the NLL, KL(reference || these) when
// `reference` is given, and the count to r; copies the rows into
// reference_out->logprobs when given; leaves the log-probs in lp.
void ScorePositions(absl::Span<const int32_t> window, int pos, int rows, int vocab,
                    const std::vector<float>& logits, const Reference* reference,
                    Reference* reference_out, std::vector<float>* lp, WindowResult* r);

// Passkey retrieval: a 5-digit key stated once at `depth` (0..1) of filler
// text `context` tokens long, then asked for. The prompt is intro, whole
// filler units with the needle (kPasskeyNeedle joined by the key twice)
// before unit round(depth * units), then the question; kvq-eval
// --dump_windows writes these texts and the prompts for other engines.
inline constexpr char kPasskeyIntro[] =
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.";
inline constexpr const char* kPasskeyNeedle[3] = {" The pass key is ", ". Remember it. ",
                                                  " is the pass key."};
inline constexpr char kPasskeyQuestion[] = " What is the pass key? The pass key is";
inline constexpr char kPasskeyFiller[] =
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
    "again.";
// Tokens the passkey probe generates greedily for its answer.
inline constexpr int kPasskeyAnswerTokens = 8;
struct PasskeyPrompt {
  std::vector<int32_t> tokens;
  std::string key;
};
PasskeyPrompt MakePasskeyPrompt(const BpeTokenizer& tokenizer, int context, double depth,
                                uint64_t seed);
// Greedy answer (up to 8 tokens) and whether its first number is the key.
absl::StatusOr<bool> RunPasskey(LlamaModel& model, const BpeTokenizer& tokenizer,
                                const PasskeyPrompt& prompt, AttentionCache* cache, int chunk,
                                std::string* answer);

// Per-(layer, KV head) nuq codebooks for `spec`, learned by k-means from the
// K/V rows the model produces on `calibration` (with an fp16 cache).
absl::StatusOr<std::vector<Codebook>> LearnCodebooks(LlamaModel& model,
                                                     absl::Span<const int32_t> calibration,
                                                     const QuantSpec& spec, int chunk);

// Numerics shared with the tests.
// Log-softmax of `n` logits into `out` (double accumulation).
void LogSoftmax(const float* logits, int n, float* out);
// KL(p || q) from log-probabilities.
double KlDivergence(const float* log_p, const float* log_q, int n);
int ArgMax(const float* x, int n);

}  // namespace kvq::eval

#endif  // KVQ_BENCH_EVAL_EVAL_RUNNER_H_
