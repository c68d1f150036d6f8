#include "service/fetch_encoder.h"

#include <cassert>
#include <cstring>
#include <string>

#include <grpc/slice.h>

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

// An int32 field's encoded size (tag + varint; 0 when proto3 omits it) and
// its encoding at p.
size_t Int32FieldSize(int32_t value) {
  return value == 0 ? 0 : 1 + VarintSize(Int32Bits(value));
}
uint8_t* PutInt32Field(uint32_t field, int32_t value, uint8_t* p) {
  if (value == 0) return p;
  return PutVarint(Int32Bits(value), PutVarint(Tag(field, kVarint), p));
}
// The same for an int64 field.
size_t Int64FieldSize(int64_t value) {
  return value == 0 ? 0 : 1 + VarintSize(static_cast<uint64_t>(value));
}
uint8_t* PutInt64Field(uint32_t field, int64_t value, uint8_t* p) {
  if (value == 0) return p;
  return PutVarint(static_cast<uint64_t>(value), PutVarint(Tag(field, kVarint), p));
}

}  // namespace

DenseFetchMessage::DenseFetchMessage(int32_t layer, int32_t token_begin, v1::DType dtype,
                                     const std::array<int64_t, 3>& shape, size_t data_bytes,
                                     int32_t range_layer_end, int32_t range_token_end) {
  const TensorHead head(dtype, shape, data_bytes);
  const size_t field = 1 + VarintSize(head.total) + head.total;  // k, then v: the same size.
  const size_t size = Int32FieldSize(layer) + Int32FieldSize(token_begin) + 2 * field +
                      Int32FieldSize(range_layer_end) + Int32FieldSize(range_token_end);
  slice_ = grpc::Slice(size);  // Uninitialized: every byte is written below or by the caller.
  uint8_t* p = const_cast<uint8_t*>(slice_.begin());
  p = PutInt32Field(1, layer, p);
  p = PutInt32Field(2, token_begin, p);
  for (uint32_t f : {3u, 4u}) {
    p = PutVarint(Tag(f, kLengthDelimited), p);
    p = PutVarint(head.total, p);
    std::memcpy(p, head.bytes.data(), head.bytes.size());
    p += head.bytes.size();
    (f == 3 ? k_data_ : v_data_) = p;
    p += data_bytes;
  }
  p = PutInt32Field(6, range_layer_end, p);
  PutInt32Field(7, range_token_end, p);
}

grpc::ByteBuffer DenseFetchMessage::Release() { return grpc::ByteBuffer(&slice_, 1); }

RawFetchMessage::RawFetchMessage(int32_t layer, int32_t token_begin, int32_t layers,
                                 int32_t tokens, int64_t page_bytes, int32_t page_tokens,
                                 size_t data_bytes, int32_t range_layer_end,
                                 int32_t range_token_end)
    : data_bytes_(data_bytes) {
  // QuantizedPages: its four numbers, then page_data when there is any.
  const size_t data_head = data_bytes == 0 ? 0 : 1 + VarintSize(data_bytes);
  const size_t pages = Int32FieldSize(layers) + Int32FieldSize(tokens) +
                       Int64FieldSize(page_bytes) + Int32FieldSize(page_tokens) + data_head +
                       data_bytes;
  const size_t head = Int32FieldSize(layer) + Int32FieldSize(token_begin) + 1 +
                      VarintSize(pages) + pages - data_bytes;
  grpc::Slice head_slice(head);  // Uninitialized: every byte is written below.
  uint8_t* p = const_cast<uint8_t*>(head_slice.begin());
  p = PutInt32Field(1, layer, p);
  p = PutInt32Field(2, token_begin, p);
  p = PutVarint(Tag(5, kLengthDelimited), p);  // Set even when empty, as mutable_pages() does.
  p = PutVarint(pages, p);
  p = PutInt32Field(1, layers, p);
  p = PutInt32Field(2, tokens, p);
  p = PutInt64Field(3, page_bytes, p);
  p = PutInt32Field(4, page_tokens, p);
  if (data_bytes > 0) {
    p = PutVarint(Tag(5, kLengthDelimited), p);
    PutVarint(data_bytes, p);
  }
  slices_.push_back(std::move(head_slice));
  const size_t trailer = Int32FieldSize(range_layer_end) + Int32FieldSize(range_token_end);
  trailer_ = grpc::Slice(trailer);
  p = const_cast<uint8_t*>(trailer_.begin());
  PutInt32Field(7, range_token_end, PutInt32Field(6, range_layer_end, p));
  size_ = head + data_bytes + trailer;
}

RawFetchMessage::~RawFetchMessage() {
  FlushRun();  // Its slice, dropped with slices_, releases the references.
}

void RawFetchMessage::AddCopy(const uint8_t* data, size_t bytes) {
  FlushRun();
  slices_.emplace_back(data, bytes);  // grpc::Slice(buf, len) copies.
  added_ += bytes;
}

void RawFetchMessage::AddShared(const std::shared_ptr<PageAllocator>& owner,
                                const uint8_t* block, size_t bytes) {
  owner->Retain(const_cast<uint8_t*>(block), bytes);
  added_ += bytes;
  if (run_.blocks > 0 && run_.owner == owner && run_.block_bytes == bytes &&
      run_.begin + run_.blocks * bytes == block) {
    ++run_.blocks;
    return;
  }
  FlushRun();
  run_ = {owner, block, bytes, 1};
}

void RawFetchMessage::FlushRun() {
  if (run_.blocks == 0) return;
  // The slice owns the run's references: gRPC calls this when it drops the
  // last reference to the slice, on whichever thread that happens.
  auto release = [](void* arg) {
    auto* run = static_cast<Run*>(arg);
    for (size_t i = 0; i < run->blocks; ++i) {
      run->owner->Free(const_cast<uint8_t*>(run->begin + i * run->block_bytes), run->block_bytes);
    }
    delete run;
  };
  auto* run = new Run(run_);
  slices_.emplace_back(grpc_slice_new_with_user_data(const_cast<uint8_t*>(run->begin),
                                                     run->blocks * run->block_bytes, release, run),
                       grpc::Slice::STEAL_REF);
  run_ = Run();
}

grpc::ByteBuffer RawFetchMessage::Release() {
  FlushRun();
  assert(added_ == data_bytes_);
  if (trailer_.size() > 0) slices_.push_back(trailer_);
  return grpc::ByteBuffer(slices_.data(), slices_.size());
}

}  // namespace kvq
