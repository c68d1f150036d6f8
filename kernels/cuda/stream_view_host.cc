#include "kernels/cuda/stream_view_host.h"

#include "kernels/hd/attention_hd.h"
#include "kernels/numeric.h"

namespace kvq {

std::vector<float> LevelsAsFloats(const KvStream& s, Side side) {
  std::vector<float> levels;
  if (!s.spec().nuq) return levels;
  const int per_channel = 1 << s.layout().side(side).bits;
  levels.reserve(static_cast<size_t>(s.head_dim()) * per_channel);
  for (int c = 0; c < s.head_dim(); ++c) {
    const uint16_t* h = s.levels(side, c);
    for (int i = 0; i < per_channel; ++i) levels.push_back(HalfToFloat(h[i]));
  }
  return levels;
}

hd::SideExtras ExtrasFor(const KvStream& s, Side side, const float* levels) {
  hd::SideExtras extras;
  extras.levels = levels;
  if (s.layout().side(side).format == CodeFormat::kFp8E4m3) extras.fp8_scale = s.fp8_scale(side);
  return extras;
}

DeviceStreamView ViewWithoutPointers(const KvStream& s) {
  DeviceStreamView v;
  v.layout = s.layout();
  v.sink_tokens = s.sink_tokens();
  v.page_base = s.page_base();
  v.quantized_tokens = s.quantized_tokens();
  v.tail_tokens = s.tail_tokens();
  v.key_extras = ExtrasFor(s, Side::kKey, nullptr);
  v.value_extras = ExtrasFor(s, Side::kValue, nullptr);
  if (const Rope* rope = s.rope()) {
    const RopeConfig& c = rope->config();
    const bool linear = c.scaling == RopeConfig::Scaling::kLinear;
    v.rope = hd::MakeRopeParams(c.theta, rope->rotary_dim(),
                                c.pairing == RopeConfig::Pairing::kAdjacent,
                                c.scaling == RopeConfig::Scaling::kNtk, linear ? c.factor : 1.0f,
                                c.factor);
  }
  return v;
}

}  // namespace kvq
