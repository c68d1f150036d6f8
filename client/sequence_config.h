// What CreateSequence fixes about a sequence, in client-side C++ form, and
// its conversions to the wire messages and to the kernels' StreamConfig.
#ifndef KVQ_CLIENT_SEQUENCE_CONFIG_H_
#define KVQ_CLIENT_SEQUENCE_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/rope.h"
#include "kernels/stream_config.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {

// The attention shape of the model (v1::ModelLayout).
struct ModelLayout {
  int num_layers = 0;
  int num_kv_heads = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  RopeConfig rope;  // Used by kvq only for pre_rope schemes.
};

struct SequenceConfig {
  ModelLayout layout;
  // Scheme string; after CreateSequence prefer the canonical form the server
  // returned (SequenceInfo::scheme). The default is the one the real-model
  // evaluation picked (docs/QUALITY.md): 4-bit KIVI with 4 fp16 sink tokens
  // stays within 0.5-1% perplexity of the fp16 cache at 2.8x less memory;
  // add pre_rope once the layout carries the model's RoPE parameters, and
  // go below 4 bits only after measuring the model's quality with kvq-eval.
  std::string scheme = "kivi4:g32:r128:sink=4";
  // nuq schemes: one per (layer, kv head), [layer][kv_head] order.
  std::vector<Codebook> codebooks;
  // crq schemes: the name of a calibration the server has loaded
  // (ServerInfo.calibrations); empty for every other scheme.
  std::string calibration;

  // The config of each of the sequence's streams, as the server builds it:
  // the scheme, head_dim, the layout's RoPE, the default page size and
  // rotation seed. INVALID_ARGUMENT for a bad scheme or layout.
  absl::StatusOr<StreamConfig> ToStreamConfig() const;
  // The codebook of (layer, head), or nullptr when there are none.
  const Codebook* codebook(int layer, int head) const;
};

void ToProto(const RopeConfig& rope, v1::RopeParams* out);
// Applies the proto's "0 means default" rules.
RopeConfig FromProto(const v1::RopeParams& rope);
void ToProto(const ModelLayout& layout, v1::ModelLayout* out);
ModelLayout FromProto(const v1::ModelLayout& layout);
// fp32 [head_dim, 2^bits] tensors per side.
void ToProto(const Codebook& codebook, v1::Codebook* out);

}  // namespace kvq

#endif  // KVQ_CLIENT_SEQUENCE_CONFIG_H_
