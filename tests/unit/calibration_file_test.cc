#include "kernels/calibration_file.h"

#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvq {
namespace {

using absl::StatusCode;

// 1 layer, 1 KV head, head_dim 2.
ModelCalibration Tiny() {
  ModelCalibration c;
  c.name = "t";
  c.num_layers = 1;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  HeadCalibration h;
  h.key_mean = {1.0f, -2.0f};
  h.key_scale = {0.5f, 0.5f};
  h.value_mean = {0.0f, 0.25f};
  h.value_scale = {2.0f, 4.0f};
  c.heads = {h};
  return c;
}

// 2 layers x 3 KV heads x head_dim 8, every value distinct.
ModelCalibration Small() {
  ModelCalibration c;
  c.name = "smollm2-135m.calib-1";
  c.num_layers = 2;
  c.num_kv_heads = 3;
  c.head_dim = 8;
  for (int i = 0; i < 6; ++i) {
    HeadCalibration h = HeadCalibration::Identity(8);
    for (int ch = 0; ch < 8; ++ch) {
      h.key_mean[ch] = 0.1f * i - 0.01f * ch;
      h.key_scale[ch] = 1.0f + 0.1f * i + 0.2f * (ch / 2);
      h.value_mean[ch] = -0.3f * i + 0.02f * ch;
      h.value_scale[ch] = 0.5f + 0.05f * i + 0.01f * ch;
    }
    c.heads.push_back(h);
  }
  return c;
}

std::string Bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

// Re-seals `bytes` (a whole file) with the checksum of its body, as a writer
// that produced those values would.
void Reseal(std::string* bytes) {
  const size_t body = bytes->size() - 8;
  const uint64_t h = XXH3_64bits(bytes->data(), body);
  for (int i = 0; i < 8; ++i) (*bytes)[body + i] = static_cast<char>((h >> (8 * i)) & 0xff);
}

TEST(CalibrationFileTest, ExactBytes) {
  std::string want = Bytes({'K', 'V', 'Q', 'C', 'A', 'L', 0, 0,  // magic
                            1, 0, 0, 0,                          // version
                            1, 0, 0, 0, 't',                     // name
                            1, 0, 0, 0, 'm',                     // model
                            1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0,  // layers, heads, head_dim
                            0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0,     // key_mean 1, -2
                            0, 0, 0, 0x3f, 0, 0, 0, 0x3f,        // key_scale 0.5, 0.5
                            0, 0, 0, 0, 0, 0, 0x80, 0x3e,        // value_mean 0, 0.25
                            0, 0, 0, 0x40, 0, 0, 0x80, 0x40});   // value_scale 2, 4
  const uint64_t h = XXH3_64bits(want.data(), want.size());
  for (int i = 0; i < 8; ++i) want.push_back(static_cast<char>((h >> (8 * i)) & 0xff));
  absl::StatusOr<std::string> got = SerializeCalibration(Tiny(), "m");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, want);
  absl::StatusOr<CalibrationFile> back = ParseCalibration(want);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->calibration, Tiny());
  EXPECT_EQ(back->model, "m");
  EXPECT_EQ(back->checksum, h);
}

TEST(CalibrationFileTest, RoundTripsThroughAFile) {
  const std::string path =
      (std::filesystem::temp_directory_path() / absl::StrCat("kvqcal_", getpid(), ".kvqcal"))
          .string();
  ASSERT_TRUE(WriteCalibrationFile(path, Small(), "SmolLM2 layers=2").ok());
  absl::StatusOr<CalibrationFile> back = ReadCalibrationFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->calibration, Small());
  EXPECT_EQ(back->model, "SmolLM2 layers=2");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::filesystem::remove(path);
  absl::StatusOr<CalibrationFile> gone = ReadCalibrationFile(path);
  EXPECT_EQ(gone.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(), absl::StrCat(path, ": cannot open"));
}

TEST(CalibrationFileTest, EveryCorruptByteIsRefused) {
  const std::string good = *SerializeCalibration(Small(), "model");
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] ^= 0x10;
    absl::StatusOr<CalibrationFile> r = ParseCalibration(bad);
    ASSERT_FALSE(r.ok()) << "byte " << i << " flipped was accepted";
    // Past the header every flip is a checksum mismatch.
    if (i >= 8 + 4 + 4 + Small().name.size() + 4 + 5 + 12) {
      EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << "byte " << i << ": " << r.status();
    }
  }
  std::string payload = good;
  payload[good.size() - 20] ^= 1;
  absl::StatusOr<CalibrationFile> r = ParseCalibration(payload);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StartsWith(r.status().message(), "calibration file checksum mismatch: stored "))
      << r.status();
}

