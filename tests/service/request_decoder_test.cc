// CheckStringFields: the bound of every string of a request, the path of
// the first one over it, in the order the fields are numbered.
#include "service/request_decoder.h"

#include <google/protobuf/struct.pb.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvq/v1/kvq.pb.h"

namespace kvq {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// The walk as Reflection::ListFields sees a message (every set field, in
// field-number order): what CheckStringFields must answer, field for field.
absl::Status ReferenceCheck(const Message& m, int depth = 0) {
  const Reflection& r = *m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r.ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    const int n = f->is_repeated() ? r.FieldSize(m, f) : 1;
    const auto path = [&](int i) {
      return f->is_repeated() ? absl::StrCat(f->name(), "[", i, "]") : std::string(f->name());
    };
    if (f->type() == FieldDescriptor::TYPE_STRING) {
      const size_t limit = StringFieldLimit(*f);
      for (int i = 0; i < n; ++i) {
        const std::string s =
            f->is_repeated() ? r.GetRepeatedString(m, f, i) : r.GetString(m, f);
        if (s.size() > limit) {
          return absl::InvalidArgumentError(
              absl::StrCat(path(i), " has ", s.size(), " bytes; the limit is ", limit));
        }
      }
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && depth < 16) {
      for (int i = 0; i < n; ++i) {
        const Message& sub = f->is_repeated() ? r.GetRepeatedMessage(m, f, i) : r.GetMessage(m, f);
        if (absl::Status st = ReferenceCheck(sub, depth + 1); !st.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(path(i), ".", st.message()));
        }
      }
    }
  }
  return absl::OkStatus();
}

TEST(RequestDecoderTest, NamesTheFirstStringOverItsBoundWithItsPathAndLimit) {
  v1::DecodeRequest req;
  v1::AppendAttendRequest* step = req.mutable_step();
  step->mutable_k()->set_data(std::string(4096, 'k'));  // Bytes: no bound.
  step->add_items()->mutable_sequence()->set_sequence_id(std::string(128, 'a'));
  v1::SequenceRef* second = step->add_items()->mutable_sequence();
  second->set_sequence_id(std::string(129, 'b'));
  second->set_namespace_(std::string(200, 'n'));  // Numbered first: reported first.
  EXPECT_EQ(CheckStringFields(req),
            absl::InvalidArgumentError(
                "step.items[1].sequence.namespace has 200 bytes; the limit is 128"));
  second->clear_namespace_();
  EXPECT_EQ(CheckStringFields(req),
            absl::InvalidArgumentError(
                "step.items[1].sequence.sequence_id has 129 bytes; the limit is 128"));
  second->set_sequence_id(std::string(128, 'b'));
  EXPECT_TRUE(CheckStringFields(req).ok());
}

TEST(RequestDecoderTest, SchemeHasItsOwnBound) {
  v1::CreateSequenceRequest req;
  req.set_scheme(std::string(256, 's'));
  EXPECT_TRUE(CheckStringFields(req).ok());
  req.set_scheme(std::string(257, 's'));
  EXPECT_EQ(CheckStringFields(req),
            absl::InvalidArgumentError("scheme has 257 bytes; the limit is 256"));
}

// A recursive type (Value -> ListValue -> Value, Struct's map entries): the
// strings at every level are checked, down to the depth bound.
TEST(RequestDecoderTest, RecursiveTypesAreWalked) {
  google::protobuf::Value v;
  google::protobuf::Value* inner = v.mutable_list_value()->add_values();
  (*inner->mutable_struct_value()->mutable_fields())["k"].set_string_value(std::string(129, 'x'));
  EXPECT_EQ(CheckStringFields(v),
            absl::InvalidArgumentError("list_value.values[0].struct_value.fields[0].value."
                                       "string_value has 129 bytes; the limit is 128"));
  EXPECT_EQ(CheckStringFields(v), ReferenceCheck(v));
}

// Random requests around the bounds: the same answer as the ListFields walk,
// field for field.
TEST(RequestDecoderTest, AnswersAsTheListFieldsWalkOnRandomRequests) {
  std::mt19937 rng(7);
  auto name = [&]() {
    const int pick = static_cast<int>(rng() % 4);
    return pick == 0 ? std::string() : std::string(pick == 1 ? 5 : 126 + rng() % 5, 'x');
  };
  int refused = 0;
  for (int trial = 0; trial < 500; ++trial) {
    v1::DecodeRequest decode;
    v1::AppendAttendRequest* step = decode.mutable_step();
    const int items = static_cast<int>(rng() % 4);
    for (int i = 0; i < items; ++i) {
      v1::AppendAttendItem* it = step->add_items();
      if (rng() % 4 != 0) it->mutable_sequence()->set_namespace_(name());
      if (rng() % 4 != 0) it->mutable_sequence()->set_sequence_id(name());
      if (rng() % 2 != 0) it->mutable_q()->set_data(std::string(300, 'q'));
    }
    v1::CreateSequenceRequest create;
    create.set_namespace_(name());
    create.set_sequence_id(name());
    create.set_scheme(std::string(250 + rng() % 10, 's'));
    for (const Message* m : {static_cast<const Message*>(&decode),
                             static_cast<const Message*>(&create)}) {
      const absl::Status want = ReferenceCheck(*m);
      EXPECT_EQ(CheckStringFields(*m), want) << m->DebugString();
      refused += !want.ok();
    }
  }
  EXPECT_GT(refused, 100);  // Both answers were exercised.
  EXPECT_LT(refused, 900);
}

}  // namespace
}  // namespace kvq
