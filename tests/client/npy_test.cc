// .npy reader/writer: round trips, files NumPy wrote, malformed input.
#include "client/npy.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvq {
namespace {

std::string Bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

// A v1.0 file around `header` (padded as NumPy pads) and `data`.
std::string NpyFile(std::string header, const std::string& data, int major = 1) {
  const size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  const size_t n = header.size();
  out.push_back(static_cast<char>(n & 0xff));
  out.push_back(static_cast<char>(n >> 8));
  if (major != 1) out += Bytes({0, 0});
  return out + header + data;
}

TEST(NpyTest, ReadsWhatNumPyWrites) {
  // np.save of np.arange(6, dtype='<f4').reshape(2, 3) (NumPy 2.x pads the
  // header to 128 bytes).
  std::string file = "\x93NUMPY";
  file += Bytes({1, 0, 0x76, 0});
  file += "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  file.append(128 - 1 - file.size(), ' ');
  file.push_back('\n');
  for (float f : {0.f, 1.f, 2.f, 3.f, 4.f, 5.f}) file.append(reinterpret_cast<char*>(&f), 4);
  ASSERT_EQ(file.size(), 152u);
  absl::StatusOr<HostTensor> t = ParseNpy(file);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype, DType::kFloat32);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t->ToFloats(), (std::vector<float>{0, 1, 2, 3, 4, 5}));
}

TEST(NpyTest, ReadsFloat16ScalarsAndOneDimensionalShapes) {
  // fp16 1.5 = 0x3e00, -2 = 0xc000.
  absl::StatusOr<HostTensor> v = ParseNpy(NpyFile(
      "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }", Bytes({0x00, 0x3e, 0x00, 0xc0})));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->dtype, DType::kFloat16);
  EXPECT_EQ(v->shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(v->ToFloats(), (std::vector<float>{1.5f, -2.0f}));

  absl::StatusOr<HostTensor> s = ParseNpy(NpyFile(
      "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", Bytes({0, 0, 0x40, 0x40})));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->ToFloats(), (std::vector<float>{3.0f}));
}

TEST(NpyTest, AcceptsVersion2KeyOrderAndDoubleQuotes) {
  absl::StatusOr<HostTensor> t = ParseNpy(NpyFile(
      "{\"shape\": (1, 1), \"fortran_order\": False, \"descr\": \"<f4\"}", Bytes({0, 0, 0x80, 0x3f}),
      /*major=*/2));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->shape, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(t->ToFloats(), (std::vector<float>{1.0f}));
}

TEST(NpyTest, RoundTripsEveryRankAndDtype) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {7}, {2, 3}, {2, 0, 4}, {2, 3, 4, 5}};
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    for (const auto& shape : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<float> values(n);
      for (int64_t i = 0; i < n; ++i) values[i] = 0.25f * static_cast<float>(i) - 3.0f;
      absl::StatusOr<HostTensor> t = HostTensor::FromFloats(values, shape, dtype);
      ASSERT_TRUE(t.ok()) << t.status();
      absl::StatusOr<std::string> bytes = SerializeNpy(*t);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      // Header padded to 64 bytes and terminated by a newline, as NumPy does.
      const size_t header_len = static_cast<uint8_t>((*bytes)[8]) | (static_cast<uint8_t>((*bytes)[9]) << 8);
      EXPECT_EQ((10 + header_len) % 64, 0u);
      EXPECT_EQ((*bytes)[10 + header_len - 1], '\n');
      absl::StatusOr<HostTensor> back = ParseNpy(*bytes);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(*back, *t) << t->DebugString();
    }
  }
}

TEST(NpyTest, WritesAndReadsFiles) {
  const std::string path = ::testing::TempDir() + "/npy_test_roundtrip.npy";
  absl::StatusOr<HostTensor> t = HostTensor::FromFloats({1, 2, 3, 4}, {2, 2}, DType::kFloat16);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(WriteNpy(path, *t).ok());
  absl::StatusOr<HostTensor> back = ReadNpy(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *t);
  std::remove(path.c_str());
  EXPECT_EQ(ReadNpy(path).status().code(), absl::StatusCode::kNotFound);
}

