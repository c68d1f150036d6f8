#include "service/in_place_field.h"

#include <algorithm>
#include <string>

#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"

namespace kvq {
namespace {

// A length-delimited field off the path above this size (a dense tensor)
// sends the whole message to protobuf's parser.
constexpr uint64_t kLargeField = 4096;

// Protobuf wire types.
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// A position in bytes laid over several runs.
class Cursor {
 public:
  explicit Cursor(absl::Span<const ByteReader::Run> runs) : runs_(runs) { Settle(); }

  size_t pos() const { return pos_; }

  bool ReadByte(uint8_t* b) {
    if (run_ == runs_.size()) return false;
    *b = runs_[run_][offset_];
    Advance(1);
    return true;
  }
  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // More than ten bytes.
  }
  // The next n bytes appended to `out` (copy) or as runs in `runs`.
  bool Copy(uint64_t n, std::string* out) {
    return Take(n, [&](const uint8_t* p, size_t k) {
      out->append(reinterpret_cast<const char*>(p), k);
    });
  }
  bool Refer(uint64_t n, std::vector<ByteReader::Run>* runs) {
    return Take(n, [&](const uint8_t* p, size_t k) { runs->emplace_back(p, k); });
  }

 private:
  template <typename Fn>
  bool Take(uint64_t n, Fn fn) {
    while (n > 0) {
      if (run_ == runs_.size()) return false;
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, runs_[run_].size() - offset_));
      fn(runs_[run_].data() + offset_, k);
      Advance(k);
      n -= k;
    }
    return true;
  }
  void Advance(size_t n) {
    offset_ += n;
    pos_ += n;
    Settle();
  }
  void Settle() {
    while (run_ < runs_.size() && offset_ == runs_[run_].size()) {
      ++run_;
      offset_ = 0;
    }
  }

  absl::Span<const ByteReader::Run> runs_;
  size_t run_ = 0, offset_ = 0, pos_ = 0;
};

enum class Split { kDone, kMalformed, kLargeField };

// Copies the fields of the message in [cursor, end) to `rest`, except the
// length-delimited field numbered path[0]: with more path left it is
// descended into and re-encoded around what is left of it; at the end of
// the path its bytes become `taken` (the last occurrence wins, as in
// protobuf).
Split SplitField(Cursor& c, size_t end, absl::Span<const uint32_t> path, std::string* rest,
                 std::vector<ByteReader::Run>* taken, bool* found) {
  while (c.pos() < end) {
    uint64_t tag, v;
    const size_t tag_at = c.pos();
    if (!c.ReadVarint(&tag) || c.pos() > end) return Split::kMalformed;
    // As protobuf reads a tag: at most five bytes, kept to 32 bits (a longer
    // one would be re-encoded shorter below, and protobuf would then take
    // bytes it refuses).
    if (c.pos() - tag_at > 5) return Split::kMalformed;
    tag = static_cast<uint32_t>(tag);
    if ((tag >> 3) == 0) return Split::kMalformed;
    const uint64_t field = tag >> 3;
    switch (tag & 7) {
      case kVarint:
        if (!c.ReadVarint(&v)) return Split::kMalformed;
        PutVarint(tag, rest);
        PutVarint(v, rest);
        break;
      case kFixed64:
      case kFixed32:
        PutVarint(tag, rest);
        if (!c.Copy((tag & 7) == kFixed64 ? 8 : 4, rest)) return Split::kMalformed;
        break;
      case kLengthDelimited: {
        if (!c.ReadVarint(&v) || v > end - c.pos()) return Split::kMalformed;
        if (field != path[0]) {
          if (v > kLargeField) return Split::kLargeField;
          PutVarint(tag, rest);
          PutVarint(v, rest);
          if (!c.Copy(v, rest)) return Split::kMalformed;
        } else if (path.size() == 1) {
          taken->clear();
          if (!c.Refer(v, taken)) return Split::kMalformed;
          *found = true;
        } else {
          std::string inner;
          const Split s = SplitField(c, c.pos() + v, path.subspan(1), &inner, taken, found);
          if (s != Split::kDone) return s;
          PutVarint(tag, rest);
          PutVarint(inner.size(), rest);
          rest->append(inner);
        }
        break;
      }
      default:  // Groups (deprecated) or invalid.
        return Split::kMalformed;
    }
  }
  return c.pos() == end ? Split::kDone : Split::kMalformed;
}

}  // namespace

absl::Status InPlaceField::Decode(const grpc::ByteBuffer& buffer, absl::Span<const uint32_t> path,
                                  absl::string_view type_name,
                                  google::protobuf::MessageLite* message) {
  slices_.clear();
  runs_.clear();
  found_ = false;
  message->Clear();
  wire_bytes_ = buffer.Length();
  const absl::Status refused =
      absl::InvalidArgumentError(absl::StrCat("the message is not a ", type_name));
  if (!buffer.Dump(&slices_).ok()) return refused;
  std::vector<ByteReader::Run> all;
  all.reserve(slices_.size());
  for (const grpc::Slice& s : slices_) all.emplace_back(s.begin(), s.size());
  Cursor cursor(all);
  std::string rest;
  bool found = false;
  const Split split = SplitField(cursor, wire_bytes_, path, &rest, &runs_, &found);
  bool parsed = false;
  if (split == Split::kLargeField) {
    // Protobuf copies the large field out of the slices once.
    grpc::ByteBuffer whole(buffer);  // The reader consumes its buffer; this shares the slices.
    grpc::ProtoBufferReader reader(&whole);
    parsed = message->ParseFromZeroCopyStream(&reader);
    runs_.clear();
    found = false;
  } else if (split == Split::kDone) {
    parsed = message->ParseFromString(rest);
  }
  if (!parsed) {
    message->Clear();
    runs_.clear();
    return refused;
  }
  found_ = found;
  if (!found_) runs_.clear();
  return absl::OkStatus();
}

size_t InPlaceField::field_size() const {
  size_t n = 0;
  for (const ByteReader::Run& r : runs_) n += r.size();
  return n;
}

}  // namespace kvq
