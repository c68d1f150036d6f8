// The store's CreateSequenceArgs from the wire fields CreateSequence and
// MatchPrefix share, checked at the RPC edge.
#ifndef KVQ_SERVICE_SEQUENCE_ARGS_H_
#define KVQ_SERVICE_SEQUENCE_ARGS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvq/v1/kvq.pb.h"
#include "service/calibrations.h"
#include "service/sequence_store.h"

namespace kvq {

// Longest scheme string accepted (the longest valid one is far shorter).
inline constexpr size_t kMaxSchemeChars = 256;

// INVALID_ARGUMENT naming the field ("layout.rope.pairing ...").
absl::StatusOr<ModelShape> ShapeFromWire(const v1::ModelLayout& l);

// tenant, namespace, layout, scheme, codebooks, calibration (looked up in
// `calibrations`, which may be null: none loaded) and prompt ids; the
// caller sets the id and the lease. INVALID_ARGUMENT for a bad layout, a
// scheme longer than kMaxSchemeChars or unknown, a bad codebook tensor, a
// crq scheme without a calibration or another scheme with one, or a
// calibration of another shape than the layout; NOT_FOUND for a
// calibration not loaded (the store checks the rest).
absl::StatusOr<CreateSequenceArgs> SequenceArgsFromWire(
    absl::string_view tenant, absl::string_view ns, const v1::ModelLayout& layout,
    absl::string_view scheme, const google::protobuf::RepeatedPtrField<v1::Codebook>& codebooks,
    absl::string_view calibration, const Calibrations* calibrations,
    const google::protobuf::RepeatedField<int32_t>& prompt_token_ids);

}  // namespace kvq

#endif  // KVQ_SERVICE_SEQUENCE_ARGS_H_
