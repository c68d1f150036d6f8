#include "bench/eval/gguf_file.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/eval/eval_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/eval/real_model.h"

namespace kvq::eval {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using namespace std::string_literals;

// --- A GGUF writer for synthetic files ---

// Appends little-endian GGUF fields to a byte string; remembers where fields
// were written so tests can corrupt them.
class GgufWriter {
 public:
  size_t size() const { return buf_.size(); }
  std::string& bytes() { return buf_; }

  template <typename T>
  size_t Put(T v) {
    const size_t at = buf_.size();
    buf_.append(reinterpret_cast<const char*>(&v), sizeof(v));
    return at;
  }
  void Str(const std::string& s) {
    Put<uint64_t>(s.size());
    buf_ += s;
  }
  void Key(const std::string& key, GgufValueType type) {
    Str(key);
    Put<uint32_t>(static_cast<uint32_t>(type));
  }
  void PadTo(size_t alignment) {
    while (buf_.size() % alignment != 0) buf_.push_back('\0');
  }
  // Overwrites the T at `at`.
  template <typename T>
  void Patch(size_t at, T v) {
    std::memcpy(buf_.data() + at, &v, sizeof(v));
  }

 private:
  std::string buf_;
};

// Layout of the synthetic file, for tests that corrupt it.
struct Synthetic {
  std::string bytes;
  size_t tensor_count_at = 0;
  size_t b_offset_at = 0;   // Tensor "b"'s offset field.
  size_t b_type_at = 0;     // Tensor "b"'s type field.
  size_t data_offset = 0;   // Start of the data section.
  size_t first_key_at = 0;  // First metadata key's length field.
};

constexpr float kTensorA[8] = {1.0f, -2.5f, 3.25f, 0.0f, -0.0f, 1e-8f, 65504.0f, -7.0f};

// Version `version`, 17 metadata entries covering every value type, and two
// tensors: "a" F32 [4, 2] and "b" Q8_0 [32, 1], "b" ending the file so that
// every proper prefix is truncated.
Synthetic MakeSynthetic(uint32_t version = 3, uint32_t alignment = 64) {
  GgufWriter w;
  Synthetic s;
  w.Put<uint32_t>(0x46554747);  // "GGUF"
  w.Put<uint32_t>(version);
  s.tensor_count_at = w.Put<uint64_t>(2);
  w.Put<uint64_t>(17);  // metadata_kv_count
  s.first_key_at = w.size();
  w.Key("t.u8", GgufValueType::kUint8);
  w.Put<uint8_t>(200);
  w.Key("t.i8", GgufValueType::kInt8);
  w.Put<int8_t>(-100);
  w.Key("t.u16", GgufValueType::kUint16);
  w.Put<uint16_t>(60000);
  w.Key("t.i16", GgufValueType::kInt16);
  w.Put<int16_t>(-30000);
  w.Key("t.u32", GgufValueType::kUint32);
  w.Put<uint32_t>(4000000000u);
  w.Key("t.i32", GgufValueType::kInt32);
  w.Put<int32_t>(-2000000000);
  w.Key("t.f32", GgufValueType::kFloat32);
  w.Put<float>(100000.0f);
  w.Key("t.bool", GgufValueType::kBool);
  w.Put<uint8_t>(1);
  w.Key("t.str", GgufValueType::kString);
  w.Str("llama \xc4\xa0 \x00zero"s);
  w.Key("t.u64", GgufValueType::kUint64);
  w.Put<uint64_t>(uint64_t{1} << 40);
  w.Key("t.u64big", GgufValueType::kUint64);
  w.Put<uint64_t>(~uint64_t{0});
  w.Key("t.i64", GgufValueType::kInt64);
  w.Put<int64_t>(-(int64_t{1} << 50));
  w.Key("t.f64", GgufValueType::kFloat64);
  w.Put<double>(0.1);
  w.Key("t.arr_i32", GgufValueType::kArray);
  w.Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kInt32));
  w.Put<uint64_t>(3);
  for (int32_t v : {3, -1, 7}) w.Put<int32_t>(v);
  w.Key("t.arr_str", GgufValueType::kArray);
  w.Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kString));
  w.Put<uint64_t>(3);
  w.Str("Ġ t");
  w.Str("");
  w.Str("<|im_end|>");
  w.Key("t.arr_f32", GgufValueType::kArray);
  w.Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kFloat32));
  w.Put<uint64_t>(2);
  w.Put<float>(0.5f);
  w.Put<float>(-1.5f);
  w.Key("general.alignment", GgufValueType::kUint32);
  w.Put<uint32_t>(alignment);

  // Tensor "a": F32 [4, 2] at data offset 0 (32 bytes).
  w.Str("a");
  w.Put<uint32_t>(2);
  w.Put<uint64_t>(4);
  w.Put<uint64_t>(2);
  w.Put<uint32_t>(static_cast<uint32_t>(GgmlType::kF32));
  w.Put<uint64_t>(0);
  // Tensor "b": Q8_0 [32, 1] (34 bytes) at the next aligned data offset.
  w.Str("b");
  w.Put<uint32_t>(2);
  w.Put<uint64_t>(32);
  w.Put<uint64_t>(1);
  s.b_type_at = w.Put<uint32_t>(static_cast<uint32_t>(GgmlType::kQ8_0));
  s.b_offset_at = w.Put<uint64_t>(alignment);  // 32 bytes of "a", padded.

  w.PadTo(alignment);
  s.data_offset = w.size();
  for (float v : kTensorA) w.Put<float>(v);
  w.PadTo(alignment);
  w.Put<uint16_t>(0x3800);  // d = 0.5
  for (int j = 0; j < 32; ++j) w.Put<int8_t>(static_cast<int8_t>(j - 16));
  s.bytes = w.bytes();
  return s;
}

