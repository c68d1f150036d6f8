#include "service/request_decoder.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/unknown_field_set.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/proto_buffer_writer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvq {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;

// Requests nest a few levels (DecodeRequest.step.items[i].sequence); the
// bound only keeps a hostile message from recursing deep.
constexpr int kMaxDepth = 16;

std::string FieldPath(absl::string_view prefix, const FieldDescriptor& f, int index) {
  return f.is_repeated() ? absl::StrCat(prefix, f.name(), "[", index, "]")
                         : absl::StrCat(prefix, f.name());
}

// What a request's bound check walks for one message type: its string
// fields and the message fields whose type can hold one (directly or
// further down), in field-number order, the order Reflection::ListFields
// reports set fields in, so the first failing field is the same. Built once
// per type; a Tensor (bytes and numbers only) is never descended into, and
// no per-message field list is allocated.
struct TypePlan {
  struct Field {
    const FieldDescriptor* field;
    const TypePlan* message;  // The field's type's plan; null for a string.
  };
  std::vector<Field> fields;
};

class TypePlans {
 public:
  const TypePlan& For(const Descriptor* d) {
    {
      absl::ReaderMutexLock lock(&mu_);
      if (auto it = plans_.find(d); it != plans_.end() && it->second.done) {
        return *it->second.plan;
      }
    }
    absl::MutexLock lock(&mu_);
    return *Build(d);
  }

 private:
  struct Entry {
    std::unique_ptr<TypePlan> plan;
    bool done = false;  // False while its own fields are being planned.
  };

  const TypePlan* Build(const Descriptor* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto [it, inserted] = plans_.try_emplace(d);
    if (!inserted) return it->second.plan.get();  // Planned, or in progress (a cycle).
    it->second.plan = std::make_unique<TypePlan>();
    TypePlan* plan = it->second.plan.get();
    std::vector<const FieldDescriptor*> fields;
    for (int i = 0; i < d->field_count(); ++i) fields.push_back(d->field(i));
    std::sort(fields.begin(), fields.end(),
              [](const FieldDescriptor* a, const FieldDescriptor* b) {
                return a->number() < b->number();
              });
    for (const FieldDescriptor* f : fields) {
      if (f->type() == FieldDescriptor::TYPE_STRING) {
        plan->fields.push_back({f, nullptr});
      } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        const TypePlan* sub = Build(f->message_type());
        // A type still in progress (a recursive message) is kept: it may
        // hold strings.
        if (!sub->fields.empty() || !plans_[f->message_type()].done) {
          plan->fields.push_back({f, sub});
        }
      }
    }
    plans_[d].done = true;  // (`it` may be stale after the nested inserts.)
    return plan;
  }

  absl::Mutex mu_;
  absl::flat_hash_map<const Descriptor*, Entry> plans_ ABSL_GUARDED_BY(mu_);
};

TypePlans& Plans() {
  static TypePlans* plans = new TypePlans();
  return *plans;
}

// The path of a failing field is built on the way back up, so a request
// that fits its bounds (every request on the hot path) allocates nothing.
absl::Status CheckFields(const Message& m, const TypePlan& plan, int depth) {
  const Reflection& r = *m.GetReflection();
  for (const TypePlan::Field& pf : plan.fields) {
    const FieldDescriptor* f = pf.field;
    int n = 1;
    if (f->is_repeated()) {
      n = r.FieldSize(m, f);
    } else if (!r.HasField(m, f)) {
      continue;  // Not set (ListFields would not list it).
    }
    if (pf.message == nullptr) {
      const size_t limit = StringFieldLimit(*f);
      std::string scratch;
      for (int i = 0; i < n; ++i) {
        const std::string& s = f->is_repeated() ? r.GetRepeatedStringReference(m, f, i, &scratch)
                                                : r.GetStringReference(m, f, &scratch);
        if (s.size() > limit) {
          return absl::InvalidArgumentError(absl::StrCat(FieldPath("", *f, i), " has ", s.size(),
                                                         " bytes; the limit is ", limit));
        }
      }
    } else if (depth < kMaxDepth) {
      for (int i = 0; i < n; ++i) {
        const Message& sub = f->is_repeated() ? r.GetRepeatedMessage(m, f, i) : r.GetMessage(m, f);
        if (absl::Status st = CheckFields(sub, *pf.message, depth + 1); !st.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat(FieldPath("", *f, i), ".", st.message()));
        }
      }
    }
  }
  return absl::OkStatus();
}

