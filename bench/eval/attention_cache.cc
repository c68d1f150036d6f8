#include "bench/eval/attention_cache.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/calibration_file.h"
#include "kernels/status_macros.h"

namespace kvq::eval {

StreamConfig MakeStreamConfig(const CacheShape& shape, const QuantSpec& spec) {
  StreamConfig config;
  config.spec = spec;
  config.head_dim = shape.head_dim;
  config.rope = shape.rope;
  return config;
}

absl::StatusOr<EvalScheme> ParseEvalScheme(absl::string_view name, int num_layers) {
  EvalScheme scheme;
  const size_t at = name.find('@');
  KVQ_ASSIGN_OR_RETURN(scheme.spec, QuantSpec::Parse(name.substr(0, at)));
  if (at == absl::string_view::npos) return scheme;
  const absl::string_view range = name.substr(at + 1);
  const size_t dash = range.find('-');
  int first = 0, last = 0;
  bool ok = false;
  if (dash == absl::string_view::npos) {
    ok = absl::SimpleAtoi(range, &first);
    last = first;
  } else {
    ok = absl::SimpleAtoi(range.substr(0, dash), &first) &&
         absl::SimpleAtoi(range.substr(dash + 1), &last);
  }
  if (!ok || first < 0 || first > last || last >= num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scheme \"", name, "\": the layer range after '@' must be A-B or A with 0 <= A <= B <= ",
        num_layers - 1, ", got \"", range, "\""));
  }
  scheme.layers = {first, last};
  return scheme;
}

absl::StatusOr<std::unique_ptr<KvqAttentionCache>> KvqAttentionCache::Create(
    const CacheShape& shape, const QuantSpec& spec, const std::vector<Codebook>* codebooks,
    const KernelBackend* backend, LayerRange layers, const ModelCalibration* calibration) {
  const int streams = shape.num_layers * shape.num_kv_heads;
  if (calibration != nullptr) {
    KVQ_RETURN_IF_ERROR(CheckCalibrationShape(*calibration, shape.num_layers, shape.num_kv_heads,
                                              shape.head_dim));
  }
  if (spec.nuq && (codebooks == nullptr || static_cast<int>(codebooks->size()) != streams)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codebooks: scheme ", spec.ToString(), " needs one per layer and KV head (", streams,
        "), got ", codebooks ? codebooks->size() : 0));
  }
  std::unique_ptr<KvqAttentionCache> cache(new KvqAttentionCache(shape, spec, backend, layers));
  if (spec.pre_rope) cache->rope_ = std::make_unique<Rope>(shape.rope, shape.head_dim);
  const StreamConfig config = MakeStreamConfig(shape, spec);
  StreamConfig fp16 = config;
  fp16.spec = QuantSpec{};  // fp16: the kind QuantSpec defaults to.
  for (int i = 0; i < streams; ++i) {
    const bool quantized = layers.Contains(i / shape.num_kv_heads);
    const Codebook* codebook = spec.nuq && quantized ? &(*codebooks)[i] : nullptr;
    const HeadCalibration* head =
        calibration != nullptr && quantized ? &calibration->heads[i] : nullptr;
    KVQ_ASSIGN_OR_RETURN(auto stream, KvStream::Create(quantized ? config : fp16, backend,
                                                       nullptr, codebook, head));
    cache->streams_.push_back(std::move(stream));
  }
  return cache;
}

absl::Status KvqAttentionCache::Append(int layer, int n, const float* k, const float* v) {
  const int d = shape_.head_dim;
  const int kv_heads = shape_.num_kv_heads;
  const int start = stream(layer, 0).num_tokens();
  if (rope_ != nullptr && !layers_.Contains(layer)) {
    // An fp16 layer of a pre_rope cache: store the keys as the fp16 scheme
    // does, after RoPE.
    rotated_.assign(k, k + static_cast<size_t>(n) * kv_heads * d);
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < kv_heads; ++h) {
        rope_->Apply(&rotated_[(static_cast<size_t>(i) * kv_heads + h) * d], start + i);
      }
    }
    k = rotated_.data();
  }
  for (int h = 0; h < kv_heads; ++h) {
    const ConstTensorView kh{k + h * d, DType::kFloat32, n, d, kv_heads * d};
    const ConstTensorView vh{v + h * d, DType::kFloat32, n, d, kv_heads * d};
    KVQ_RETURN_IF_ERROR(stream(layer, h).Append(kh, vh));
  }
  return absl::OkStatus();
}