// Writes `bytes` to a fresh file under the test temp dir.
std::string WriteTemp(const std::string& bytes) {
  static int counter = 0;
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/gguf_file_test_", getpid(), "_", counter++, ".gguf");
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  EXPECT_TRUE(out.good()) << "cannot write " << path;
  return path;
}

absl::StatusOr<std::unique_ptr<GgufFile>> OpenBytes(const std::string& bytes) {
  const std::string path = WriteTemp(bytes);
  auto file = GgufFile::Open(path);
  ::unlink(path.c_str());  // The mapping outlives the name.
  return file;
}

// --- Synthetic files read back ---

TEST(GgufFileTest, ReadsEveryMetadataTypeBack) {
  auto file = OpenBytes(MakeSynthetic().bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.keys().size(), 17u);
  EXPECT_EQ(f.keys().front(), "t.u8");
  EXPECT_TRUE(f.Has("t.u8"));
  EXPECT_FALSE(f.Has("t.missing"));

  EXPECT_EQ(*f.GetInt("t.u8"), 200);
  EXPECT_EQ(*f.GetInt("t.i8"), -100);
  EXPECT_EQ(*f.GetInt("t.u16"), 60000);
  EXPECT_EQ(*f.GetInt("t.i16"), -30000);
  EXPECT_EQ(*f.GetInt("t.u32"), 4000000000LL);
  EXPECT_EQ(*f.GetInt("t.i32"), -2000000000);
  EXPECT_EQ(*f.GetInt("t.bool"), 1);
  EXPECT_EQ(*f.GetInt("t.u64"), int64_t{1} << 40);
  EXPECT_EQ(*f.GetInt("t.i64"), -(int64_t{1} << 50));
  EXPECT_EQ(*f.GetInt("general.alignment"), 64);
  EXPECT_EQ(*f.GetFloat("t.f32"), 100000.0);
  EXPECT_EQ(*f.GetFloat("t.f64"), 0.1);
  EXPECT_EQ(*f.GetFloat("t.i32"), -2000000000.0);                // Integers convert.
  EXPECT_EQ(*f.GetString("t.str"), "llama \xc4\xa0 \x00zero"s);  // Embedded NUL kept.
  EXPECT_THAT(*f.GetIntArray("t.arr_i32"), ElementsAre(3, -1, 7));
  EXPECT_THAT(*f.GetStringArray("t.arr_str"), ElementsAre("Ġ t", "", "<|im_end|>"));
  EXPECT_THAT(*f.GetFloatArray("t.arr_f32"), ElementsAre(0.5, -1.5));
  EXPECT_EQ(*f.Type("t.arr_str"), GgufValueType::kArray);
}

