// DeviceStreamView: one (layer, KV head) stream as the device kernels see
// it. Plain data (device pointers and the shared PageLayout by value), so
// it is passed to kernels as is; no CUDA headers. The service's device
// residency code fills it from a KvStream whose pages live in the device
// page pool; the kernels only read it.
#ifndef KVQ_KERNELS_HD_DEVICE_STREAM_VIEW_H_
#define KVQ_KERNELS_HD_DEVICE_STREAM_VIEW_H_

#include <cstdint>

#include "kernels/hd/dequant_hd.h"
#include "kernels/page_layout.h"

namespace kvq {
namespace hd {

// RoPE of a pre-RoPE stream's keys (kernels/rope.h) as plain data: built
// by hd::MakeRopeParams (attention_hd.h) from the stream's RopeConfig.
struct RopeParams {
  int rotary_dim = 0;          // 0: keys are stored post-RoPE (nothing to apply).
  bool adjacent = false;       // Pairs (2i, 2i + 1); else (i, i + rotary_dim / 2).
  double base = 10000.0;       // theta, NTK scaling applied.
  float linear_factor = 1.0f;  // Positions divided by it (linear scaling).
};

}  // namespace hd

struct DeviceStreamView {
  PageLayout layout;
  // Token positions: [0, sink_tokens) in the fp16 sink, then
  // quantized_tokens in pages (page p holds positions page_base +
  // p * page_tokens ...), then tail_tokens fp16 rows (the residual).
  int sink_tokens = 0;
  int page_base = 0;  // spec.sink: first position held in pages.
  int quantized_tokens = 0;
  int tail_tokens = 0;
  // Device pointers.
  const uint8_t* const* pages = nullptr;  // [ceil(quantized_tokens / page_tokens)]
  const uint16_t* sink_k = nullptr;       // fp16 [sink_tokens][head_dim]
  const uint16_t* sink_v = nullptr;
  const uint16_t* tail_k = nullptr;       // fp16 [tail_tokens][head_dim]
  const uint16_t* tail_v = nullptr;
  hd::SideExtras key_extras;              // levels: device floats, or null.
  hd::SideExtras value_extras;
  // Attention's view of the stored basis: RoPE to apply to keys, and the
  // Hadamard signs (head_dim device floats) when the stream rotates, so
  // queries are rotated forward and outputs back; null when it does not.
  hd::RopeParams rope;
  const float* rotation_signs = nullptr;

  int num_tokens() const { return sink_tokens + quantized_tokens + tail_tokens; }
};

}  // namespace kvq

#endif  // KVQ_KERNELS_HD_DEVICE_STREAM_VIEW_H_
