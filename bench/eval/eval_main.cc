// kvq-eval: the quality of a real model (SmolLM2-135M, GGUF) with its KV
// cache stored in kvq schemes, against the same model with an fp16 cache.
// See docs/QUALITY.md for the protocol and the figures.
//
//   kvq-eval                      # readable table, every scheme, 512/2048/8192
//   kvq-eval --quick              # the short CI slice
//   kvq-eval --json --out=r.json  # JSON rows (bench/eval/plot_quality.py)
//   kvq-eval --server=host:port   # end-to-end: through a running kvq-server
//   kvq-eval --write_calibration=cal/NAME.kvqcal   # the crq schemes' calibration
#include <cblas.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/eval/attention_cache.h"
#include "bench/eval/bootstrap.h"
#include "bench/eval/bpe_tokenizer.h"
#include "bench/eval/calibration_stats.h"
#include "bench/eval/decode_cache.h"
#include "bench/eval/decode_metric.h"
#include "bench/eval/eval_data.h"
#include "bench/eval/eval_runner.h"
#include "bench/eval/gguf_file.h"
#include "bench/eval/llama_model.h"
#include "bench/eval/remote_cache.h"
#include "client/kvq_client.h"
#include "client/progress_bar.h"
#include "kernels/build_info.h"
#include "kernels/calibration_file.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, model, "", "GGUF model (default: the eval data dir's SmolLM2 file)");
ABSL_FLAG(std::string, data_dir, "", "Eval data dir (default: KVQ_EVAL_DATA or the user cache)");
ABSL_FLAG(std::vector<std::string>, corpora, {},
          "Evaluation corpora: names of <data_dir>/corpora/<name>.txt (default: every file but "
          "calibration.txt)");
ABSL_FLAG(std::string, calibration, "calibration",
          "Corpus the nuq codebooks and the crq calibration are learned from (never an "
          "evaluation corpus)");
ABSL_FLAG(int, calib_tokens, 2048, "Calibration tokens");
ABSL_FLAG(std::string, write_calibration, "",
          "Compute the crq schemes' calibration from --calibration (fp16 cache) and write it to "
          "this file (NAME.kvqcal, for kvq-server --calibration_dir), then exit");
ABSL_FLAG(std::string, calibration_name, "",
          "Name written into --write_calibration's file (default: its file name without "
          ".kvqcal)");
ABSL_FLAG(std::string, calibration_file, "",
          "crq schemes: read the calibration from this file instead of computing it (with "
          "--server, its name is the one the server is asked for)");
ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>({"512", "2048", "8192"}),
          "Window lengths in tokens");
ABSL_FLAG(int, windows, 5, "Windows per corpus and context");
ABSL_FLAG(std::vector<std::string>, window_order, {},
          "Which of the --windows evenly spaced windows of each corpus and context to run, in "
          "this order (0-based; default: all, in order). A long run scores first the windows "
          "it must not miss, e.g. 2,0,4,1,3 starts with the middle one");
ABSL_FLAG(std::vector<std::string>, metrics, std::vector<std::string>({"decode", "prefill"}),
          "Perplexity metrics: decode (every position scored with the cache state "
          "token-by-token decoding gives it; in-process only, skipped with --server) and "
          "prefill (chunked prefill, each "
          "chunk stored before its queries attend)");
ABSL_FLAG(int, bootstrap_resamples, 1000,
          "Resamples of the windows for the 95% intervals of pooled dPPL and KL");
ABSL_FLAG(uint64_t, bootstrap_seed, 1, "Seed of the bootstrap resampling");
ABSL_FLAG(std::vector<std::string>, schemes,
          std::vector<std::string>({"fp16", "int8", "fp8_e4m3", "kivi4", "kivi3", "kivi2"}),
          "kvq schemes (fp16 is always run first: it is the reference); a scheme followed by "
          "@A-B (or @A) quantizes only layers A..B and keeps fp16 in the others (a per-layer "
          "sensitivity probe; in-process only)");
ABSL_FLAG(int, chunk, 512, "Prefill chunk (tokens per forward step)");
ABSL_FLAG(int, gen_tokens, 256, "Greedy tokens for the top-1 agreement");
ABSL_FLAG(bool, generate, true,
          "Generate the gen_tokens (top-1 agreement, decode ms/token); false leaves that out "
          "and keeps the prefill metric's split of the window, so its perplexity and KL are "
          "unchanged");
ABSL_FLAG(std::vector<std::string>, passkey_contexts,
          std::vector<std::string>({"2048", "8192"}), "Passkey prompt lengths ('' for none)");
ABSL_FLAG(std::vector<std::string>, passkey_depths,
          std::vector<std::string>({"0.1", "0.5", "0.9"}), "Depths of the key (0..1)");
ABSL_FLAG(std::vector<std::string>, passkey_schemes, {},
          "Schemes that run the passkey probe (default: all)");
ABSL_FLAG(std::string, server, "", "host:port of a kvq-server: run end-to-end over gRPC");
ABSL_FLAG(bool, json, false, "Print JSON instead of the table");
ABSL_FLAG(std::string, out, "", "Also write the JSON to this file");
ABSL_FLAG(std::string, dump_windows, "",
          "Write the evaluation windows (token ids) as JSON for the llama.cpp peer");