TEST(GgufFileTest, MissingKeyIsNotFoundAndWrongTypeIsInvalidArgument) {
  auto file = OpenBytes(MakeSynthetic().bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;

  const absl::Status missing = f.GetInt("llama.block_count").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.message()), HasSubstr("llama.block_count"));

  const absl::Status str_as_int = f.GetInt("t.str").status();
  EXPECT_EQ(str_as_int.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(str_as_int.message()),
              AllOf(HasSubstr("t.str"), HasSubstr("string"), HasSubstr("integer")));

  const absl::Status int_as_str = f.GetString("t.u32").status();
  EXPECT_EQ(int_as_str.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(int_as_str.message()),
              AllOf(HasSubstr("t.u32"), HasSubstr("u32"), HasSubstr("string")));

  const absl::Status ints_as_strs = f.GetStringArray("t.arr_i32").status();
  EXPECT_EQ(ints_as_strs.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(ints_as_strs.message()),
      AllOf(HasSubstr("t.arr_i32"), HasSubstr("array of i32"), HasSubstr("array of string")));

  const absl::Status scalar_as_array = f.GetIntArray("t.i32").status();
  EXPECT_EQ(scalar_as_array.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(scalar_as_array.message()),
              AllOf(HasSubstr("t.i32"), HasSubstr("array")));

  EXPECT_EQ(f.GetFloat("t.str").status().code(), absl::StatusCode::kInvalidArgument);
  // 2^64 - 1 does not fit the int64 the getter returns.
  const absl::Status too_big = f.GetInt("t.u64big").status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_big.message()), HasSubstr("t.u64big"));
}

TEST(GgufFileTest, ReadsTensorsWithAlignmentPadding) {
  const Synthetic s = MakeSynthetic();
  auto file = OpenBytes(s.bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const GgufFile& f = **file;
  EXPECT_EQ(f.data_offset(), s.data_offset);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  ASSERT_EQ(f.tensors().size(), 2u);

  auto a = f.Tensor("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->name, "a");
  EXPECT_EQ((*a)->type, GgmlType::kF32);
  EXPECT_THAT((*a)->dims, ElementsAre(4, 2));
  EXPECT_EQ((*a)->elements(), 8);
  EXPECT_EQ((*a)->bytes, 32u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*a)->data) % 64, 0u);
  EXPECT_EQ(std::memcmp((*a)->data, kTensorA, sizeof(kTensorA)), 0);

  auto b = f.Tensor("b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->type, GgmlType::kQ8_0);
  EXPECT_THAT((*b)->dims, ElementsAre(32, 1));
  EXPECT_EQ((*b)->bytes, 34u);
  EXPECT_EQ((*b)->data, (*a)->data + 64);  // 32 bytes of "a" padded to 64.
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*b)->data) % 64, 0u);
  EXPECT_EQ((*b)->data[0], 0x00);
  EXPECT_EQ((*b)->data[1], 0x38);
  EXPECT_EQ(static_cast<int8_t>((*b)->data[2]), -16);
  EXPECT_EQ(&f.tensors()[1], *b);

  const absl::Status missing = f.Tensor("output.weight").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.message()), HasSubstr("output.weight"));
}

TEST(GgufFileTest, ReadsVersion2AndDefaultAlignment) {
  // general.alignment = 32 is the default; version 2 has the same layout.
  auto file = OpenBytes(MakeSynthetic(/*version=*/2, /*alignment=*/32).bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->version(), 2u);
  EXPECT_EQ((*file)->alignment(), 32u);
  EXPECT_EQ((*file)->data_offset() % 32, 0u);
  EXPECT_EQ((*(*file)->Tensor("b"))->data, (*(*file)->Tensor("a"))->data + 32);
}

// --- Malformed files ---

TEST(GgufFileTest, EveryTruncationIsDataLoss) {
  const Synthetic s = MakeSynthetic();
  for (size_t len = 0; len < s.bytes.size(); ++len) {
    const absl::Status st = OpenBytes(s.bytes.substr(0, len)).status();
    ASSERT_EQ(st.code(), absl::StatusCode::kDataLoss) << "prefix of " << len << " bytes: " << st;
  }
}