TEST(NpyTest, RefusesToWriteBfloat16) {
  absl::StatusOr<HostTensor> t = HostTensor::FromFloats({1}, {1}, DType::kBFloat16);
  ASSERT_TRUE(t.ok());
  absl::StatusOr<std::string> bytes = SerializeNpy(*t);
  EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bytes.status().message().find("bfloat16"), absl::string_view::npos);
}

struct Malformed {
  std::string name;
  std::string file;
  std::string expected;  // Part of the error message.
};

TEST(NpyTest, MalformedFilesAreRejectedWithAClearMessage) {
  const std::string f4 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  const std::string data8 = std::string(8, '\0');
  std::string v3 = NpyFile(f4, data8, 2);
  v3[6] = 3;
  std::string short_len = NpyFile(f4, data8);
  short_len[8] = static_cast<char>(0xff);
  short_len[9] = static_cast<char>(0x7f);
  const std::vector<Malformed> cases = {
      {"empty", "", "magic"},
      {"not npy", "PK\x03\x04 a zip file", "magic"},
      {"version 3", v3, "version 3.0"},
      {"header past the end", short_len, "ends inside the header"},
      {"big endian", NpyFile("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", data8),
       "'>f4'"},
      {"float64", NpyFile("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", data8),
       "'<f8'"},
      {"int32", NpyFile("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", data8),
       "'<i4'"},
      {"fortran", NpyFile("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", data8),
       "Fortran"},
      {"truncated data", NpyFile(f4, std::string(7, '\0')), "needs 8 data bytes, the file has 7"},
      {"trailing data", NpyFile(f4, std::string(9, '\0')), "the file has 9"},
      {"missing shape", NpyFile("{'descr': '<f4', 'fortran_order': False, }", data8), "lacks"},
      {"negative dim", NpyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", data8),
       "non-negative"},
      {"unknown key", NpyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", data8),
       "unknown header key 'x'"},
      {"not a dict", NpyFile("[1, 2]", data8), "'{'"},
      {"structured dtype",
       NpyFile("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", data8),
       "quoted string"},
  };
  for (const Malformed& c : cases) {
    absl::StatusOr<HostTensor> t = ParseNpy(c.file);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(t.status().message().find(c.expected), absl::string_view::npos)
        << c.name << ": " << t.status();
  }
}

// A file cut short anywhere, or with random bytes of its header changed,
// parses or fails with INVALID_ARGUMENT; what parses holds exactly the
// bytes its shape and dtype need. (The CLI reads .npy files a user names.)
TEST(NpyTest, CorruptedFilesParseOrFailCleanly) {
  HostTensor t = HostTensor::FromFloats({1, 2, 3, 4, 5, 6}, {2, 3}, DType::kFloat16).value();
  const std::string good = SerializeNpy(t).value();
  const size_t header_end = good.size() - t.byte_size();
  auto check = [&](const std::string& file, const std::string& what) {
    absl::StatusOr<HostTensor> got = ParseNpy(file);
    if (!got.ok()) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << what;
      return;
    }
    EXPECT_TRUE(got->Validate().ok()) << what;
  };
  for (size_t n = 0; n < good.size(); ++n) {
    check(good.substr(0, n), "cut to " + std::to_string(n) + " bytes");
  }
  std::mt19937_64 rng(7);
  std::string alphabet = "0123456789(),:' {}<>fFtTeb-\n\x93";
  alphabet.push_back('\0');
  for (int trial = 0; trial < 2000; ++trial) {
    std::string file = good;
    for (int f = 1 + static_cast<int>(rng() % 3); f > 0; --f) {
      const size_t at = rng() % header_end;
      file[at] = rng() % 2 == 0 ? alphabet[rng() % alphabet.size()]
                                : static_cast<char>(rng() % 256);
    }
    check(file, "trial " + std::to_string(trial));
  }
}

}  // namespace
}  // namespace kvq
