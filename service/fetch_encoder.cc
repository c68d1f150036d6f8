#include "service/fetch_encoder.h"

#include <cstring>
#include <string>

namespace kvq {
namespace {

// Protobuf wire types.
constexpr uint32_t kVarint = 0, kLengthDelimited = 2;

constexpr uint32_t Tag(uint32_t field, uint32_t wire_type) { return field << 3 | wire_type; }

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

uint8_t* PutVarint(uint64_t v, uint8_t* p) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

// int32 fields are encoded sign-extended to 64 bits (negative: 10 bytes).
uint64_t Int32Bits(int32_t v) { return static_cast<uint64_t>(static_cast<int64_t>(v)); }

// The fields of a Tensor before its data: dtype, packed shape, data's tag
// and length (when there is data).
struct TensorHead {
  std::string bytes;
  size_t total = 0;  // Encoded Tensor size: head + data.

  TensorHead(v1::DType dtype, const std::array<int64_t, 3>& shape, size_t data_bytes) {
    std::string& b = bytes;
    uint8_t buf[16];
    auto put = [&](uint64_t v) { b.append(reinterpret_cast<char*>(buf), PutVarint(v, buf) - buf); };
    if (dtype != 0) {
      put(Tag(1, kVarint));
      put(Int32Bits(dtype));
    }
    size_t packed = 0;
    for (int64_t d : shape) packed += VarintSize(static_cast<uint64_t>(d));
    put(Tag(2, kLengthDelimited));
    put(packed);
    for (int64_t d : shape) put(static_cast<uint64_t>(d));
    if (data_bytes > 0) {
      put(Tag(3, kLengthDelimited));
      put(data_bytes);
    }
    total = b.size() + data_bytes;
  }
};

}  // namespace

DenseFetchMessage::DenseFetchMessage(int32_t layer, int32_t token_begin, v1::DType dtype,
                                     const std::array<int64_t, 3>& shape, size_t data_bytes,
                                     int32_t range_layer_end, int32_t range_token_end) {
  const TensorHead head(dtype, shape, data_bytes);
  size_t size = 0;
  if (layer != 0) size += 1 + VarintSize(Int32Bits(layer));
  if (token_begin != 0) size += 1 + VarintSize(Int32Bits(token_begin));
  const size_t field = 1 + VarintSize(head.total) + head.total;  // k, then v: the same size.
  size += 2 * field;
  if (range_layer_end != 0) size += 1 + VarintSize(Int32Bits(range_layer_end));
  if (range_token_end != 0) size += 1 + VarintSize(Int32Bits(range_token_end));
  slice_ = grpc::Slice(size);  // Uninitialized: every byte is written below or by the caller.
  uint8_t* p = const_cast<uint8_t*>(slice_.begin());
  if (layer != 0) {
    p = PutVarint(Tag(1, kVarint), p);
    p = PutVarint(Int32Bits(layer), p);
  }
  if (token_begin != 0) {
    p = PutVarint(Tag(2, kVarint), p);
    p = PutVarint(Int32Bits(token_begin), p);
  }
  for (uint32_t f : {3u, 4u}) {
    p = PutVarint(Tag(f, kLengthDelimited), p);
    p = PutVarint(head.total, p);
    std::memcpy(p, head.bytes.data(), head.bytes.size());
    p += head.bytes.size();
    (f == 3 ? k_data_ : v_data_) = p;
    p += data_bytes;
  }
  if (range_layer_end != 0) {
    p = PutVarint(Tag(6, kVarint), p);
    p = PutVarint(Int32Bits(range_layer_end), p);
  }
  if (range_token_end != 0) {
    p = PutVarint(Tag(7, kVarint), p);
    p = PutVarint(Int32Bits(range_token_end), p);
  }
}

grpc::ByteBuffer DenseFetchMessage::Release() { return grpc::ByteBuffer(&slice_, 1); }

}  // namespace kvq