TEST(GgufFileTest, TruncationMessagesNameTheFieldAndBound) {
  const Synthetic s = MakeSynthetic();
  // Cut inside tensor "b"'s data.
  const absl::Status in_data = OpenBytes(s.bytes.substr(0, s.bytes.size() - 1)).status();
  EXPECT_EQ(in_data.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(in_data.message()),
              AllOf(HasSubstr("tensor 'b'"), HasSubstr("past the end"),
                    HasSubstr(absl::StrCat(s.bytes.size() - 1, "-byte file"))));
  // Cut inside tensor "b"'s offset field.
  const absl::Status in_info = OpenBytes(s.bytes.substr(0, s.b_offset_at + 4)).status();
  EXPECT_EQ(in_info.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(in_info.message()),
              AllOf(HasSubstr("tensor 'b' offset"),
                    HasSubstr(absl::StrCat("offset ", s.b_offset_at)), HasSubstr("needs 8 bytes")));
  // Cut inside the header.
  const absl::Status in_header = OpenBytes(s.bytes.substr(0, 6)).status();
  EXPECT_EQ(in_header.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(in_header.message()), AllOf(HasSubstr("version"), HasSubstr("offset 4")));
}

// Random bytes changed anywhere in a valid file (lengths, counts, types,
// offsets, names): Open either succeeds or fails with INVALID_ARGUMENT or
// DATA_LOSS, and never reads past the file or allocates what a count claims
// before checking it against the bytes left (a count of 2^60 strings must
// not reserve 2^60 entries).
TEST(GgufFileTest, RandomlyCorruptedFilesOpenOrFailCleanly) {
  const Synthetic s = MakeSynthetic();
  std::mt19937_64 rng(5);
  int opened = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    std::string bytes = s.bytes;
    for (int f = 1 + static_cast<int>(rng() % 4); f > 0; --f) {
      bytes[rng() % bytes.size()] = static_cast<char>(rng() % 4 == 0 ? 0xff : rng() % 256);
    }
    const absl::StatusOr<std::unique_ptr<GgufFile>> file = OpenBytes(bytes);
    if (file.ok()) {
      ++opened;
      continue;
    }
    const absl::StatusCode code = file.status().code();
    EXPECT_TRUE(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kDataLoss)
        << "trial " << trial << ": " << file.status();
  }
  EXPECT_GT(opened, 0);
}

TEST(GgufFileTest, RejectsBadMagic) {
  Synthetic s = MakeSynthetic();
  s.bytes[0] = 'X';
  const absl::Status st = OpenBytes(s.bytes).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr("magic"), HasSubstr("GGUF")));
}

TEST(GgufFileTest, RejectsUnsupportedVersion) {
  for (uint32_t version : {1u, 4u}) {
    const absl::Status st = OpenBytes(MakeSynthetic(version).bytes).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(st.message()),
                AllOf(HasSubstr("version"), HasSubstr(absl::StrCat(version))));
  }
}

TEST(GgufFileTest, RejectsTensorOffsetPastTheEnd) {
  Synthetic s = MakeSynthetic();
  GgufWriter w;
  w.bytes() = s.bytes;
  w.Patch<uint64_t>(s.b_offset_at, 64 * 1000);  // Aligned, but beyond the file.
  const absl::Status st = OpenBytes(w.bytes()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("tensor 'b'"), HasSubstr("64000"), HasSubstr("past the end")));

  // An offset so large that offset + bytes would wrap must not pass either.
  w.Patch<uint64_t>(s.b_offset_at, ~uint64_t{63});
  EXPECT_EQ(OpenBytes(w.bytes()).status().code(), absl::StatusCode::kDataLoss);
}

