// QuantSpec: the one value type that names a KV storage scheme.
//
// It parses from and prints to a short string used by the API, the CLI and
// the benchmarks, e.g. "kivi2:g32:r128:pre_rope:outliers=1:sink=4".
//
// Grammar: <base>[:<option>]*
//   base     fp16 | bf16 | int8 | fp8_e4m3 | kivi4 | kivi3 | kivi2 | crq<K>
//   options  (kivi only)
//     vN          value codes at N bits (2, 3 or 4) while keys keep the
//                 base's bits, e.g. kivi4:v2 (as llama.cpp's separate
//                 cache-type-k / cache-type-v; keys are the more sensitive
//                 side); not with nuq
//     gN          group size G (tokens per key group, channels per value
//                 group); power of two in [8, 256]; default 32
//     rN          fp16 residual window R; multiple of G, <= 4096; default 128;
//                 r0 keeps only the unfinished group (< G tokens) in fp16
//     fit         each key group's range is fitted to its values (least
//                 squares over a sweep of steps, clipping the rare far
//                 token) instead of min..max; same layout and bits, lower
//                 key error at 2 and 3 bits (kernels/cpu/range_fit.h says
//                 why values are not fitted); not with nuq
//     p8          group scales and zero points as 8-bit codes under one fp16
//                 step/base header per block (double quantization, as in
//                 llama.cpp's k-quants and QLoRA); p16 (default) stores them
//                 in fp16
//     pre_rope    keys are appended before RoPE; RoPE is applied in attention
//                 and on fetch
//     outliers=P  per quantization block the P% largest deviations are kept
//                 exactly in a sparse fp16 side table (0 < P <= 10)
//     sink=S      the first S tokens stay fp16 (0 <= S <= 1024)
//     nuq         non-uniform levels from a per-channel k-means codebook
//     rotate      randomized Hadamard transform over head_dim
//     ktok        keys per-token instead of per-channel (for ablations)
//   crq<K> (calibrated rotated quantization, docs/KERNELS.md): each token is
//   centered and scaled by the stream's HeadCalibration, rotated by a
//   randomized Hadamard transform and coded per coordinate with the
//   Lloyd-Max levels of N(0, 1), one fp16 gain per token and side. Key bits
//   K in {2, 2.5, 3, 3.5, 4}; a fractional width splits the coordinates:
//   [0, d/2) at ceil(K) bits, [d/2, d) at floor(K). Its options:
//     vV          value bits from the same set when they differ from K
//     rN          fp16 residual window: the tail is quantized every N tokens
//                 (0 <= N <= 4096; default 128; r0 quantizes on append)
//     sink=S      as above
//     pre_rope    required: keys arrive before RoPE (the calibration's key
//                 means are pre-RoPE); the stream's RopeConfig applies it
//   Any other option is refused naming it. A crq stream needs a calibration
//   (KvStream::Create).
// ToString() prints the canonical form: base, vN when it differs from the
// base's bits, g and r (for kivi; r for crq), fit and p8 when set, then the
// options in the order above.
#ifndef KVQ_KERNELS_QUANT_SPEC_H_
#define KVQ_KERNELS_QUANT_SPEC_H_

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace kvq {

enum class SchemeKind { kFp16, kBf16, kInt8, kFp8E4m3, kKivi, kCrq };

// How keys are grouped for quantization.
enum class KeyAxis {
  kPerChannel,  // KIVI: one scale/zero per channel per G tokens.
  kPerToken,    // One scale/zero per token per G channels (like values).
};

struct QuantSpec {
  SchemeKind kind = SchemeKind::kFp16;
  int bits = 16;        // Bits per code: 16, 8, 4, 3 or 2 (keys; values too
                        // unless vbits is set); 0 for crq, whose widths
                        // can be fractional and live in the half-bit fields.
  int vbits = 0;        // kivi only: value code bits when they differ from
                        // `bits` (vN); 0 = same as `bits` (the only spelling
                        // of equal widths: Validate() rejects vbits == bits).
  int key_half_bits = 0;    // crq only: key bits x 2 (4..8 = 2..4 bits).
  int value_half_bits = 0;  // crq only: value bits x 2 when they differ
                            // (vV); 0 = same as the keys (as vbits).
  int group = 32;       // G, kivi only.
  int residual = 128;   // R, kivi and crq.
  int param_bits = 16;  // 16: fp16 scale/zero per group; 8: p8 (kivi only).
  bool fit = false;     // Least-squares group ranges instead of min/max.
  KeyAxis key_axis = KeyAxis::kPerChannel;
  bool pre_rope = false;
  double outlier_percent = 0.0;
  int sink = 0;
  bool nuq = false;
  bool rotate = false;

  static absl::StatusOr<QuantSpec> Parse(absl::string_view text);
  std::string ToString() const;
  // Checks ranges and combinations; Parse() calls it.
  absl::Status Validate() const;

  bool is_kivi() const { return kind == SchemeKind::kKivi; }
  bool is_crq() const { return kind == SchemeKind::kCrq; }
  // Whether the newest tokens wait in an fp16 tail before they are
  // quantized (kivi always; crq when its residual window is not 0).
  bool has_tail() const { return is_kivi() || (is_crq() && residual > 0); }
  bool has_outliers() const { return outlier_percent > 0.0; }
  int key_bits() const { return bits; }
  int value_bits() const { return vbits != 0 ? vbits : bits; }
  // crq only: the widths in half bits (5 = 2.5 bits).
  int crq_half_bits(bool key) const {
    return key || value_half_bits == 0 ? key_half_bits : value_half_bits;
  }
  // Tokens quantized at once when the fp16 tail fills: max(R, G) for kivi,
  // max(R, 1) for crq, 1 for the other per-token schemes (they quantize on
  // append).
  int flush_tokens() const;

  friend bool operator==(const QuantSpec&, const QuantSpec&) = default;

 private:
  absl::Status ValidateCrq() const;
};

// Every base scheme name the parser accepts, in a stable order.
const std::vector<std::string>& SchemeNames();

}  // namespace kvq

#endif  // KVQ_KERNELS_QUANT_SPEC_H_
