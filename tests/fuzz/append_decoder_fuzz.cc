// Fuzz target: the Append message decoder (service/append_decoder.h over
// service/in_place_field.h), which walks the wire bytes of a
// kvq.v1.AppendRequest itself to leave the raw pages in gRPC's slices.
//
// Input: [slice] then the message bytes, cut into slices of `slice` bytes
// (0: one slice), as gRPC may hand them over.
//
// Checked against protobuf's own parser of the same bytes (the decoder
// promises the same verdict and the same message):
//   - bytes protobuf refuses are refused INVALID_ARGUMENT, with a message of
//     at most kMaxMessage bytes naming the field or the message type;
//   - bytes the decoder accepts decode to protobuf's message, page_data
//     included, wherever it was left;
//   - bytes protobuf accepts are accepted, unless they hold fields protobuf
//     keeps as unknown (the decoder refuses deprecated groups, which no
//     proto3 client sends) or a string over its bound (refused with
//     CheckStringFields' message, service/request_decoder.h).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "kvq/v1/kvq.pb.h"
#include "service/append_decoder.h"
#include "service/request_decoder.h"

namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "append_decoder_fuzz: %s\n", what.c_str());
  std::abort();
}

// The longest refusal a client may be sent (no unbounded input echoed).
constexpr size_t kMaxMessage = 512;

bool HasUnknownFields(const google::protobuf::Message& m) {
  const google::protobuf::Reflection* r = m.GetReflection();
  if (!r->GetUnknownFields(m).empty()) return true;
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    if (f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        if (HasUnknownFields(r->GetRepeatedMessage(m, f, i))) return true;
      }
    } else if (HasUnknownFields(r->GetMessage(m, f))) {
      return true;
    }
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return -1;
  const size_t slice = data[0];
  const char* bytes = reinterpret_cast<const char*>(data + 1);
  const size_t n = size - 1;
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < n;) {
    const size_t k = slice == 0 ? n : std::min(slice, n - at);
    slices.emplace_back(bytes + at, k);
    at += k;
  }
  grpc::ByteBuffer buffer(slices.data(), slices.size());

  kvq::v1::AppendRequest want;
  const bool protobuf_ok = want.ParseFromArray(bytes, static_cast<int>(n));
  kvq::AppendMessage m;
  const absl::Status st = m.Decode(buffer);
  if (!st.ok()) {
    // The contract: INVALID_ARGUMENT with a short message (it names the field
    // or says the bytes are not an AppendRequest, quoting no unbounded input).
    if (st.code() != absl::StatusCode::kInvalidArgument || st.message().size() > kMaxMessage) {
      Fail("refusal is " + st.ToString());
    }
    // Bytes protobuf parses are refused only for a string over its bound,
    // with the bound's own message.
    if (protobuf_ok && !HasUnknownFields(want)) {
      const absl::Status bound = kvq::CheckStringFields(want);
      if (bound.ok()) Fail("refused bytes protobuf parses: " + st.ToString());
      if (bound != st) Fail("refusal is " + st.ToString() + ", the bound says " + bound.ToString());
    }
    return 0;
  }
  if (!kvq::CheckStringFields(want).ok()) Fail("accepted a string over its bound");
  if (!protobuf_ok) Fail("accepted bytes protobuf refuses");
  if (m.wire_bytes() != n) Fail("wire_bytes is not the message's size");
  kvq::v1::AppendRequest got = m.request();
  if (m.page_data_in_place()) {
    if (!got.chunk().pages().page_data().empty()) Fail("page_data both in place and parsed");
    kvq::ByteReader r = m.page_data();
    std::string pages(r.remaining(), '\0');
    r.Read(pages.size(), reinterpret_cast<uint8_t*>(pages.data()));
    got.mutable_chunk()->mutable_pages()->set_page_data(pages);
  }
  if (m.page_data_size() != want.chunk().pages().page_data().size()) {
    Fail("page_data_size differs from protobuf's page_data");
  }
  if (!google::protobuf::util::MessageDifferencer::Equals(got, want)) {
    Fail("decoded message differs from protobuf's:\n" + got.DebugString() + "\nwant:\n" +
         want.DebugString());
  }
  return 0;
}
