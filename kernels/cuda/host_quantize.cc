// The quantize and dequantize halves of "cuda_host".
// SCAFFOLD (quantize): HostQuantizeRows is replaced by the per-group programs.
#include <vector>

#include "kernels/cpu/ref_kernels.h"
#include "kernels/cuda/dequant_hd.h"
#include "kernels/cuda/host_program_backend.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"

namespace kvq {

void HostQuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                      int row0) {
  QuantizeRowsRef(s, side, rows, n, page, row0);
}

// The stream's nuq levels of one side as floats, channel-major, as
// hd::SideExtras takes them; empty for uniform codes.
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

void HostDequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                        float* out) {
  const std::vector<float> levels = LevelsAsFloats(s, side);
  hd::SideExtras extras;
  extras.levels = levels.empty() ? nullptr : levels.data();
  const SideLayout& S = s.layout().side(side);
  if (S.format == CodeFormat::kFp8E4m3) extras.fp8_scale = s.fp8_scale(side);
  hd::DequantRows(s.layout(), side, page, row0, n, extras, out);
}

}  // namespace kvq