// Found by tests/fuzz/gguf_fuzz: a tensor of no bytes in a file that ends
// before the data section's alignment padding pointed past the file.
TEST(GgufFileTest, RejectsDataSectionPastTheEnd) {
  GgufWriter w;
  w.Put<uint32_t>(0x46554747);  // "GGUF"
  w.Put<uint32_t>(3);
  w.Put<uint64_t>(1);  // One tensor,
  w.Put<uint64_t>(0);  // no metadata.
  w.Str("empty");
  w.Put<uint32_t>(1);  // n_dims
  w.Put<uint64_t>(0);  // No elements.
  w.Put<uint32_t>(0);  // F32
  w.Put<uint64_t>(0);  // offset
  ASSERT_EQ(w.size(), 61u);  // The padding to 32 is missing.
  const absl::Status st = OpenBytes(w.bytes()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("data section starts at offset 64"), HasSubstr("ends at 61"),
                    HasSubstr("61-byte file")));
  // With the padding the same file opens, its tensor at the end.
  w.PadTo(32);
  absl::StatusOr<std::unique_ptr<GgufFile>> file = OpenBytes(w.bytes());
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors()[0].bytes, 0u);
  EXPECT_EQ((*file)->data_offset(), 64u);
}

TEST(GgufFileTest, RejectsMisalignedTensorOffset) {
  Synthetic s = MakeSynthetic();
  GgufWriter w;
  w.bytes() = s.bytes;
  w.Patch<uint64_t>(s.b_offset_at, 40);
  const absl::Status st = OpenBytes(w.bytes()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr("tensor 'b'"), HasSubstr("alignment 64")));
}

TEST(GgufFileTest, RejectsUnknownTensorType) {
  Synthetic s = MakeSynthetic();
  GgufWriter w;
  w.bytes() = s.bytes;
  w.Patch<uint32_t>(s.b_type_at, 4);  // Q4_2, removed from ggml.
  const absl::Status st = OpenBytes(w.bytes()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), AllOf(HasSubstr("tensor 'b'"), HasSubstr("ggml type 4")));
}

TEST(GgufFileTest, RejectsCountsThatCannotFit) {
  Synthetic s = MakeSynthetic();
  GgufWriter w;
  w.bytes() = s.bytes;
  w.Patch<uint64_t>(s.tensor_count_at, uint64_t{1} << 60);
  const absl::Status st = OpenBytes(w.bytes()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()), HasSubstr("tensor_count"));

  // A key length beyond the file.
  w.bytes() = s.bytes;
  w.Patch<uint64_t>(s.first_key_at, uint64_t{1} << 62);
  const absl::Status key = OpenBytes(w.bytes()).status();
  EXPECT_EQ(key.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(key.message()), AllOf(HasSubstr("metadata key #0"), HasSubstr("length")));
}

TEST(GgufFileTest, MissingFileIsNotFound) {
  const absl::Status st = GgufFile::Open(::testing::TempDir() + "/no_such_model.gguf").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(st.message()), HasSubstr("no_such_model.gguf"));
}

TEST(GgufFileTest, TypeNames) {
  EXPECT_EQ(GgmlTypeName(GgmlType::kQ4_1), "Q4_1");
  EXPECT_EQ(GgmlTypeName(GgmlType::kBF16), "BF16");
  EXPECT_EQ(GgmlTypeName(static_cast<GgmlType>(12)), "Q4_K");
  EXPECT_EQ(GgmlTypeName(static_cast<GgmlType>(99)), "ggml type 99");
  EXPECT_EQ(GgufValueTypeName(GgufValueType::kFloat32), "f32");
}

// --- Data paths ---

// Sets or unsets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(EvalDataTest, PathsFollowTheEnvironment) {
  ScopedEnv model("KVQ_EVAL_MODEL", nullptr);
  {
    ScopedEnv data("KVQ_EVAL_DATA", "/data/eval");
    EXPECT_EQ(EvalDataDir(), "/data/eval");
    EXPECT_EQ(EvalModelPath(), "/data/eval/SmolLM2-135M-Instruct.Q4_1.gguf");
  }
  ScopedEnv data("KVQ_EVAL_DATA", nullptr);
  {
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(EvalDataDir(), "/xdg/kvq/eval");
  }
  ScopedEnv xdg("XDG_CACHE_HOME", "");  // Empty counts as unset.
  ScopedEnv home("HOME", "/home/u");
  EXPECT_EQ(EvalDataDir(), "/home/u/.cache/kvq/eval");
  ScopedEnv explicit_model("KVQ_EVAL_MODEL", "/m.gguf");
  EXPECT_EQ(EvalModelPath(), "/m.gguf");
}

// --- The real model (scripts/fetch_eval_data.sh) ---


