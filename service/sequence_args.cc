#include "service/sequence_args.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "service/tensor_codec.h"

namespace kvq {

absl::StatusOr<ModelShape> ShapeFromWire(const v1::ModelLayout& l) {
  ModelShape m;
  m.num_layers = l.num_layers();
  m.num_kv_heads = l.num_kv_heads();
  m.num_q_heads = l.num_q_heads();
  m.head_dim = l.head_dim();
  const v1::RopeParams& r = l.rope();
  m.rope.theta = r.theta() == 0.0f ? 10000.0f : r.theta();
  m.rope.rotary_dim = r.rotary_dim();
  m.rope.factor = r.factor() == 0.0f ? 1.0f : r.factor();
  switch (r.pairing()) {
    case v1::RopeParams::PAIRING_HALF_SPLIT: m.rope.pairing = RopeConfig::Pairing::kHalfSplit; break;
    case v1::RopeParams::PAIRING_ADJACENT: m.rope.pairing = RopeConfig::Pairing::kAdjacent; break;
    default: return absl::InvalidArgumentError("layout.rope.pairing is not a known pairing");
  }
  switch (r.scaling()) {
    case v1::RopeParams::SCALING_NONE: m.rope.scaling = RopeConfig::Scaling::kNone; break;
    case v1::RopeParams::SCALING_LINEAR: m.rope.scaling = RopeConfig::Scaling::kLinear; break;
    case v1::RopeParams::SCALING_NTK: m.rope.scaling = RopeConfig::Scaling::kNtk; break;
    default: return absl::InvalidArgumentError("layout.rope.scaling is not a known scaling");
  }
  KVQ_RETURN_IF_ERROR(m.Validate());
  if (absl::Status st = m.rope.Validate(m.head_dim); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("layout.", st.message()));
  }
  return m;
}

absl::StatusOr<CreateSequenceArgs> SequenceArgsFromWire(
    absl::string_view tenant, absl::string_view ns, const v1::ModelLayout& layout,
    absl::string_view scheme, const google::protobuf::RepeatedPtrField<v1::Codebook>& codebooks,
    const google::protobuf::RepeatedField<int32_t>& prompt_token_ids) {
  CreateSequenceArgs args;
  args.tenant = std::string(tenant);
  args.ns = std::string(ns);
  KVQ_ASSIGN_OR_RETURN(args.shape, ShapeFromWire(layout));
  // Scheme errors quote the scheme: bound it first.
  if (scheme.size() > kMaxSchemeChars) {
    return absl::InvalidArgumentError(absl::StrCat("scheme has ", scheme.size(),
                                                   " characters, at most ", kMaxSchemeChars));
  }
  args.scheme = std::string(scheme);
  KVQ_ASSIGN_OR_RETURN(QuantSpec spec, QuantSpec::Parse(args.scheme));
  for (int i = 0; i < codebooks.size(); ++i) {
    const std::string field = absl::StrCat("codebooks[", i, "]");
    const int levels = 1 << spec.bits;
    Codebook cb;
    cb.bits = spec.bits;
    cb.head_dim = args.shape.head_dim;
    KVQ_ASSIGN_OR_RETURN(WireTensor k, CheckTensor(codebooks[i].key_levels(),
                                                    field + ".key_levels",
                                                    {args.shape.head_dim, levels}));
    KVQ_ASSIGN_OR_RETURN(WireTensor v, CheckTensor(codebooks[i].value_levels(),
                                                    field + ".value_levels",
                                                    {args.shape.head_dim, levels}));
    cb.key_levels = ToFloats(k);
    cb.value_levels = ToFloats(v);
    args.codebooks.push_back(std::move(cb));
  }
  args.prompt_token_ids.assign(prompt_token_ids.begin(), prompt_token_ids.end());
  return args;
}

}  // namespace kvq
