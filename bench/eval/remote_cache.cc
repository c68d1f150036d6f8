#include "bench/eval/remote_cache.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/sequence_config.h"
#include "kernels/status_macros.h"

namespace kvq::eval {
namespace {

ModelLayout ToLayout(const CacheShape& shape) {
  ModelLayout layout;
  layout.num_layers = shape.num_layers;
  layout.num_kv_heads = shape.num_kv_heads;
  layout.num_q_heads = shape.num_q_heads;
  layout.head_dim = shape.head_dim;
  layout.rope = shape.rope;
  return layout;
}

// [n][heads * d] rows to [heads][n][d].
std::vector<float> HeadsFirst(const float* x, int n, int heads, int d) {
  std::vector<float> out(static_cast<size_t>(n) * heads * d);
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < n; ++i) {
      std::memcpy(&out[(static_cast<size_t>(h) * n + i) * d],
                  x + (static_cast<size_t>(i) * heads + h) * d, d * sizeof(float));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RemoteAttentionCache>> RemoteAttentionCache::Create(
    KvqClient* client, const CacheShape& shape, const QuantSpec& spec,
    const std::vector<Codebook>* codebooks, const std::string& calibration) {
  CreateOptions options;
  options.config.layout = ToLayout(shape);
  options.config.scheme = spec.ToString();
  if (spec.nuq && codebooks != nullptr) options.config.codebooks = *codebooks;
  options.config.calibration = calibration;
  KVQ_ASSIGN_OR_RETURN(SequenceInfo info, client->CreateSequence(options));
  return std::unique_ptr<RemoteAttentionCache>(
      new RemoteAttentionCache(client, shape, spec, info.sequence_id));
}

RemoteAttentionCache::~RemoteAttentionCache() { (void)client_->Release(id_); }

absl::Status RemoteAttentionCache::AppendAttend(int layer, int n, const float* k, const float* v,
                                                const float* q, float* out) {
  const int d = shape_.head_dim;
  const int kv = shape_.num_kv_heads;
  const int qh = shape_.num_q_heads;
  AppendAttendItem item;
  item.sequence_id = id_;
  KVQ_ASSIGN_OR_RETURN(item.k, HostTensor::FromFloats(HeadsFirst(k, n, kv, d), {kv, n, d}));
  KVQ_ASSIGN_OR_RETURN(item.v, HostTensor::FromFloats(HeadsFirst(v, n, kv, d), {kv, n, d}));
  KVQ_ASSIGN_OR_RETURN(
      item.q, HostTensor::FromFloats(absl::MakeConstSpan(q, static_cast<size_t>(n) * qh * d),
                                     {n, qh, d}));
  KVQ_ASSIGN_OR_RETURN(std::vector<AttendOutput> results,
                       client_->AppendAttend(layer, absl::MakeConstSpan(&item, 1)));
  if (results.size() != 1 || results[0].out.num_elements() != static_cast<int64_t>(n) * qh * d) {
    return absl::InternalError(absl::StrCat("AppendAttend of layer ", layer,
                                            ": unexpected result shape"));
  }
  const std::vector<float> o = results[0].out.ToFloats();
  std::memcpy(out, o.data(), o.size() * sizeof(float));
  tokens_[layer] += n;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<AttentionCache>> RemoteAttentionCache::Fork() const {
  KVQ_ASSIGN_OR_RETURN(ForkResult fork, client_->Fork(id_));
  std::unique_ptr<RemoteAttentionCache> copy(
      new RemoteAttentionCache(client_, shape_, spec_, fork.sequence_id));
  copy->tokens_ = tokens_;
  return copy;
}

absl::StatusOr<ByteBreakdown> RemoteAttentionCache::Bytes() const {
  KVQ_ASSIGN_OR_RETURN(v1::StatsResponse stats, client_->Stats(id_));
  ByteBreakdown b;
  b.codes = stats.bytes().codes();
  b.scales = stats.bytes().scales();
  b.outliers = stats.bytes().outliers();
  b.residual = stats.bytes().residual();
  b.sink = stats.bytes().sink();
  b.codebook = stats.bytes().codebook();
  b.padding = stats.bytes().padding();
  return b;
}

}  // namespace kvq::eval
