// ByteReader: bytes read in order from several buffers laid end to end.
//
// A message received by gRPC is a list of slices, cut wherever the
// transport's reads and frames fell. A consumer that copies its bytes into
// place anyway (raw pages into a stream's pages) can read them from the
// slices directly instead of from a contiguous copy made first.
#ifndef KVQ_KERNELS_BYTE_READER_H_
#define KVQ_KERNELS_BYTE_READER_H_

#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"

namespace kvq {

class ByteReader {
 public:
  using Run = absl::Span<const uint8_t>;

  // Reads `runs` (which must outlive the reader) one after the other. A
  // copy of a reader is a second cursor over the same bytes.
  explicit ByteReader(absl::Span<const Run> runs);

  size_t remaining() const { return remaining_; }

  // The next `n` bytes (n <= remaining()): a pointer into a run when they
  // lie inside one, else a copy in `scratch` (n bytes). Advances past them.
  const uint8_t* Next(size_t n, uint8_t* scratch);
  // Copies the next `n` bytes (n <= remaining()) to `out` and advances.
  void Read(size_t n, uint8_t* out);
  // Advances past the next `n` bytes (n <= remaining()).
  void Skip(size_t n);

 private:
  void SkipEmpty();

  absl::Span<const Run> runs_;
  size_t run_ = 0;     // Current run.
  size_t offset_ = 0;  // Offset in it.
  size_t remaining_ = 0;
};

}  // namespace kvq

#endif  // KVQ_KERNELS_BYTE_READER_H_