TEST(GgufFileRealModelTest, Metadata) {
  std::unique_ptr<GgufFile> f = OpenEvalModel();
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(*f->GetString("general.architecture"), "llama");
  EXPECT_EQ(*f->GetInt("llama.block_count"), 30);
  EXPECT_EQ(*f->GetInt("llama.attention.head_count"), 9);
  EXPECT_EQ(*f->GetInt("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(*f->GetInt("llama.embedding_length"), 576);
  EXPECT_EQ(*f->GetInt("llama.feed_forward_length"), 1536);
  EXPECT_EQ(*f->GetInt("llama.rope.dimension_count"), 64);
  EXPECT_EQ(*f->GetInt("llama.context_length"), 8192);
  EXPECT_EQ(*f->Type("llama.block_count"), GgufValueType::kUint32);
  EXPECT_EQ(*f->GetFloat("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(*f->GetFloat("llama.attention.layer_norm_rms_epsilon"), static_cast<double>(1e-5f));
  EXPECT_EQ(*f->GetString("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(*f->GetInt("tokenizer.ggml.bos_token_id"), 1);
  EXPECT_EQ(*f->GetInt("tokenizer.ggml.eos_token_id"), 2);
  EXPECT_EQ(*f->GetInt("tokenizer.ggml.add_bos_token"), 0);  // bool

  auto tokens = f->GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 49152u);
  EXPECT_EQ((*tokens)[0], "<|endoftext|>");
  EXPECT_EQ((*tokens)[1], "<|im_start|>");
  EXPECT_EQ((*tokens)[2], "<|im_end|>");
  EXPECT_EQ(tokens->back(), "ectable");

  auto merges = f->GetStringArray("tokenizer.ggml.merges");
  ASSERT_TRUE(merges.ok()) << merges.status();
  ASSERT_EQ(merges->size(), 48900u);
  EXPECT_EQ((*merges)[0], "Ġ t");
  EXPECT_EQ((*merges)[1], "Ġ a");

  auto token_type = f->GetIntArray("tokenizer.ggml.token_type");
  ASSERT_TRUE(token_type.ok()) << token_type.status();
  ASSERT_EQ(token_type->size(), 49152u);
  EXPECT_EQ((*token_type)[0], 3);   // Control.
  EXPECT_EQ((*token_type)[17], 1);  // Normal.
}

TEST(GgufFileRealModelTest, TensorDirectory) {
  std::unique_ptr<GgufFile> f = OpenEvalModel();
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(f->tensors().size(), 272u);
  int q4_1 = 0, f32 = 0, q8_0 = 0, other = 0;
  for (const GgufTensor& t : f->tensors()) {
    switch (t.type) {
      case GgmlType::kQ4_1:
        ++q4_1;
        break;
      case GgmlType::kF32:
        ++f32;
        break;
      case GgmlType::kQ8_0:
        ++q8_0;
        break;
      default:
        ++other;
        ADD_FAILURE() << t.name << " has unexpected type " << GgmlTypeName(t.type);
    }
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % f->alignment(), 0u) << t.name;
  }
  EXPECT_EQ(q4_1, 210);
  EXPECT_EQ(f32, 61);
  EXPECT_EQ(q8_0, 1);
  EXPECT_EQ(other, 0);

  const GgufTensor* emb = *f->Tensor("token_embd.weight");
  EXPECT_EQ(emb->type, GgmlType::kQ8_0);
  EXPECT_THAT(emb->dims, ElementsAre(576, 49152));
  EXPECT_EQ(emb->bytes, size_t{49152} * 18 * 34);

  const GgufTensor* k = *f->Tensor("blk.0.attn_k.weight");
  EXPECT_EQ(k->type, GgmlType::kQ4_1);
  EXPECT_THAT(k->dims, ElementsAre(576, 192));  // [in, out]: 3 kv heads x 64.
  EXPECT_EQ(k->bytes, size_t{192} * 18 * 20);

  const GgufTensor* down = *f->Tensor("blk.29.ffn_down.weight");
  EXPECT_THAT(down->dims, ElementsAre(1536, 576));

  const GgufTensor* norm = *f->Tensor("output_norm.weight");
  EXPECT_EQ(norm->type, GgmlType::kF32);
  EXPECT_THAT(norm->dims, ElementsAre(576));
}

}  // namespace
}  // namespace kvq::eval
