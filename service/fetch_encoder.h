// The wire image of a kvq.v1.FetchResponse, dense or raw, built without
// protobuf.
//
// FetchDequant sends ~1 MiB messages that are almost all tensor bytes. Built
// as a proto, each message is written twice: pages -> the Tensor.data
// strings, then the strings -> gRPC's slice buffer when it serializes. Here
// the bytes protobuf would produce (fields in number order, proto3 defaults
// omitted, shape packed) go into one grpc::Slice, and the caller dequantizes
// straight into its two data regions (RawFetchMessage: shares full pages
// and copies the rest). The client parses it as an ordinary FetchResponse;
// fetch_encoder_test checks the bytes equal protobuf's.
#ifndef KVQ_SERVICE_FETCH_ENCODER_H_
#define KVQ_SERVICE_FETCH_ENCODER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "kernels/page_allocator.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {

class DenseFetchMessage {
 public:
  // FetchResponse{layer, token_begin, k, v, range_layer_end,
  // range_token_end}, k and v of `dtype` and `shape`, each with
  // `data_bytes` bytes of data (left for the caller to write).
  DenseFetchMessage(int32_t layer, int32_t token_begin, v1::DType dtype,
                    const std::array<int64_t, 3>& shape, size_t data_bytes,
                    int32_t range_layer_end = 0, int32_t range_token_end = 0);

  uint8_t* k_data() { return k_data_; }
  uint8_t* v_data() { return v_data_; }
  size_t size() const { return slice_.size(); }

  // The finished message (shares the slice; no copy).
  grpc::ByteBuffer Release();

 private:
  grpc::Slice slice_;
  uint8_t* k_data_ = nullptr;
  uint8_t* v_data_ = nullptr;
};

// Raw pages are not copied into the message when they need not be: a
// full page is immutable (KvStream::VisitPages), so the message holds a
// reference to it and hands gRPC a slice of the page itself, released when
// gRPC drops the buffer. Adjacent pages of one allocator share a slice.
class RawFetchMessage {
 public:
  // FetchResponse{layer, token_begin, pages{layers, tokens, page_bytes,
  // page_tokens, page_data}, range_layer_end, range_token_end}, page_data
  // of `data_bytes` bytes, added with AddCopy / AddShared.
  RawFetchMessage(int32_t layer, int32_t token_begin, int32_t layers, int32_t tokens,
                  int64_t page_bytes, int32_t page_tokens, size_t data_bytes,
                  int32_t range_layer_end = 0, int32_t range_token_end = 0);
  // Drops the references of pages not yet released (a message abandoned
  // on an error).
  ~RawFetchMessage();
  RawFetchMessage(const RawFetchMessage&) = delete;
  RawFetchMessage& operator=(const RawFetchMessage&) = delete;

  // The next `bytes` bytes of page_data, copied.
  void AddCopy(const uint8_t* data, size_t bytes);
  // The next `bytes` bytes of page_data: `block`, a block of `bytes` from
  // `owner`, which gains a reference until gRPC drops the buffer (and is
  // kept alive until then).
  void AddShared(const std::shared_ptr<PageAllocator>& owner, const uint8_t* block,
                 size_t bytes);

  // The encoded message's size.
  size_t size() const { return size_; }
  // Bytes of page_data added so far.
  size_t data_added() const { return added_; }

  // The finished message; page_data must be complete (data_added() ==
  // data_bytes).
  grpc::ByteBuffer Release();

 private:
  // Adjacent shared blocks of one owner, not yet a slice.
  struct Run {
    std::shared_ptr<PageAllocator> owner;
    const uint8_t* begin = nullptr;
    size_t block_bytes = 0;
    size_t blocks = 0;
  };
  void FlushRun();

  std::vector<grpc::Slice> slices_;  // Header, page_data pieces, then the trailer.
  grpc::Slice trailer_;
  Run run_;
  size_t data_bytes_ = 0;
  size_t added_ = 0;
  size_t size_ = 0;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_FETCH_ENCODER_H_
