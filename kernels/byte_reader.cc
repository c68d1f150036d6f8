#include "kernels/byte_reader.h"

#include <algorithm>
#include <cassert>
#include <cstring>

namespace kvq {

ByteReader::ByteReader(absl::Span<const Run> runs) : runs_(runs) {
  for (const Run& r : runs_) remaining_ += r.size();
  SkipEmpty();
}

void ByteReader::SkipEmpty() {
  while (run_ < runs_.size() && offset_ == runs_[run_].size()) {
    ++run_;
    offset_ = 0;
  }
}

const uint8_t* ByteReader::Next(size_t n, uint8_t* scratch) {
  assert(n <= remaining_);
  if (n == 0) return scratch;
  if (runs_[run_].size() - offset_ >= n) {
    const uint8_t* p = runs_[run_].data() + offset_;
    offset_ += n;
    remaining_ -= n;
    SkipEmpty();
    return p;
  }
  Read(n, scratch);
  return scratch;
}

void ByteReader::Read(size_t n, uint8_t* out) {
  assert(n <= remaining_);
  remaining_ -= n;
  while (n > 0) {
    const size_t take = std::min(n, runs_[run_].size() - offset_);
    std::memcpy(out, runs_[run_].data() + offset_, take);
    out += take;
    n -= take;
    offset_ += take;
    SkipEmpty();
  }
}

void ByteReader::Skip(size_t n) {
  assert(n <= remaining_);
  remaining_ -= n;
  while (n > 0) {
    const size_t take = std::min(n, runs_[run_].size() - offset_);
    n -= take;
    offset_ += take;
    SkipEmpty();
  }
}

}  // namespace kvq