absl::Status KvqAttentionCache::AppendAttend(int layer, int n, const float* k, const float* v,
                                             const float* q, float* out) {
  const int d = shape_.head_dim;
  const int kv_heads = shape_.num_kv_heads;
  const int q_heads = shape_.num_q_heads;
  const int group = q_heads / kv_heads;
  const int start = stream(layer, 0).num_tokens();
  KVQ_RETURN_IF_ERROR(Append(layer, n, k, v));
  positions_.resize(n);
  std::iota(positions_.begin(), positions_.end(), start);
  lse_.resize(static_cast<size_t>(n) * q_heads);
  std::vector<AttentionTask> tasks(kv_heads);
  for (int h = 0; h < kv_heads; ++h) {
    AttentionTask& t = tasks[h];
    t.stream = &stream(layer, h);
    t.num_queries = n;
    t.q = q + h * group * d;
    t.q_stride = q_heads * d;
    t.q_positions = positions_.data();
    t.out = out + h * group * d;
    t.out_stride = q_heads * d;
    t.lse = lse_.data() + h * group;
    t.lse_stride = q_heads;
  }
  AttentionOptions options;
  options.group_size = group;
  return backend_->Attend(tasks, options);
}

int KvqAttentionCache::num_tokens() const {
  return streams_.empty() ? 0 : streams_.back()->num_tokens();
}

absl::StatusOr<std::unique_ptr<AttentionCache>> KvqAttentionCache::Fork() const {
  std::unique_ptr<KvqAttentionCache> copy(
      new KvqAttentionCache(shape_, spec_, backend_, layers_));
  if (rope_ != nullptr) copy->rope_ = std::make_unique<Rope>(shape_.rope, shape_.head_dim);
  for (const auto& s : streams_) {
    KVQ_ASSIGN_OR_RETURN(auto forked, s->Fork(s->num_tokens()));
    copy->streams_.push_back(std::move(forked));
  }
  return copy;
}

absl::StatusOr<ByteBreakdown> KvqAttentionCache::Bytes() const {
  ByteBreakdown total;
  for (const auto& s : streams_) total += s->AllocatedBytes();
  return total;
}

ExactAttentionCache::ExactAttentionCache(const CacheShape& shape, bool keys_before_rope)
    : shape_(shape),
      keys_before_rope_(keys_before_rope),
      rope_(std::make_unique<Rope>(shape.rope, shape.head_dim)),
      k_(shape.num_layers),
      v_(shape.num_layers),
      raw_k_(shape.num_layers) {}

absl::Status ExactAttentionCache::AppendAttend(int layer, int n, const float* k, const float* v,
                                               const float* q, float* out) {
  const int d = shape_.head_dim;
  const int kv_heads = shape_.num_kv_heads;
  const int q_heads = shape_.num_q_heads;
  const int group = q_heads / kv_heads;
  const int row = kv_heads * d;
  const int start = static_cast<int>(k_[layer].size() / row);
  raw_k_[layer].insert(raw_k_[layer].end(), k, k + static_cast<size_t>(n) * row);
  v_[layer].insert(v_[layer].end(), v, v + static_cast<size_t>(n) * row);
  k_[layer].insert(k_[layer].end(), k, k + static_cast<size_t>(n) * row);
  if (keys_before_rope_) {
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < kv_heads; ++h) {
        rope_->Apply(&k_[layer][static_cast<size_t>(start + i) * row + h * d], start + i);
      }
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::vector<float>& keys = k_[layer];
  const std::vector<float>& values = v_[layer];
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int i = 0; i < n; ++i) {
    for (int hq = 0; hq < q_heads; ++hq) {
      const int visible = start + i + 1;
      const int h = hq / group;
      const float* qi = q + (static_cast<size_t>(i) * q_heads + hq) * d;
      std::vector<double> p(visible);
      double max_s = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < visible; ++t) {
        const float* kt = &keys[static_cast<size_t>(t) * row + h * d];
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot += static_cast<double>(qi[c]) * kt[c];
        p[t] = dot * scale;
        max_s = std::max(max_s, p[t]);
      }
      double sum = 0.0;
      std::vector<double> acc(d, 0.0);
      for (int t = 0; t < visible; ++t) {
        const double w = std::exp(p[t] - max_s);
        sum += w;
        const float* vt = &values[static_cast<size_t>(t) * row + h * d];
        for (int c = 0; c < d; ++c) acc[c] += w * vt[c];
      }
      float* o = out + (static_cast<size_t>(i) * q_heads + hq) * d;
      for (int c = 0; c < d; ++c) o[c] = static_cast<float>(acc[c] / sum);
    }
  }
  return absl::OkStatus();
}

int ExactAttentionCache::num_tokens() const {
  const int row = shape_.num_kv_heads * shape_.head_dim;
  return k_.empty() ? 0 : static_cast<int>(k_.back().size() / row);
}

absl::StatusOr<std::unique_ptr<AttentionCache>> ExactAttentionCache::Fork() const {
  auto copy = std::make_unique<ExactAttentionCache>(shape_, keys_before_rope_);
  copy->k_ = k_;
  copy->v_ = v_;
  copy->raw_k_ = raw_k_;
  return copy;
}

absl::StatusOr<ByteBreakdown> ExactAttentionCache::Bytes() const {
  ByteBreakdown b;
  for (int l = 0; l < shape_.num_layers; ++l) b.codes += (k_[l].size() + v_[l].size()) * 4;
  return b;
}

}  // namespace kvq::eval