TEST(CalibrationFileTest, EveryTruncationIsRefused) {
  const std::string good = *SerializeCalibration(Small(), "model");
  for (size_t n = 0; n < good.size(); ++n) {
    absl::StatusOr<CalibrationFile> r = ParseCalibration(good.substr(0, n));
    ASSERT_FALSE(r.ok()) << n << " bytes accepted";
    EXPECT_EQ(r.status().code(), n < 8 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss)
        << n << " bytes: " << r.status();
  }
  absl::StatusOr<CalibrationFile> r = ParseCalibration(good.substr(0, good.size() - 1));
  EXPECT_EQ(r.status().message(),
            absl::StrCat("calibration file is truncated: ", good.size() - 1,
                         " bytes, its header needs ", good.size()));
  r = ParseCalibration(good + "x");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(r.status().message(),
            absl::StrCat("calibration file has 1 bytes after its checksum (", good.size() + 1,
                         " bytes, its header describes ", good.size(), ")"));
}

TEST(CalibrationFileTest, HeaderErrorsNameWhatIsWrong) {
  const std::string good = *SerializeCalibration(Tiny(), "m");
  std::string magic = good;
  magic[0] = 'X';
  EXPECT_EQ(ParseCalibration(magic).status(),
            absl::InvalidArgumentError(
                "not a kvq calibration file: it does not start with the magic \"KVQCAL\""));
  std::string version = good;
  version[8] = 2;
  Reseal(&version);
  EXPECT_EQ(ParseCalibration(version).status(),
            absl::InvalidArgumentError(
                "calibration file version 2; this build reads version 1"));
  std::string name_length = good;
  name_length[12] = static_cast<char>(200);
  EXPECT_EQ(ParseCalibration(name_length).status(),
            absl::InvalidArgumentError("calibration file name length 200 is outside [1, 128]"));
  // Shape fields: layers at offset 8 + 4 + 5 + 5.
  std::string layers = good;
  layers[22] = 0;
  EXPECT_EQ(ParseCalibration(layers).status(),
            absl::InvalidArgumentError("calibration file shape 0 layers x 1 KV heads x "
                                       "head_dim 2 is outside [1, 1024] x [1, 256] x [1, 1024]"));
}

TEST(CalibrationFileTest, WrongShapeOrBadStatisticsAreRefused) {
  // Two layers in the header over one layer's payload: the size no longer
  // matches what the header describes.
  std::string two_layers = *SerializeCalibration(Tiny(), "m");
  two_layers[22] = 2;
  absl::StatusOr<CalibrationFile> r = ParseCalibration(two_layers);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  // An odd head_dim (a RoPE pair split) with a payload that fits it.
  ModelCalibration odd = Tiny();
  odd.head_dim = 3;
  for (std::vector<float>* v : {&odd.heads[0].key_mean, &odd.heads[0].key_scale,
                                &odd.heads[0].value_mean, &odd.heads[0].value_scale}) {
    v->push_back(1.0f);
  }
  EXPECT_EQ(SerializeCalibration(odd, "m").status().code(), StatusCode::kInvalidArgument);
  // A scale that is not > 0, sealed with a valid checksum.
  std::string negative = *SerializeCalibration(Tiny(), "m");
  const size_t value_scale_1 = 8 + 4 + 5 + 5 + 12 + 7 * 4;
  negative[value_scale_1 + 3] = static_cast<char>(0xc0);  // 4.0 -> -4.0
  Reseal(&negative);
  EXPECT_EQ(ParseCalibration(negative).status(),
            absl::InvalidArgumentError(
                "layer 0 KV head 0: calibration value_scale channel 1 must be finite and > 0"));
  // A name the server could not be asked for.
  ModelCalibration bad_name = Tiny();
  bad_name.name = "a/b";
  EXPECT_EQ(SerializeCalibration(bad_name, "m").status(),
            absl::InvalidArgumentError(
                "calibration name \"a/b\" may hold only letters, digits and - _ . :"));
  bad_name.name = "";
  EXPECT_EQ(SerializeCalibration(bad_name, "m").status(),
            absl::InvalidArgumentError("calibration name must have 1 to 128 bytes, got 0"));
  EXPECT_EQ(SerializeCalibration(Tiny(), std::string(1025, 'm')).status(),
            absl::InvalidArgumentError("calibration model has 1025 bytes; the limit is 1024"));
}

}  // namespace
}  // namespace kvq
