#include "kernels/line_streamer.h"

#include <algorithm>
#include <cstring>

namespace kvq {

void LineStreamer::Write(const uint8_t* src, size_t n) {
  constexpr size_t kLine = cpu::kStreamLine;
  // The region's head, up to its first whole line: ordinary stores.
  const size_t head = (kLine - reinterpret_cast<uintptr_t>(dst_) % kLine) % kLine;
  if (written_ < head) {
    const size_t k = std::min(n, head - written_);
    std::memcpy(dst_ + written_, src, k);
    written_ += k;
    src += k;
    n -= k;
  }
  if (n == 0) return;
  // From here dst_ + written_ - carried_ is the start of a line.
  if (carried_ > 0) {
    const size_t k = std::min(n, kLine - carried_);
    std::memcpy(carry_ + carried_, src, k);
    carried_ += k;
    written_ += k;
    src += k;
    n -= k;
    if (carried_ < kLine) return;
    cpu::StreamLines(dst_ + written_ - kLine, carry_, 1);
    carried_ = 0;
  }
  const size_t lines = n / kLine;
  cpu::StreamLines(dst_ + written_, src, lines);
  written_ += lines * kLine;
  src += lines * kLine;
  n -= lines * kLine;
  std::memcpy(carry_, src, n);
  carried_ = n;
  written_ += n;
}

void LineStreamer::Finish() {
  std::memcpy(dst_ + written_ - carried_, carry_, carried_);
  carried_ = 0;
  cpu::FenceStreams();
}

}  // namespace kvq