// The path of the first string field in `bytes` (a `prototype` message)
// that protobuf refuses, found by parsing each string field alone; nullopt
// when the bytes are not even protobuf wire format, or no string is at
// fault.
std::optional<std::string> FindBadString(const Message& prototype, absl::string_view bytes,
                                         absl::string_view prefix, int depth) {
  UnknownFieldSet set;
  if (!set.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return std::nullopt;
  const Descriptor& d = *prototype.GetDescriptor();
  absl::flat_hash_map<int, int> occurrences;  // Field number: index of its next element.
  for (int i = 0; i < set.field_count(); ++i) {
    const UnknownField& u = set.field(i);
    const FieldDescriptor* f = d.FindFieldByNumber(u.number());
    if (f == nullptr) continue;
    const int index = occurrences[u.number()]++;
    if (u.type() != UnknownField::TYPE_LENGTH_DELIMITED) continue;
    const std::string path = FieldPath(prefix, *f, index);
    if (f->type() == FieldDescriptor::TYPE_STRING) {
      std::string alone;
      {
        google::protobuf::io::StringOutputStream stream(&alone);
        google::protobuf::io::CodedOutputStream out(&stream);
        google::protobuf::internal::WireFormatLite::WriteString(u.number(), u.length_delimited(),
                                                                &out);
      }
      std::unique_ptr<Message> probe(prototype.New());
      if (!probe->ParseFromString(alone)) return absl::StrCat(path, " is not valid UTF-8");
    } else if (f->type() == FieldDescriptor::TYPE_MESSAGE && depth < kMaxDepth) {
      const Message* sub =
          prototype.GetReflection()->GetMessageFactory()->GetPrototype(f->message_type());
      if (std::optional<std::string> bad =
              FindBadString(*sub, u.length_delimited(), path + ".", depth + 1)) {
        return bad;
      }
    }
  }
  return std::nullopt;
}

}  // namespace

size_t StringFieldLimit(const FieldDescriptor& field) {
  return field.name() == "scheme" ? kMaxSchemeBytes : kMaxNameBytes;
}

absl::Status CheckStringFields(const Message& message) {
  return CheckFields(message, Plans().For(message.GetDescriptor()), 0);
}

absl::Status DescribeUndecodable(const Message& prototype, absl::string_view bytes) {
  if (std::optional<std::string> bad = FindBadString(prototype, bytes, "", 0)) {
    return absl::InvalidArgumentError(*bad);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("request is not a valid ", prototype.GetDescriptor()->full_name()));
}

absl::Status DecodeRequest(const grpc::ByteBuffer& buffer, Message* message) {
  message->Clear();
  grpc::ByteBuffer shared(buffer);  // The reader consumes its buffer; this shares the slices.
  grpc::ProtoBufferReader reader(&shared);
  if (!reader.status().ok() || !message->ParseFromZeroCopyStream(&reader)) {
    grpc::Slice whole;
    if (!buffer.DumpToSingleSlice(&whole).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("request is not a valid ", message->GetDescriptor()->full_name()));
    }
    return DescribeUndecodable(
        *message, absl::string_view(reinterpret_cast<const char*>(whole.begin()), whole.size()));
  }
  return CheckStringFields(*message);
}

absl::Status EncodeResponse(const Message& message, grpc::ByteBuffer* buffer) {
  buffer->Clear();  // A stream's buffer still holds the previous message.
  bool own_buffer = false;
  grpc::Status st = grpc::SerializationTraits<Message>::Serialize(message, buffer, &own_buffer);
  if (!st.ok()) return absl::InternalError(absl::StrCat("response: ", st.error_message()));
  return absl::OkStatus();
}

}  // namespace kvq
