#include "bench/eval/llama_model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "bench/eval/ggml_dequant.h"
#include "kernels/status_macros.h"

namespace kvq::eval {
namespace {

absl::StatusOr<int> GetPositiveInt(const GgufFile& file, const std::string& key) {
  KVQ_ASSIGN_OR_RETURN(int64_t v, file.GetInt(key));
  if (v <= 0 || v > (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(key, " = ", v, " is out of range"));
  }
  return static_cast<int>(v);
}

// Loads `name` as fp32 and checks it holds `elements` values.
absl::StatusOr<std::vector<float>> LoadTensor(const GgufFile& file, const std::string& name,
                                              int64_t elements) {
  KVQ_ASSIGN_OR_RETURN(const GgufTensor* t, file.Tensor(name));
  if (t->elements() != elements) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has ", t->elements(),
                                                   " elements, the config needs ", elements));
  }
  return DequantizeTensor(*t);
}

// y[n][out] = x[n][in] * w[out][in]^T.
void MatMul(const float* x, const std::vector<float>& w, int n, int in, int out, float* y) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w.data(), in,
              0.0f, y, out);
}

// Threads only pay off for a chunk of rows: a decode step's single row would
// spend more in the fork/join than in the work.
constexpr int kParallelRows = 16;

void RmsNorm(const float* x, const std::vector<float>& weight, int n, int dim, float eps,
             float* y) {
#pragma omp parallel for schedule(static) if (n >= kParallelRows)
  for (int i = 0; i < n; ++i) {
    const float* xi = x + static_cast<size_t>(i) * dim;
    double ss = 0.0;
    for (int c = 0; c < dim; ++c) ss += static_cast<double>(xi[c]) * xi[c];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    float* yi = y + static_cast<size_t>(i) * dim;
    for (int c = 0; c < dim; ++c) yi[c] = xi[c] * inv * weight[c];
  }
}

}  // namespace

absl::StatusOr<LlamaConfig> LlamaConfig::FromGguf(const GgufFile& file) {
  KVQ_ASSIGN_OR_RETURN(std::string arch, file.GetString("general.architecture"));
  if (arch != "llama") {
    return absl::UnimplementedError(
        absl::StrCat("general.architecture = \"", arch, "\"; kvq-eval runs \"llama\" models"));
  }
  LlamaConfig c;
  KVQ_ASSIGN_OR_RETURN(c.num_layers, GetPositiveInt(file, "llama.block_count"));
  KVQ_ASSIGN_OR_RETURN(c.hidden, GetPositiveInt(file, "llama.embedding_length"));
  KVQ_ASSIGN_OR_RETURN(c.ffn, GetPositiveInt(file, "llama.feed_forward_length"));
  KVQ_ASSIGN_OR_RETURN(c.num_q_heads, GetPositiveInt(file, "llama.attention.head_count"));
  KVQ_ASSIGN_OR_RETURN(c.num_kv_heads, GetPositiveInt(file, "llama.attention.head_count_kv"));
  KVQ_ASSIGN_OR_RETURN(c.context_length, GetPositiveInt(file, "llama.context_length"));
  KVQ_ASSIGN_OR_RETURN(std::vector<std::string> tokens,
                       file.GetStringArray("tokenizer.ggml.tokens"));
  c.vocab = static_cast<int>(tokens.size());
  if (file.Has("llama.vocab_size")) {
    KVQ_ASSIGN_OR_RETURN(c.vocab, GetPositiveInt(file, "llama.vocab_size"));
  }
  if (c.hidden % c.num_q_heads != 0 || c.num_q_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "llama.embedding_length ", c.hidden, " / head_count ", c.num_q_heads, " / head_count_kv ",
        c.num_kv_heads, " do not divide"));
  }
  c.head_dim = c.hidden / c.num_q_heads;
  KVQ_ASSIGN_OR_RETURN(double eps, file.GetFloat("llama.attention.layer_norm_rms_epsilon"));
  c.rms_eps = static_cast<float>(eps);
  double theta = 10000.0;
  if (file.Has("llama.rope.freq_base")) {
    KVQ_ASSIGN_OR_RETURN(theta, file.GetFloat("llama.rope.freq_base"));
  }
  c.rope.theta = static_cast<float>(theta);
  c.rope.rotary_dim = c.head_dim;
  if (file.Has("llama.rope.dimension_count")) {
    KVQ_ASSIGN_OR_RETURN(c.rope.rotary_dim, GetPositiveInt(file, "llama.rope.dimension_count"));
  }
  c.rope.pairing = RopeConfig::Pairing::kAdjacent;
  KVQ_RETURN_IF_ERROR(c.rope.Validate(c.head_dim));
  return c;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const GgufFile& file) {
  KVQ_ASSIGN_OR_RETURN(LlamaConfig config, LlamaConfig::FromGguf(file));
  std::unique_ptr<LlamaModel> m(new LlamaModel(config));
  const int64_t h = config.hidden, f = config.ffn;
  const int64_t kv = static_cast<int64_t>(config.num_kv_heads) * config.head_dim;
  KVQ_ASSIGN_OR_RETURN(m->token_embd_, LoadTensor(file, "token_embd.weight", config.vocab * h));
  KVQ_ASSIGN_OR_RETURN(m->output_norm_, LoadTensor(file, "output_norm.weight", h));
  if (file.Tensor("output.weight").ok()) {
    KVQ_ASSIGN_OR_RETURN(m->output_, LoadTensor(file, "output.weight", config.vocab * h));
  }
  m->layers_.resize(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    Layer& L = m->layers_[l];
    const std::string p = absl::StrCat("blk.", l, ".");
    KVQ_ASSIGN_OR_RETURN(L.attn_norm, LoadTensor(file, p + "attn_norm.weight", h));
    KVQ_ASSIGN_OR_RETURN(L.wq, LoadTensor(file, p + "attn_q.weight", h * h));
    KVQ_ASSIGN_OR_RETURN(L.wk, LoadTensor(file, p + "attn_k.weight", kv * h));
    KVQ_ASSIGN_OR_RETURN(L.wv, LoadTensor(file, p + "attn_v.weight", kv * h));
    KVQ_ASSIGN_OR_RETURN(L.wo, LoadTensor(file, p + "attn_output.weight", h * h));
    KVQ_ASSIGN_OR_RETURN(L.ffn_norm, LoadTensor(file, p + "ffn_norm.weight", h));
    KVQ_ASSIGN_OR_RETURN(L.w_gate, LoadTensor(file, p + "ffn_gate.weight", f * h));
    KVQ_ASSIGN_OR_RETURN(L.w_up, LoadTensor(file, p + "ffn_up.weight", f * h));
    KVQ_ASSIGN_OR_RETURN(L.w_down, LoadTensor(file, p + "ffn_down.weight", h * f));
  }
  return m;
}