ABSL_FLAG(bool, dump_only, false,
          "With --dump_windows: write the protocol file and exit without evaluating (for "
          "the transformers mode, bench/eval/hf_eval.py)");
ABSL_FLAG(bool, quick, false,
          "Short CI slice: first corpus, one 512-token window, fp16, kivi4 and "
          "kivi4:pre_rope:sink=4, no passkey");
ABSL_FLAG(int, blas_threads, 1,
          "OpenBLAS threads for the forward pass's matrix products (a fixed count keeps the "
          "numbers identical on machines with different core counts)");
ABSL_FLAG(bool, progress, true, "Progress bar on stderr (when it is a terminal)");

namespace kvq::eval {
namespace {

std::vector<int> ParseInts(const std::vector<std::string>& v, const char* flag) {
  std::vector<int> out;
  for (const auto& s : v) {
    if (s.empty()) continue;
    int x = 0;
    if (!absl::SimpleAtoi(s, &x) || x <= 0) {
      std::fprintf(stderr, "kvq-eval: --%s: '%s' is not a positive integer\n", flag, s.c_str());
      std::exit(2);
    }
    out.push_back(x);
  }
  return out;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(path, ": not found (run scripts/fetch_eval_data.sh to fetch the eval data)"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Window {
  std::string corpus;
  int context = 0;
  int index = 0;
  std::vector<int32_t> tokens;
};

// Evenly spaced windows inside the corpus (never its very start: licence
// headers and title pages are not representative text).
std::vector<Window> MakeWindows(const std::string& corpus, const std::vector<int32_t>& tokens,
                                int context, int count) {
  std::vector<Window> out;
  const int64_t room = static_cast<int64_t>(tokens.size()) - context;
  if (room < 0) return out;
  for (int i = 0; i < count; ++i) {
    const int64_t start = room * (i + 1) / (count + 1);
    out.push_back({corpus, context, i,
                   std::vector<int32_t>(tokens.begin() + start, tokens.begin() + start + context)});
  }
  return out;
}

struct Row {
  std::string scheme, corpus;
  int context = 0;
  std::string metric;  // "decode" or "prefill".
  int windows = 0;
  double nll = 0.0;
  int64_t scored = 0;
  double kl = 0.0;
  int agree = 0, generated = 0;
  double prefill_seconds = 0.0;
  std::vector<double> decode_seconds;
  ByteBreakdown bytes;  // Of the last window.
  int tokens = 0;
  int passkey_ok = -1, passkey_trials = 0;
  std::vector<WindowScore> per_window;  // Paired with the reference, for the bootstrap.
  std::vector<int> window_indices;      // Which of the corpus's windows, in run order.
  // "corpus/index" of each per_window entry: another engine's run of the
  // same protocol file pairs its windows with these (compare_forward.py).
  std::vector<std::string> window_ids;

  void Add(const WindowResult& r, double ref_nll, std::string window_id) {
    ++windows;
    per_window.push_back({r.nll_sum, ref_nll, r.kl_sum, r.scored});
    window_ids.push_back(std::move(window_id));
    nll += r.nll_sum;
    scored += r.scored;
    kl += r.kl_sum;
    agree += r.agree;
    generated += r.generated;
    prefill_seconds += r.prefill_seconds;
    decode_seconds.insert(decode_seconds.end(), r.decode_seconds.begin(), r.decode_seconds.end());
    bytes = r.bytes;
    tokens = r.tokens;
  }
  double ppl() const { return std::exp(nll / std::max<int64_t>(1, scored)); }
};

// What a scheme's rotate and nuq options are, in words: they are not the
// published methods they resemble (QuaRot/TurboQuant quantize each rotated
// token with a norm and an optimal codebook; KVQuant keeps offline
// per-channel key ranges without per-group parameters).
std::string Method(const QuantSpec& spec) {
  std::vector<std::string> parts;
  if (spec.rotate) parts.push_back("Hadamard rotation + uniform per-group levels");
  if (spec.nuq) {
    parts.push_back("per-channel non-uniform levels (KVQuant-like, with per-group parameters)");
  }
  return absl::StrJoin(parts, "; ");
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

size_t PeakRssBytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<size_t>(u.ru_maxrss) * 1024;
}

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

int Main(int argc, char** argv) {
  if (PrintVersionIfAsked(argc, argv, "kvq-eval")) return 0;
  absl::SetProgramUsageMessage(
      "kvq-eval: perplexity, KL, greedy agreement and passkey retrieval of SmolLM2-135M with "
      "its KV cache in kvq schemes (docs/QUALITY.md).");
  absl::ParseCommandLine(argc, argv);
  openblas_set_num_threads(std::max(1, absl::GetFlag(FLAGS_blas_threads)));
  const bool quick = absl::GetFlag(FLAGS_quick);
  const std::string data_dir =
      absl::GetFlag(FLAGS_data_dir).empty() ? EvalDataDir() : absl::GetFlag(FLAGS_data_dir);
  const std::string model_path =
      absl::GetFlag(FLAGS_model).empty() ? EvalModelPath() : absl::GetFlag(FLAGS_model);
  std::vector<int> contexts = ParseInts(absl::GetFlag(FLAGS_contexts), "contexts");
  std::vector<int> passkey_contexts =
      ParseInts(absl::GetFlag(FLAGS_passkey_contexts), "passkey_contexts");
  std::vector<std::string> scheme_names = absl::GetFlag(FLAGS_schemes);
  std::vector<std::string> corpora = absl::GetFlag(FLAGS_corpora);
  int windows = absl::GetFlag(FLAGS_windows);
  int gen_tokens = absl::GetFlag(FLAGS_gen_tokens);
  int calib_tokens = absl::GetFlag(FLAGS_calib_tokens);
  if (contexts.empty() && passkey_contexts.empty() && !quick) {
    std::fprintf(stderr, "kvq-eval: nothing to run: --contexts and --passkey_contexts are empty\n");
    return 1;
  }
  if (quick) {
    contexts = {512};
    passkey_contexts.clear();
    windows = 1;
    gen_tokens = std::min(gen_tokens, 32);
    calib_tokens = std::min(calib_tokens, 512);
    if (absl::GetFlag(FLAGS_schemes) ==
        std::vector<std::string>({"fp16", "int8", "fp8_e4m3", "kivi4", "kivi3", "kivi2"})) {
      // Plain KIVI and the picked 4-bit default (docs/QUALITY.md).
      scheme_names = {"fp16", "kivi4", "kivi4:pre_rope:sink=4"};
    }
  }
  std::vector<int> window_order;
  for (const auto& s : absl::GetFlag(FLAGS_window_order)) {
    int i = -1;
    if (!absl::SimpleAtoi(s, &i) || i < 0 || i >= windows ||
        std::find(window_order.begin(), window_order.end(), i) != window_order.end()) {
      std::fprintf(stderr,
                   "kvq-eval: --window_order: '%s' is not a new window index in [0, %d)\n",
                   s.substr(0, 16).c_str(), windows);
      return 2;
    }
    window_order.push_back(i);
  }
  std::vector<double> depths;
  for (const auto& s : absl::GetFlag(FLAGS_passkey_depths)) {
    double d = 0;
    if (!absl::SimpleAtod(s, &d) || d < 0 || d > 1) {
      std::fprintf(stderr, "kvq-eval: --passkey_depths: '%s' is not in [0, 1]\n", s.c_str());
      return 2;
    }
    depths.push_back(d);
  }
  // fp16 first: it is the reference every other scheme is compared with.
  scheme_names.erase(std::remove(scheme_names.begin(), scheme_names.end(), "fp16"),
                     scheme_names.end());
  scheme_names.insert(scheme_names.begin(), "fp16");
  for (const auto& name : scheme_names) {
    // The scheme strings fail here, before the model loads; layer ranges are
    // checked against the model below.
    auto scheme = ParseEvalScheme(name, std::numeric_limits<int>::max());
    if (!scheme.ok()) {
      std::fprintf(stderr, "kvq-eval: --schemes: %s\n", scheme.status().ToString().c_str());
      return 2;
    }
  }
  std::vector<std::string> passkey_schemes = absl::GetFlag(FLAGS_passkey_schemes);
  auto runs_passkey = [&](const std::string& name) {
    return passkey_schemes.empty() ||
           std::find(passkey_schemes.begin(), passkey_schemes.end(), name) !=
               passkey_schemes.end();
  };

  auto file = GgufFile::Open(model_path);
  if (!file.ok()) {
    std::fprintf(stderr, "kvq-eval: %s (run scripts/fetch_eval_data.sh)\n",
                 file.status().ToString().c_str());
    return 1;
  }
  auto model_or = LlamaModel::Load(**file);
  auto tokenizer_or = BpeTokenizer::FromGguf(**file);
  if (!model_or.ok() || !tokenizer_or.ok()) {
    std::fprintf(stderr, "kvq-eval: %s\n",
                 (model_or.ok() ? tokenizer_or.status() : model_or.status()).ToString().c_str());
    return 1;
  }
  LlamaModel& model = **model_or;
  const BpeTokenizer& tokenizer = *tokenizer_or;
  const CacheShape shape = model.config().cache_shape();
  std::vector<EvalScheme> specs;
  for (const auto& name : scheme_names) {
    auto scheme = ParseEvalScheme(name, shape.num_layers);
    if (!scheme.ok()) {
      std::fprintf(stderr, "kvq-eval: --schemes: %s\n", scheme.status().ToString().c_str());
      return 2;
    }
    if (scheme->layers.last >= 0 && !absl::GetFlag(FLAGS_server).empty()) {
      std::fprintf(stderr, "kvq-eval: --schemes: %s: a layer range runs in-process only "
                   "(a kvq-server sequence has one scheme for every layer)\n", name.c_str());
      return 2;
    }
    specs.push_back(*scheme);
  }

  // Corpora and windows.
  const std::string corpus_dir = data_dir + "/corpora";
  // The calibration text's first calib_tokens tokens: the nuq codebooks and
  // the crq calibration are learned from them.
  auto calibration_tokens = [&]() -> absl::StatusOr<std::vector<int32_t>> {
    KVQ_ASSIGN_OR_RETURN(std::string text,
                         ReadFile(corpus_dir + "/" + absl::GetFlag(FLAGS_calibration) + ".txt"));
    std::vector<int32_t> tokens = tokenizer.Encode(absl::string_view(text).substr(0, 1 << 20));
    if (static_cast<int>(tokens.size()) > calib_tokens) tokens.resize(calib_tokens);
    return tokens;
  };
  const std::string model_file = std::filesystem::path(model_path).filename().string();
  // The crq schemes' calibration: read from --calibration_file, or computed
  // once per run.
  std::unique_ptr<ModelCalibration> calibration;
  auto get_calibration = [&](const std::string& name) -> absl::StatusOr<const ModelCalibration*> {
    if (calibration != nullptr) return calibration.get();
    if (!absl::GetFlag(FLAGS_calibration_file).empty()) {
      KVQ_ASSIGN_OR_RETURN(CalibrationFile file,
                           ReadCalibrationFile(absl::GetFlag(FLAGS_calibration_file)));
      calibration = std::make_unique<ModelCalibration>(std::move(file.calibration));
    } else {
      KVQ_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, calibration_tokens());
      KVQ_ASSIGN_OR_RETURN(ModelCalibration c, ComputeCalibration(model, tokens,
                                                                  absl::GetFlag(FLAGS_chunk), name));
      calibration = std::make_unique<ModelCalibration>(std::move(c));
    }
    return calibration.get();
  };
  if (!absl::GetFlag(FLAGS_write_calibration).empty()) {
    const std::string path = absl::GetFlag(FLAGS_write_calibration);
    std::string name = absl::GetFlag(FLAGS_calibration_name);
    if (name.empty()) name = std::filesystem::path(path).stem().string();
    auto c = get_calibration(name);
    absl::Status st = c.ok() ? WriteCalibrationFile(path, **c, ModelFingerprint(model_file,
                                                                                model.config()))
                             : c.status();
    if (!st.ok()) {
      std::fprintf(stderr, "kvq-eval: --write_calibration: %s\n", st.ToString().c_str());
      return 1;
    }
    std::printf("kvq-eval: calibration \"%s\" (%d layers x %d KV heads x head_dim %d, from %s) "
                "written to %s\n",
                (*c)->name.c_str(), (*c)->num_layers, (*c)->num_kv_heads, (*c)->head_dim,
                absl::GetFlag(FLAGS_calibration).c_str(), path.c_str());
    return 0;
  }
  if (corpora.empty()) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(corpus_dir, ec)) {
      const auto p = e.path();
      if (p.extension() == ".txt" && p.stem() != absl::GetFlag(FLAGS_calibration)) {
        corpora.push_back(p.stem().string());
      }
    }
    std::sort(corpora.begin(), corpora.end());
    if (corpora.empty()) {
      std::fprintf(stderr, "kvq-eval: no corpora in %s (run scripts/fetch_eval_data.sh)\n",
                   corpus_dir.c_str());
      return 1;
    }
  }
  if (std::find(corpora.begin(), corpora.end(), absl::GetFlag(FLAGS_calibration)) !=
      corpora.end()) {
    std::fprintf(stderr, "kvq-eval: --corpora: %s is the calibration corpus (--calibration); "
                 "evaluate on other text\n", absl::GetFlag(FLAGS_calibration).c_str());
    return 2;
  }
  if (quick) corpora.resize(1);
  // --contexts= (empty) runs the passkey probe alone.
  if (contexts.empty()) corpora.clear();
  const int max_context =
      contexts.empty() ? 0 : *std::max_element(contexts.begin(), contexts.end());
  std::vector<Window> all_windows;
  for (const auto& name : corpora) {
    auto text = ReadFile(corpus_dir + "/" + name + ".txt");
    if (!text.ok()) {
      std::fprintf(stderr, "kvq-eval: %s\n", text.status().ToString().c_str());
      return 1;
    }
    // Enough text for the windows (about 4 bytes per token, with room).
    const size_t want = static_cast<size_t>(max_context) * (windows + 1) * 8;
    const std::vector<int32_t> tokens =
        tokenizer.Encode(absl::string_view(*text).substr(0, std::max(want, size_t{1} << 20)));
    for (int c : contexts) {
      auto w = MakeWindows(name, tokens, c, windows);
      if (static_cast<int>(w.size()) < windows) {
        std::fprintf(stderr, "kvq-eval: corpus %s has %zu tokens, too few for %d-token windows\n",
                     name.c_str(), tokens.size(), c);
        return 1;
      }
      if (window_order.empty()) {
        all_windows.insert(all_windows.end(), w.begin(), w.end());
      } else {
        for (int i : window_order) all_windows.push_back(w[i]);
      }
    }
  }
  if (!absl::GetFlag(FLAGS_dump_windows).empty()) {
    std::ofstream out(absl::GetFlag(FLAGS_dump_windows));
    // The whole protocol, for the engines that run it on these windows
    // (bench/eval/llamacpp_peer.py, bench/eval/hf_eval.py): the windows,
    // the prefill chunk, the decode length and the passkey prompts.
    out << "{\"model\": " << JsonString(std::filesystem::path(model_path).filename().string())
        << ", \"chunk\": " << absl::GetFlag(FLAGS_chunk) << ", \"gen_tokens\": " << gen_tokens
        << ", \"windows_per_corpus\": " << windows << ", \"metrics\": ["
        << absl::StrJoin(absl::GetFlag(FLAGS_metrics), ", ",
                         [](std::string* out, const std::string& m) {
                           absl::StrAppend(out, JsonString(m));
                         })
        << "], \"bootstrap\": {\"resamples\": " << absl::GetFlag(FLAGS_bootstrap_resamples)
        << ", \"seed\": " << absl::GetFlag(FLAGS_bootstrap_seed)
        << ", \"interval\": 0.95}, \"windows\": [";
    for (size_t i = 0; i < all_windows.size(); ++i) {
      const Window& w = all_windows[i];
      out << (i ? ",\n" : "\n") << "{\"corpus\": " << JsonString(w.corpus)
          << ", \"context\": " << w.context << ", \"index\": " << w.index << ", \"tokens\": ["
          << absl::StrJoin(w.tokens, ",") << "]}";
    }
    out << "],\n\"passkey\": {\"intro\": " << JsonString(kPasskeyIntro) << ", \"needle\": ["
        << JsonString(kPasskeyNeedle[0]) << ", " << JsonString(kPasskeyNeedle[1]) << ", "
        << JsonString(kPasskeyNeedle[2]) << "], \"question\": " << JsonString(kPasskeyQuestion)
        << ", \"filler\": " << JsonString(kPasskeyFiller)
        << ", \"answer_tokens\": " << kPasskeyAnswerTokens << ", \"prompts\": [";
    bool first_prompt = true;
    for (int c : passkey_contexts) {
      for (size_t d = 0; d < depths.size(); ++d) {
        const PasskeyPrompt prompt = MakePasskeyPrompt(tokenizer, c, depths[d], 1000 + d);
        out << (first_prompt ? "\n" : ",\n") << "{\"context\": " << c << ", \"depth\": "
            << depths[d] << ", \"key\": " << JsonString(prompt.key) << ", \"tokens\": ["
            << absl::StrJoin(prompt.tokens, ",") << "]}";
        first_prompt = false;
      }
    }
    out << "]}}\n";
    if (absl::GetFlag(FLAGS_dump_only)) return out.good() ? 0 : 1;
  }

