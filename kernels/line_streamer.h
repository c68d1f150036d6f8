// Fills one contiguous output region front to back with non-temporal
// stores: every whole 64-byte line of the region is written past the
// caches, without the read for ownership an ordinary store pays on a line
// that is not cached; only the partial lines at the region's two ends take
// ordinary stores. Pieces of any size go in order (a page of rows at a
// time): the bytes of a line that a piece leaves incomplete wait in a
// carry until the next piece completes it, so a region written page by
// page streams as one run.
//
// For outputs that are large and not read again soon (a prompt's KV
// dequantized on a client, ReadOptions::streaming_output). The region's
// bytes are the same as a memcpy of the pieces; Finish() must run before
// anything else reads them (it also fences the streaming stores).
#ifndef KVQ_KERNELS_LINE_STREAMER_H_
#define KVQ_KERNELS_LINE_STREAMER_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/simd_kernels.h"

namespace kvq {

class LineStreamer {
 public:
  explicit LineStreamer(uint8_t* dst) : dst_(dst) {}
  LineStreamer(const LineStreamer&) = delete;
  LineStreamer& operator=(const LineStreamer&) = delete;

  // Appends n bytes at the current end of the region.
  void Write(const uint8_t* src, size_t n);
  // Writes what the carry holds and fences the streamed lines.
  void Finish();

 private:
  uint8_t* dst_;
  size_t written_ = 0;  // Bytes of the region placed (stored or in the carry).
  size_t carried_ = 0;  // Bytes in carry_, which belong at dst_ + written_ - carried_.
  alignas(cpu::kStreamLine) uint8_t carry_[cpu::kStreamLine];
};

}  // namespace kvq

#endif  // KVQ_KERNELS_LINE_STREAMER_H_
