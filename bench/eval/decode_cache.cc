#include "bench/eval/decode_cache.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/status_macros.h"

namespace kvq::eval {
namespace {

// Queries per attention tile: bounds the score scratch at tile * tokens.
constexpr int kQueryTile = 64;

// Row t of `rows` ([tokens][d] floats) as a one-row output view.
TensorView RowView(std::vector<float>& rows, int t, int count, int d) {
  return {&rows[static_cast<size_t>(t) * d], DType::kFloat32, count, d, d};
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeFaithfulCache>> DecodeFaithfulCache::Create(
    const CacheShape& shape, const QuantSpec& spec, const std::vector<Codebook>* codebooks,
    const KernelBackend* backend, LayerRange layers, const ModelCalibration* calibration) {
  KVQ_ASSIGN_OR_RETURN(auto streams, KvqAttentionCache::Create(shape, spec, codebooks, backend,
                                                               layers, calibration));
  return std::unique_ptr<DecodeFaithfulCache>(new DecodeFaithfulCache(shape, std::move(streams)));
}

absl::StatusOr<std::unique_ptr<AttentionCache>> DecodeFaithfulCache::Fork() const {
  return absl::UnimplementedError("DecodeFaithfulCache: decode-faithful scoring does not fork");
}

absl::Status DecodeFaithfulCache::AppendOneByOne(int layer, int n, const float* k,
                                                 const float* v) {
  const int d = shape_.head_dim;
  const int kv_heads = shape_.num_kv_heads;
  const int row = kv_heads * d;
  const KvStream& first = streams_->kv_stream(layer, 0);
  const int start = first.num_tokens();
  const int quantized_before = first.quantized_tokens();
  const size_t size = static_cast<size_t>(start + n) * d;
  for (int h = 0; h < kv_heads; ++h) {
    Views& w = views(layer, h);
    for (auto* rows : {&w.k_fp16, &w.v_fp16, &w.k_quant, &w.v_quant}) rows->resize(size, 0.0f);
  }
  const ReadOptions read;  // fp32, keys post-RoPE: as attention sees them.
  for (int i = 0; i < n; ++i) {
    const int t = start + i;
    KVQ_RETURN_IF_ERROR(streams_->Append(layer, 1, k + static_cast<size_t>(i) * row,
                                         v + static_cast<size_t>(i) * row));
    quantized_at_[layer].push_back(first.quantized_tokens());
    // A token the append flushed at once is never read in fp16.
    if (Quantized(layer, t, t)) continue;
    for (int h = 0; h < kv_heads; ++h) {
      Views& w = views(layer, h);
      KVQ_RETURN_IF_ERROR(streams_->kv_stream(layer, h).Read(
          t, t + 1, read, RowView(w.k_fp16, t, 1, d), RowView(w.v_fp16, t, 1, d)));
    }
  }
  // Quantized rows never change once written: read each once, when flushed.
  const int base = first.page_base();
  const int begin = base + quantized_before;
  const int end = base + first.quantized_tokens();
  if (end > begin) {
    for (int h = 0; h < kv_heads; ++h) {
      Views& w = views(layer, h);
      KVQ_RETURN_IF_ERROR(streams_->kv_stream(layer, h).Read(
          begin, end, read, RowView(w.k_quant, begin, end - begin, d),
          RowView(w.v_quant, begin, end - begin, d)));
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeFaithfulCache::AppendAttend(int layer, int n, const float* k, const float* v,
                                               const float* q, float* out) {
  KVQ_RETURN_IF_ERROR(AppendOneByOne(layer, n, k, v));
  const int d = shape_.head_dim;
  const int q_heads = shape_.num_q_heads;
  const int group = q_heads / shape_.num_kv_heads;
  const int ld = q_heads * d;
  const int start = static_cast<int>(quantized_at_[layer].size()) - n;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int page_base = streams_->kv_stream(layer, 0).page_base();
  std::vector<float> p_fp16, p_quant;  // Scores, then probabilities, by key view.
  for (int hq = 0; hq < q_heads; ++hq) {
    const Views& w = views(layer, hq / group);
    for (int i0 = 0; i0 < n; i0 += kQueryTile) {
      const int rows = std::min(kQueryTile, n - i0);
      const int keys = start + i0 + rows;  // Visible to the tile's last query.
      p_fp16.resize(static_cast<size_t>(rows) * keys);
      p_quant.resize(p_fp16.size());
      const float* qt = q + static_cast<size_t>(i0) * ld + hq * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, d, scale, qt, ld,
                  w.k_fp16.data(), d, 0.0f, p_fp16.data(), keys);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, d, scale, qt, ld,
                  w.k_quant.data(), d, 0.0f, p_quant.data(), keys);
      for (int r = 0; r < rows; ++r) {
        const int p = start + i0 + r;
        float* a = &p_fp16[static_cast<size_t>(r) * keys];
        float* b = &p_quant[static_cast<size_t>(r) * keys];
        // Keys [quantized_begin, quantized_end) are read quantized by query p.
        const int quantized_begin = page_base;
        const int quantized_end = page_base + quantized_at_[layer][p];  // <= p + 1.
        if (quantized_end > quantized_begin) {
          std::copy(b + quantized_begin, b + quantized_end, a + quantized_begin);
        }
        float max = -std::numeric_limits<float>::infinity();
        for (int j = 0; j <= p; ++j) max = std::max(max, a[j]);
        double sum = 0.0;
        for (int j = 0; j <= p; ++j) {
          a[j] = std::exp(a[j] - max);
          sum += a[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int j = 0; j <= p; ++j) {
          const float weight = a[j] * inv;
          const bool quantized = j >= quantized_begin && j < quantized_end;
          a[j] = quantized ? 0.0f : weight;
          b[j] = quantized ? weight : 0.0f;
        }
        std::fill(a + p + 1, a + keys, 0.0f);
        std::fill(b + p + 1, b + keys, 0.0f);
      }
      float* o = out + static_cast<size_t>(i0) * ld + hq * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, keys, 1.0f, p_fp16.data(),
                  keys, w.v_fp16.data(), d, 0.0f, o, ld);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d, keys, 1.0f, p_quant.data(),
                  keys, w.v_quant.data(), d, 1.0f, o, ld);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvq::eval
