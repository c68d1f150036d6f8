// The wire image of a kvq.v1.FetchResponse, dense or raw, built without
// protobuf.
//
// FetchDequant sends ~1 MiB messages that are almost all tensor bytes. Built
// as a proto, each message is written twice: pages -> the Tensor.data
// strings, then the strings -> gRPC's slice buffer when it serializes. Here
// the bytes protobuf would produce (fields in number order, proto3 defaults
// omitted, shape packed) go into one grpc::Slice, and the caller dequantizes
// straight into its two data regions (RawFetchMessage: copies pages into
// its one). The client parses it as an ordinary FetchResponse;
// fetch_encoder_test checks the bytes equal protobuf's.
#ifndef KVQ_SERVICE_FETCH_ENCODER_H_
#define KVQ_SERVICE_FETCH_ENCODER_H_

#include <array>
#include <cstddef>
#include <cstdint>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

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

class RawFetchMessage {
 public:
  // FetchResponse{layer, token_begin, pages{layers, tokens, page_bytes,
  // page_tokens, page_data}, range_layer_end, range_token_end}, page_data
  // of `data_bytes` bytes (left for the caller to write).
  RawFetchMessage(int32_t layer, int32_t token_begin, int32_t layers, int32_t tokens,
                  int64_t page_bytes, int32_t page_tokens, size_t data_bytes,
                  int32_t range_layer_end = 0, int32_t range_token_end = 0);

  uint8_t* page_data() { return page_data_; }
  size_t size() const { return slice_.size(); }

  // The finished message (shares the slice; no copy).
  grpc::ByteBuffer Release();

 private:
  grpc::Slice slice_;
  uint8_t* page_data_ = nullptr;
};

}  // namespace kvq

#endif  // KVQ_SERVICE_FETCH_ENCODER_H_