  // Caches: in-process, or sequences on a kvq-server.
  std::unique_ptr<KvqClient> client;
  if (!absl::GetFlag(FLAGS_server).empty()) {
    ClientOptions options;
    options.target = absl::GetFlag(FLAGS_server);
    options.deadline = absl::Minutes(5);
    auto c = KvqClient::Connect(options);
    if (!c.ok()) {
      std::fprintf(stderr, "kvq-eval: %s\n", c.status().ToString().c_str());
      return 1;
    }
    client = std::move(*c);
  }
  std::map<std::string, std::vector<Codebook>> codebooks;
  // decode: the decode-faithful cache (in-process streams).
  auto make_cache = [&](const EvalScheme& scheme, bool decode = false)
      -> absl::StatusOr<std::unique_ptr<AttentionCache>> {
    const QuantSpec& spec = scheme.spec;
    const std::vector<Codebook>* cb = nullptr;
    if (spec.nuq) {
      const std::string key = spec.ToString();
      if (!codebooks.count(key)) {
        KVQ_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, calibration_tokens());
        KVQ_ASSIGN_OR_RETURN(codebooks[key], LearnCodebooks(model, tokens, spec,
                                                            absl::GetFlag(FLAGS_chunk)));
      }
      cb = &codebooks[key];
    }
    const ModelCalibration* cal = nullptr;
    if (spec.is_crq()) {
      if (client && absl::GetFlag(FLAGS_calibration_file).empty()) {
        return absl::FailedPreconditionError(
            "--server with a crq scheme needs --calibration_file: the file the server loaded "
            "(--calibration_dir), so both sides use the same statistics");
      }
      const std::string name = absl::GetFlag(FLAGS_calibration_name).empty()
                                   ? std::filesystem::path(model_file).stem().string()
                                   : absl::GetFlag(FLAGS_calibration_name);
      KVQ_ASSIGN_OR_RETURN(cal, get_calibration(name));
    }
    if (decode) {
      KVQ_ASSIGN_OR_RETURN(auto cache, DecodeFaithfulCache::Create(shape, spec, cb, &CpuBackend(),
                                                                   scheme.layers, cal));
      return std::unique_ptr<AttentionCache>(std::move(cache));
    }
    if (client) {
      // The server holds the statistics: the sequence names them.
      KVQ_ASSIGN_OR_RETURN(auto cache, RemoteAttentionCache::Create(client.get(), shape, spec, cb,
                                                                    cal ? cal->name : ""));
      return std::unique_ptr<AttentionCache>(std::move(cache));
    }
    KVQ_ASSIGN_OR_RETURN(auto cache, KvqAttentionCache::Create(shape, spec, cb, &CpuBackend(),
                                                               scheme.layers, cal));
    return std::unique_ptr<AttentionCache>(std::move(cache));
  };