size_t LlamaModel::weight_bytes() const {
  size_t n = token_embd_.size() + output_norm_.size() + output_.size();
  for (const Layer& L : layers_) {
    n += L.attn_norm.size() + L.wq.size() + L.wk.size() + L.wv.size() + L.wo.size() +
         L.ffn_norm.size() + L.w_gate.size() + L.w_up.size() + L.w_down.size();
  }
  return n * sizeof(float);
}

size_t LlamaModel::ScratchBytes(int tokens) const {
  const size_t n = tokens;
  const size_t kv = static_cast<size_t>(config_.num_kv_heads) * config_.head_dim;
  // x, normed, q, attention out, projected; k, v; gate, up; all logits.
  return sizeof(float) * n *
         (5 * config_.hidden + 2 * kv + 2 * config_.ffn + static_cast<size_t>(config_.vocab));
}

absl::Status LlamaModel::Forward(absl::Span<const int32_t> tokens, AttentionCache* cache,
                                 bool all_logits, std::vector<float>* logits) {
  const LlamaConfig& c = config_;
  const int n = static_cast<int>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError("tokens: empty");
  const int start = cache->num_tokens();
  const int H = c.hidden, F = c.ffn, D = c.head_dim;
  const int KV = c.num_kv_heads * D;
  for (int i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "] = ", tokens[i], " is outside [0, ", c.vocab, ")"));
    }
  }
  const size_t N = n;
  std::vector<float> x(N * H), xn(N * H), q(N * H), attn(N * H), proj(N * H);
  std::vector<float> k(N * KV), v(N * KV), gate(N * F), up(N * F);
  for (int i = 0; i < n; ++i) {
    std::copy_n(&token_embd_[static_cast<size_t>(tokens[i]) * H], H, &x[static_cast<size_t>(i) * H]);
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[l];
    RmsNorm(x.data(), L.attn_norm, n, H, c.rms_eps, xn.data());
    MatMul(xn.data(), L.wq, n, H, H, q.data());
    MatMul(xn.data(), L.wk, n, H, KV, k.data());
    MatMul(xn.data(), L.wv, n, H, KV, v.data());
    const bool rotate_keys = !cache->KeysBeforeRope();
#pragma omp parallel for schedule(static) if (n >= kParallelRows)
    for (int i = 0; i < n; ++i) {
      for (int hq = 0; hq < c.num_q_heads; ++hq) {
        rope_.Apply(&q[static_cast<size_t>(i) * H + hq * D], start + i);
      }
      if (rotate_keys) {
        for (int hk = 0; hk < c.num_kv_heads; ++hk) {
          rope_.Apply(&k[static_cast<size_t>(i) * KV + hk * D], start + i);
        }
      }
    }
    KVQ_RETURN_IF_ERROR(cache->AppendAttend(l, n, k.data(), v.data(), q.data(), attn.data()));
    MatMul(attn.data(), L.wo, n, H, H, proj.data());
    for (size_t i = 0; i < N * H; ++i) x[i] += proj[i];
    RmsNorm(x.data(), L.ffn_norm, n, H, c.rms_eps, xn.data());
    MatMul(xn.data(), L.w_gate, n, H, F, gate.data());
    MatMul(xn.data(), L.w_up, n, H, F, up.data());
#pragma omp parallel for schedule(static) if (n >= kParallelRows)
    for (size_t i = 0; i < N * F; ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
    MatMul(gate.data(), L.w_down, n, F, H, proj.data());
    for (size_t i = 0; i < N * H; ++i) x[i] += proj[i];
  }
  const int rows = all_logits ? n : 1;
  const float* last = x.data() + (all_logits ? 0 : (N - 1) * H);
  RmsNorm(last, output_norm_, rows, H, c.rms_eps, xn.data());
  logits->resize(static_cast<size_t>(rows) * c.vocab);
  MatMul(xn.data(), output_.empty() ? token_embd_ : output_, rows, H, c.vocab, logits->data());
  return absl::OkStatus();
}

}  // namespace kvq::eval
