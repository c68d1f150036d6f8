#include "service/sequence_args.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/quoted.h"
#include "kernels/status_macros.h"
#include "service/tensor_codec.h"

namespace kvq {
namespace {

// The loaded calibration `name` names for `spec` on `shape`; null for a
// scheme that takes none.
absl::StatusOr<std::shared_ptr<const CalibrationFile>> CalibrationFromWire(
    const QuantSpec& spec, absl::string_view name, const Calibrations* calibrations,
    const ModelShape& shape) {
  if (!TakesCalibration(spec)) {
    if (name.empty()) return nullptr;
    return absl::InvalidArgumentError(absl::StrCat("calibration: scheme ", Quoted(spec.ToString()),
                                                   " takes no calibration; leave it empty"));
  }
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration: scheme ", Quoted(spec.ToString()),
        " needs one: name a calibration the server has loaded (ServerInfo.calibrations)"));
  }
  std::shared_ptr<const CalibrationFile> file =
      calibrations == nullptr ? nullptr : calibrations->Find(name);
  if (file == nullptr) {
    return absl::NotFoundError(absl::StrCat("calibration ", Quoted(name),
                                            " is not loaded on this server "
                                            "(ServerInfo.calibrations lists those that are)"));
  }
  KVQ_RETURN_IF_ERROR(CheckCalibrationShape(file->calibration, shape.num_layers,
                                            shape.num_kv_heads, shape.head_dim));
  return file;
}

}  // namespace

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
    absl::string_view calibration, const Calibrations* calibrations,
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
  KVQ_ASSIGN_OR_RETURN(args.calibration,
                       CalibrationFromWire(spec, calibration, calibrations, args.shape));
  args.prompt_token_ids.assign(prompt_token_ids.begin(), prompt_token_ids.end());
  return args;
}

}  // namespace kvq