  WindowOptions wopt;
  wopt.chunk = absl::GetFlag(FLAGS_chunk);
  wopt.gen_tokens = gen_tokens;
  wopt.generate = absl::GetFlag(FLAGS_generate);
  int passkey_runs = 0;
  for (const auto& name : scheme_names) {
    if (runs_passkey(name)) passkey_runs += passkey_contexts.size() * depths.size();
  }
  bool run_decode = false, run_prefill = false;
  for (const std::string& m : absl::GetFlag(FLAGS_metrics)) {
    if (m == "decode") {
      run_decode = true;
    } else if (m == "prefill") {
      run_prefill = true;
    } else {
      std::fprintf(stderr, "kvq-eval: --metrics: '%s' is not decode or prefill\n", m.c_str());
      return 2;
    }
  }
  if (run_decode && client) {
    // The decode metric reads each token's stored form back as it is
    // appended, which a server sequence does not offer per step.
    if (!run_prefill) {
      std::fprintf(stderr, "kvq-eval: --metrics=decode runs in-process only; with --server "
                   "use --metrics=prefill\n");
      return 2;
    }
    std::fprintf(stderr, "kvq-eval: --server: the decode metric runs in-process only; "
                 "scoring the prefill metric\n");
    run_decode = false;
  }
  const int64_t total_steps =
      static_cast<int64_t>(all_windows.size()) * specs.size() * (run_decode + run_prefill) +
      passkey_runs;
  ProgressBar bar("eval", absl::GetFlag(FLAGS_progress) && isatty(fileno(stderr)), false);
  int64_t steps = 0;
  // (scheme, corpus, context, metric)
  std::map<std::tuple<std::string, std::string, int, std::string>, Row> rows;
  size_t reference_bytes = 0;
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "\nkvq-eval: %s\n", s.ToString().c_str());
    return 1;
  };
  auto add = [&](size_t s, const Window& w, const std::string& metric, const WindowResult& r,
                 double ref_nll) {
    for (const std::string& corpus : {w.corpus, std::string("all")}) {
      Row& row = rows[{scheme_names[s], corpus, w.context, metric}];
      row.scheme = scheme_names[s];
      row.corpus = corpus;
      row.context = w.context;
      row.metric = metric;
      row.Add(r, ref_nll, absl::StrCat(w.corpus, "/", w.index));
      row.window_indices.push_back(w.index);
    }
  };
  // Report. Every pooled dPPL and KL comes with its bootstrap interval
  // over windows; the table puts the decode metric first. `partial`: some
  // windows or passkey trials are still to run (the JSON says so).
  auto report = [&](bool partial, std::string& json, std::string& table) {
    const double elems_per_token = 2.0 * shape.num_layers * shape.num_kv_heads * shape.head_dim;
    const int resamples = absl::GetFlag(FLAGS_bootstrap_resamples);
    const uint64_t seed = absl::GetFlag(FLAGS_bootstrap_seed);
    json = absl::StrCat(
        "{\"tool\": \"kvq-eval\", \"model\": ",
        JsonString(std::filesystem::path(model_path).filename().string()),
        ", \"mode\": ", JsonString(client ? "server" : "in-process"), ", \"chunk\": ", wopt.chunk,
      // The BLAS kernels (OPENBLAS_CORETYPE picks them where OpenBLAS does
      // not know the CPU): numbers agree to the last bit only on one kind.
      ", \"blas_core\": ", JsonString(openblas_get_corename()),
        ", \"bootstrap\": {\"resamples\": ", resamples, ", \"seed\": ", seed,
        ", \"interval\": 0.95}", partial ? ", \"partial\": true" : "", ", \"rows\": [");
    table = absl::StrFormat(
        "%-40s %-8s %6s %6s %8s | %-28s %-28s | %8s %9s %6s %8s %8s %9s\n", "scheme", "corpus",
        "ctx", "bits", "KV MiB", "decode dPPL% [95% CI]", "decode KL [95% CI]", "prefill%",
        "prefillKL", "top1", "passkey", "prefill", "ms/token");
    auto with_ci = [](double x, bool has, Interval ci, const char* fmt) {
      std::string out = absl::StrFormat(fmt, x);
      if (has) {
        absl::StrAppend(&out, " [", absl::StrFormat(fmt, ci.lo), ", ", absl::StrFormat(fmt, ci.hi),
                        "]");
      }
      return out;
    };
    bool first = true;
    size_t kv_max = 0;
    for (const auto& [key, r] : rows) {
      const bool has_ppl = r.scored > 0;
      const double bits = r.tokens ? 8.0 * r.bytes.total() / (elems_per_token * r.tokens) : 0.0;
      const PooledScore pooled = Pool(r.per_window, resamples, seed);
      const double top1 = r.generated ? static_cast<double>(r.agree) / r.generated : 0.0;
      const double decode_ms = 1e3 * Median(r.decode_seconds);
      const bool prefill = r.metric == "prefill";
      kv_max = std::max(kv_max, r.bytes.total());
      json += absl::StrCat(first ? "\n" : ",\n", "{\"engine\": \"kvq\", \"scheme\": ",
                           JsonString(r.scheme), ", \"metric\": ", JsonString(r.metric),
                           ", \"corpus\": ", JsonString(r.corpus), ", \"context\": ", r.context);
      first = false;
      const std::string method = Method(ParseEvalScheme(r.scheme, shape.num_layers)->spec);
      if (!method.empty()) json += ", \"method\": " + JsonString(method);
      if (has_ppl) {
        json += absl::StrFormat(
            ", \"windows\": %d, \"tokens_scored\": %d, \"nll\": %.9g, \"ppl\": %.9g, "
            "\"delta_ppl_pct\": %.6g, \"kl_mean\": %.9g, \"bits_per_element\": %.6g, "
            "\"kv_bytes\": %d, "
            "\"kv_bytes_by_component\": {\"codes\": %d, \"scales\": %d, \"outliers\": %d, "
            "\"residual\": %d, \"sink\": %d, \"codebook\": %d, \"padding\": %d}",
            r.windows, r.scored, r.nll / r.scored, r.ppl(), pooled.delta_ppl_pct, pooled.kl_mean,
            bits, r.bytes.total(), r.bytes.codes, r.bytes.scales, r.bytes.outliers,
            r.bytes.residual, r.bytes.sink, r.bytes.codebook, r.bytes.padding);
        // Each window's sums beside the reference's, so runs of different
        // corpora pool with their intervals (quality_tables.py --frontier)
        // and another engine's run pairs with them by "window"
        // (compare_forward.py).
        json += ", \"per_window\": [";
        for (size_t i = 0; i < r.per_window.size(); ++i) {
          const WindowScore& w = r.per_window[i];
          json += absl::StrFormat(
              "%s{\"window\": %s, \"index\": %d, \"nll\": %.17g, \"ref_nll\": %.17g, "
              "\"kl\": %.17g, \"tokens\": %d}",
              i ? ", " : "", JsonString(r.window_ids[i]), r.window_indices[i], w.nll, w.ref_nll,
              w.kl, w.scored);
        }
        json += "]";
        if (pooled.has_interval) {
          json += absl::StrFormat(
              ", \"delta_ppl_pct_ci95\": [%.6g, %.6g], \"kl_mean_ci95\": [%.9g, %.9g]",
              pooled.delta_ppl_pct_ci.lo, pooled.delta_ppl_pct_ci.hi, pooled.kl_mean_ci.lo,
              pooled.kl_mean_ci.hi);
        }
        if (prefill) {
          json += absl::StrFormat(
              ", \"top1_agree\": %.6g, \"generated\": %d, \"prefill_ms\": %.6g, "
              "\"decode_ms_per_token\": %.6g, \"decode_tokens_per_s\": %.6g",
              top1, r.generated, 1e3 * r.prefill_seconds / r.windows, decode_ms,
              decode_ms > 0 ? 1e3 / decode_ms : 0.0);
        } else {
          json += absl::StrFormat(", \"scoring_ms\": %.6g", 1e3 * r.prefill_seconds / r.windows);
        }
      }
      if (r.passkey_trials) {
        json += absl::StrFormat(", \"passkey_ok\": %d, \"passkey_trials\": %d, \"passkey_acc\": %.6g",
                                r.passkey_ok, r.passkey_trials,
                                static_cast<double>(r.passkey_ok) / r.passkey_trials);
      }
      json += "}";

      // One table line per (scheme, corpus, context): at its decode row, or
      // at its prefill row when there is no decode row.
      const auto other = rows.find({r.scheme, r.corpus, r.context, prefill ? "decode" : "prefill"});
      if (prefill && other != rows.end()) continue;
      const Row* d = prefill ? nullptr : &r;
      const Row* p = prefill ? &r : (other == rows.end() ? nullptr : &other->second);
      std::string passkey = "-";
      if (p && p->passkey_trials) passkey = absl::StrCat(p->passkey_ok, "/", p->passkey_trials);
      if (!has_ppl) {
        table += absl::StrFormat("%-40s %-8s %6d %6s %8s | %-28s %-28s | %8s %9s %6s %8s %8s %9s\n",
                                 r.scheme, r.corpus, r.context, "", "", "", "", "", "", "", passkey,
                                 "", "");
        continue;
      }
      std::string d_ppl = "-", d_kl = "-", p_ppl = "-", p_kl = "-", p_top1 = "-", p_time = "-",
                  p_ms = "-";
      if (d) {
        const PooledScore s = Pool(d->per_window, resamples, seed);
        d_ppl = with_ci(s.delta_ppl_pct, s.has_interval, s.delta_ppl_pct_ci, "%+.3f");
        d_kl = with_ci(s.kl_mean, s.has_interval, s.kl_mean_ci, "%.5f");
      }
      if (p) {
        const PooledScore s = Pool(p->per_window, resamples, seed);
        p_ppl = absl::StrFormat("%+.3f", s.delta_ppl_pct);
        p_kl = absl::StrFormat("%.5f", s.kl_mean);
        p_top1 = absl::StrFormat("%.3f", p->generated ? double(p->agree) / p->generated : 0.0);
        p_time = absl::StrFormat("%.1fs", p->prefill_seconds / p->windows);
        p_ms = absl::StrFormat("%.2f", 1e3 * Median(p->decode_seconds));
      }
      table += absl::StrFormat(
          "%-40s %-8s %6d %6.2f %8.1f | %-28s %-28s | %8s %9s %6s %8s %8s %9s\n", r.scheme,
          r.corpus, r.context, bits, r.bytes.total() / 1048576.0, d_ppl, d_kl, p_ppl, p_kl, p_top1,
          passkey, p_time, p_ms);
    }
    table += "\ndecode: every position scored with the cache state token-by-token decoding gives "
             "it; prefill: chunked prefill (each chunk stored before its queries attend). "
             "Intervals: 95% bootstrap over windows.\n";
    for (const EvalScheme& e : specs) {
      const std::string method = Method(e.spec);
      if (!method.empty()) {
        table += absl::StrFormat("%s: %s\n", e.spec.ToString(), method);
      }
    }
    const size_t scratch = model.ScratchBytes(wopt.chunk);
    json += absl::StrFormat(
        "\n], \"memory\": {\"weights_bytes\": %d, \"kv_bytes_max\": %d, \"scratch_bytes\": %d, "
        "\"reference_logprobs_bytes\": %d, \"reserved_pool_bytes\": %d, \"peak_rss_bytes\": %d}}\n",
        model.weight_bytes(), kv_max, scratch, reference_bytes, 0, PeakRssBytes());
    table += absl::StrFormat(
        "\nmemory: weights %.1f MiB (fp32), KV cache up to %.1f MiB, forward scratch %.1f MiB, "
        "fp16 reference log-probs %.1f MiB, reserved pool %s, peak RSS %.1f MiB\n",
        model.weight_bytes() / 1048576.0, kv_max / 1048576.0, scratch / 1048576.0,
        reference_bytes / 1048576.0, client ? "on the server (see its Stats)" : "none (pages on demand)",
        PeakRssBytes() / 1048576.0);
  };
  // With --out the JSON is rewritten after every window and after every
  // scheme's passkey trials, so a long run leaves what it has measured
  // should it be stopped.
  auto write_out = [&](const std::string& json) {
    const std::string path = absl::GetFlag(FLAGS_out);
    if (path.empty()) return;
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp) << json;
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
  };
  auto write_partial = [&] {
    if (absl::GetFlag(FLAGS_out).empty()) return;
    std::string json, table;
    report(/*partial=*/true, json, table);
    write_out(json);
  };
  for (const Window& w : all_windows) {
    // One metric at a time, so one fp16 reference is held at once.
    if (run_decode) {
      Reference reference;
      double ref_nll = 0.0;
      for (size_t s = 0; s < specs.size(); ++s) {
        auto cache = make_cache(specs[s], /*decode=*/true);
        if (!cache.ok()) return fail(cache.status());
        auto r = RunScoredWindow(model, w.tokens, cache->get(), wopt.chunk,
                                 s == 0 ? nullptr : &reference, s == 0 ? &reference : nullptr);
        if (!r.ok()) return fail(r.status());
        if (s == 0) ref_nll = r->nll_sum;
        reference_bytes = std::max(reference_bytes, reference.logprobs.size() * sizeof(float));
        add(s, w, "decode", *r, ref_nll);
        bar.Update(++steps, total_steps);
      }
    }
    if (run_prefill) {
      Reference reference;
      double ref_nll = 0.0;
      for (size_t s = 0; s < specs.size(); ++s) {
        auto cache = make_cache(specs[s]);
        if (!cache.ok()) return fail(cache.status());
        auto r = RunWindow(model, w.tokens, cache->get(), wopt, s == 0 ? nullptr : &reference,
                           s == 0 ? &reference : nullptr);
        if (!r.ok()) return fail(r.status());
        if (s == 0) ref_nll = r->nll_sum;
        reference_bytes = std::max(reference_bytes, reference.logprobs.size() * sizeof(float));
        add(s, w, "prefill", *r, ref_nll);
        bar.Update(++steps, total_steps);
      }
    }
    write_partial();
  }
  for (size_t s = 0; s < specs.size(); ++s) {
    if (!runs_passkey(scheme_names[s])) continue;
    for (int c : passkey_contexts) {
      // The prompt is stored by chunked prefill, then answered by decoding.
      Row& row = rows[{scheme_names[s], "passkey", c, "prefill"}];
      row.metric = "prefill";
      row.scheme = scheme_names[s];
      row.corpus = "passkey";
      row.context = c;
      row.passkey_ok = 0;
      for (size_t d = 0; d < depths.size(); ++d) {
        const PasskeyPrompt prompt = MakePasskeyPrompt(tokenizer, c, depths[d], 1000 + d);
        auto cache = make_cache(specs[s]);
        if (!cache.ok()) return fail(cache.status());
        std::string answer;
        auto ok = RunPasskey(model, tokenizer, prompt, cache->get(), wopt.chunk, &answer);
        if (!ok.ok()) return fail(ok.status());
        row.passkey_ok += *ok;
        ++row.passkey_trials;
        bar.Update(++steps, total_steps);
      }
    }
    write_partial();  // Each scheme's trials, as each window's scores.
  }
  bar.Finish();

  std::string json, table;
  report(/*partial=*/false, json, table);
  std::fputs(absl::GetFlag(FLAGS_json) ? json.c_str() : table.c_str(), stdout);
  write_out(json);
  return 0;
}

}  // namespace
}  // namespace kvq::eval

int main(int argc, char** argv) { return kvq::eval::Main(argc, argv); }
