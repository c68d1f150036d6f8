#include "client/sequence_config.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace kvq {

absl::StatusOr<StreamConfig> SequenceConfig::ToStreamConfig() const {
  StreamConfig config;
  KVQ_ASSIGN_OR_RETURN(config.spec, QuantSpec::Parse(scheme));
  config.head_dim = layout.head_dim;
  config.rope = layout.rope;
  KVQ_RETURN_IF_ERROR(config.Validate());
  if (config.spec.nuq) {
    const size_t want = static_cast<size_t>(layout.num_layers) * layout.num_kv_heads;
    if (codebooks.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "scheme ", scheme, " has nuq: it needs ", want,
          " codebooks (one per layer and kv head), got ", codebooks.size()));
    }
  }
  return config;
}

const Codebook* SequenceConfig::codebook(int layer, int head) const {
  const size_t i = static_cast<size_t>(layer) * layout.num_kv_heads + head;
  return i < codebooks.size() ? &codebooks[i] : nullptr;
}

void ToProto(const RopeConfig& rope, v1::RopeParams* out) {
  out->set_theta(rope.theta);
  out->set_rotary_dim(rope.rotary_dim);
  out->set_pairing(rope.pairing == RopeConfig::Pairing::kAdjacent
                       ? v1::RopeParams::PAIRING_ADJACENT
                       : v1::RopeParams::PAIRING_HALF_SPLIT);
  switch (rope.scaling) {
    case RopeConfig::Scaling::kNone:
      out->set_scaling(v1::RopeParams::SCALING_NONE);
      break;
    case RopeConfig::Scaling::kLinear:
      out->set_scaling(v1::RopeParams::SCALING_LINEAR);
      break;
    case RopeConfig::Scaling::kNtk:
      out->set_scaling(v1::RopeParams::SCALING_NTK);
      break;
  }
  out->set_factor(rope.factor);
}

RopeConfig FromProto(const v1::RopeParams& rope) {
  RopeConfig r;
  r.theta = rope.theta() == 0.0f ? 10000.0f : rope.theta();
  r.rotary_dim = rope.rotary_dim();
  r.pairing = rope.pairing() == v1::RopeParams::PAIRING_ADJACENT ? RopeConfig::Pairing::kAdjacent
                                                                : RopeConfig::Pairing::kHalfSplit;
  switch (rope.scaling()) {
    case v1::RopeParams::SCALING_LINEAR:
      r.scaling = RopeConfig::Scaling::kLinear;
      break;
    case v1::RopeParams::SCALING_NTK:
      r.scaling = RopeConfig::Scaling::kNtk;
      break;
    default:
      r.scaling = RopeConfig::Scaling::kNone;
  }
  r.factor = rope.factor() == 0.0f ? 1.0f : rope.factor();
  return r;
}

void ToProto(const ModelLayout& layout, v1::ModelLayout* out) {
  out->set_num_layers(layout.num_layers);
  out->set_num_kv_heads(layout.num_kv_heads);
  out->set_num_q_heads(layout.num_q_heads);
  out->set_head_dim(layout.head_dim);
  ToProto(layout.rope, out->mutable_rope());
}

ModelLayout FromProto(const v1::ModelLayout& layout) {
  ModelLayout l;
  l.num_layers = layout.num_layers();
  l.num_kv_heads = layout.num_kv_heads();
  l.num_q_heads = layout.num_q_heads();
  l.head_dim = layout.head_dim();
  l.rope = FromProto(layout.rope());
  return l;
}

namespace {

void LevelsToProto(const std::vector<float>& levels, int head_dim, int n, v1::Tensor* out) {
  out->set_dtype(v1::DTYPE_FP32);
  out->add_shape(head_dim);
  out->add_shape(n);
  out->mutable_data()->resize(levels.size() * sizeof(float));
  if (!levels.empty()) std::memcpy(out->mutable_data()->data(), levels.data(), levels.size() * 4);
}

}  // namespace

void ToProto(const Codebook& codebook, v1::Codebook* out) {
  LevelsToProto(codebook.key_levels, codebook.head_dim, codebook.levels(),
                out->mutable_key_levels());
  LevelsToProto(codebook.value_levels, codebook.head_dim, codebook.levels(),
                out->mutable_value_levels());
}

}  // namespace kvq
