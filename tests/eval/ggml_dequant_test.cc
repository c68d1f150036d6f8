#include "bench/eval/ggml_dequant.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/eval/eval_data.h"
#include "bench/eval/gguf_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/eval/real_model.h"

namespace kvq::eval {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// fp16 bit patterns of the scales used below.
constexpr uint16_t kHalfOne = 0x3c00;
constexpr uint16_t kHalfHalf = 0x3800;
constexpr uint16_t kHalfQuarter = 0x3400;
constexpr uint16_t kHalfMinusQuarter = 0xb400;
constexpr uint16_t kHalfMinusHalf = 0xb800;
constexpr uint16_t kHalfMinusOne = 0xbc00;
constexpr uint16_t kHalfMinusTwo = 0xc000;
constexpr uint16_t kHalfMinusFour = 0xc400;
constexpr uint16_t kHalfSmallestSubnormal = 0x0001;  // 2^-24

// Builds raw blocks byte by byte, little-endian.
class Blocks {
 public:
  Blocks& Half(uint16_t h) { return U16(h); }
  Blocks& U16(uint16_t v) {
    bytes_.push_back(static_cast<uint8_t>(v));
    bytes_.push_back(static_cast<uint8_t>(v >> 8));
    return *this;
  }
  Blocks& U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Blocks& Byte(uint8_t b) {
    bytes_.push_back(b);
    return *this;
  }
  Blocks& F32(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return U32(u);
  }
  const uint8_t* data() const { return bytes_.data(); }
  size_t size() const { return bytes_.size(); }

 private:
  std::vector<uint8_t> bytes_;
};

std::vector<float> Dequant(GgmlType type, const Blocks& b, int64_t n) {
  std::vector<float> out(n, -12345.0f);
  const absl::Status st = DequantizeRow(type, b.data(), n, out.data());
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(*GgmlRowBytes(type, n), b.size());
  return out;
}

// --- Hand-built blocks: expected values worked out from the block format ---

TEST(GgmlDequantTest, F32) {
  Blocks b;
  b.F32(1.5f).F32(-0.0f).F32(3.0e38f).F32(-1e-30f);
  EXPECT_THAT(Dequant(GgmlType::kF32, b, 4), ElementsAreArray({1.5f, -0.0f, 3.0e38f, -1e-30f}));
}

TEST(GgmlDequantTest, F16) {
  Blocks b;
  b.Half(kHalfOne)
      .Half(kHalfMinusTwo)
      .Half(0x7bff)
      .Half(kHalfSmallestSubnormal)
      .Half(0x03ff)
      .Half(0x2e66);
  EXPECT_THAT(
      Dequant(GgmlType::kF16, b, 6),
      ElementsAreArray({1.0f, -2.0f, 65504.0f, 0x1p-24f, 6.0975551605224609e-05f /* 1023 * 2^-24 */,
                        0.0999755859375f /* fp16(0.1) */}));
}

TEST(GgmlDequantTest, BF16) {
  Blocks b;
  b.U16(0x3f80).U16(0xc040).U16(0x3e00).U16(0x0001);
  EXPECT_THAT(Dequant(GgmlType::kBF16, b, 4), ElementsAreArray({1.0f, -3.0f, 0.125f, 0x1p-133f}));
}

TEST(GgmlDequantTest, Q4_0NegativeScaleAndNibbleOrder) {
  // d = -0.5; byte j holds element j (low nibble = j) and element j + 16
  // (high nibble = 15 - j); x = (q - 8) * d.
  Blocks b;
  b.Half(kHalfMinusHalf);
  for (int j = 0; j < 16; ++j) b.Byte(static_cast<uint8_t>(j | ((15 - j) << 4)));
  EXPECT_THAT(
      Dequant(GgmlType::kQ4_0, b, 32),
      ElementsAreArray({4.0f,  3.5f,  3.0f,  2.5f,  2.0f,  1.5f,  1.0f,  0.5f,  0.0f,  -0.5f, -1.0f,
                        -1.5f, -2.0f, -2.5f, -3.0f, -3.5f, -3.5f, -3.0f, -2.5f, -2.0f, -1.5f, -1.0f,
                        -0.5f, 0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  2.5f,  3.0f,  3.5f,  4.0f}));
}

TEST(GgmlDequantTest, Q4_1MinOffsetTwoBlocks) {
  Blocks b;
  // Block 0: d = 0.25, m = -1; low nibble 15 - j, high nibble j; x = q * d + m.
  b.Half(kHalfQuarter).Half(kHalfMinusOne);
  for (int j = 0; j < 16; ++j) b.Byte(static_cast<uint8_t>((15 - j) | (j << 4)));
  // Block 1: d = -2, m = 0.5; every byte 0x31 (low 1, high 3).
  b.Half(kHalfMinusTwo).Half(kHalfHalf);
  for (int j = 0; j < 16; ++j) b.Byte(0x31);
  std::vector<float> want = {2.75f, 2.5f,   2.25f, 2.0f,   1.75f,  1.5f,  1.25f,  1.0f,
                             0.75f, 0.5f,   0.25f, 0.0f,   -0.25f, -0.5f, -0.75f, -1.0f,
                             -1.0f, -0.75f, -0.5f, -0.25f, 0.0f,   0.25f, 0.5f,   0.75f,
                             1.0f,  1.25f,  1.5f,  1.75f,  2.0f,   2.25f, 2.5f,   2.75f};
  want.insert(want.end(), 16, -1.5f);  // 1 * -2 + 0.5
  want.insert(want.end(), 16, -5.5f);  // 3 * -2 + 0.5
  EXPECT_THAT(Dequant(GgmlType::kQ4_1, b, 64), ElementsAreArray(want));
}

TEST(GgmlDequantTest, Q5_0HighBits) {
  Blocks b;
  // Block 0: d = 1; qh bits 0..15 set (the fifth bit of elements 0..15);
  // low nibble j, high nibble 15 - j; x = (q - 16) * d.
  b.Half(kHalfOne).U32(0x0000ffffu);
  for (int j = 0; j < 16; ++j) b.Byte(static_cast<uint8_t>(j | ((15 - j) << 4)));
  // Block 1: d = -0.5; qh bits 0 and 31 only; all nibbles 0.
  b.Half(kHalfMinusHalf).U32(0x80000001u);
  for (int j = 0; j < 16; ++j) b.Byte(0x00);
  std::vector<float> want;
  for (int j = 0; j < 16; ++j) want.push_back(static_cast<float>(j));       // (j + 16) - 16
  for (int j = 0; j < 16; ++j) want.push_back(static_cast<float>(-1 - j));  // (15 - j) - 16
  want.push_back(0.0f);                                                     // (16 - 16) * -0.5
  want.insert(want.end(), 30, 8.0f);                                        // (0 - 16) * -0.5
  want.push_back(0.0f);                                                     // Element 31: bit 31.
  EXPECT_THAT(Dequant(GgmlType::kQ5_0, b, 64), ElementsAreArray(want));
}

TEST(GgmlDequantTest, Q5_1HighBitsAndMin) {
  // d = 0.5, m = -4; qh = 0xaaaa0000: the odd elements of the upper half get
  // the fifth bit; byte j = j | j << 4; x = q * d + m.
  Blocks b;
  b.Half(kHalfHalf).Half(kHalfMinusFour).U32(0xaaaa0000u);
  for (int j = 0; j < 16; ++j) b.Byte(static_cast<uint8_t>(j | (j << 4)));
  EXPECT_THAT(
      Dequant(GgmlType::kQ5_1, b, 32),
      ElementsAreArray({-4.0f, -3.5f, -3.0f, -2.5f, -2.0f, -1.5f, -1.0f, -0.5f, 0.0f, 0.5f,  1.0f,
                        1.5f,  2.0f,  2.5f,  3.0f,  3.5f,  -4.0f, 4.5f,  -3.0f, 5.5f, -2.0f, 6.5f,
                        -1.0f, 7.5f,  0.0f,  8.5f,  1.0f,  9.5f,  2.0f,  10.5f, 3.0f, 11.5f}));
}

TEST(GgmlDequantTest, Q8_0SignedValuesAndSubnormalScale) {
  Blocks b;
  // Block 0: d = -0.25; q = -128, then j - 16 for j = 1..30, then 127.
  b.Half(kHalfMinusQuarter).Byte(0x80);
  for (int j = 1; j < 31; ++j) b.Byte(static_cast<uint8_t>(static_cast<int8_t>(j - 16)));
  b.Byte(0x7f);
  // Block 1: d = 2^-24 (subnormal half); q = 3 everywhere.
  b.Half(kHalfSmallestSubnormal);
  for (int j = 0; j < 32; ++j) b.Byte(3);
  std::vector<float> want = {32.0f};  // -128 * -0.25
  for (int j = 1; j < 31; ++j) want.push_back((16 - j) * 0.25f);
  want.push_back(-31.75f);  // 127 * -0.25
  want.insert(want.end(), 32, 3 * 0x1p-24f);
  EXPECT_THAT(Dequant(GgmlType::kQ8_0, b, 64), ElementsAreArray(want));
}

// --- Sizes and errors ---

TEST(GgmlDequantTest, RowBytes) {
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kF32, 5), 20u);
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kF16, 5), 10u);
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kBF16, 3), 6u);
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kQ4_0, 64), 36u);
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kQ4_1, 576), 360u);
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kQ5_0, 32), 22u);
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kQ5_1, 32), 24u);
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kQ8_0, 576), 612u);
  EXPECT_EQ(*GgmlRowBytes(GgmlType::kQ8_0, 0), 0u);
  EXPECT_EQ(*GgmlRowBytes(static_cast<GgmlType>(12), 256), 144u);  // Q4_K: sized, not decoded.
}

TEST(GgmlDequantTest, RejectsNotAMultipleOfTheBlock) {
  const absl::Status bytes = GgmlRowBytes(GgmlType::kQ4_1, 33).status();
  EXPECT_EQ(bytes.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bytes.message()),
              AllOf(HasSubstr("33"), HasSubstr("Q4_1"), HasSubstr("32")));

  std::vector<uint8_t> src(64, 0);
  std::vector<float> dst(64);
  const absl::Status row = DequantizeRow(GgmlType::kQ8_0, src.data(), 48, dst.data());
  EXPECT_EQ(row.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(row.message()),
              AllOf(HasSubstr("48"), HasSubstr("Q8_0"), HasSubstr("32")));
  EXPECT_EQ(DequantizeRow(GgmlType::kQ4_0, src.data(), -32, dst.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GgmlDequantTest, OtherTypesAreUnimplemented) {
  std::vector<uint8_t> src(256, 0);
  std::vector<float> dst(256);
  const absl::Status k = DequantizeRow(static_cast<GgmlType>(12), src.data(), 256, dst.data());
  EXPECT_EQ(k.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(k.message()), HasSubstr("Q4_K"));
  EXPECT_FALSE(CanDequantize(static_cast<GgmlType>(14)));

  const absl::Status unknown = GgmlRowBytes(static_cast<GgmlType>(99), 32).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("ggml type 99"));
}

TEST(GgmlDequantTest, TensorIsRowMajorOverDims0) {
  // Q8_0 [32, 3]: row r is block r, q = r + 1 everywhere, d = 1.
  Blocks b;
  for (int r = 0; r < 3; ++r) {
    b.Half(kHalfOne);
    for (int j = 0; j < 32; ++j) b.Byte(static_cast<uint8_t>(r + 1));
  }
  GgufTensor t{
      .name = "w", .type = GgmlType::kQ8_0, .dims = {32, 3}, .data = b.data(), .bytes = b.size()};
  auto out = DequantizeTensor(t);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 96u);
  for (int r = 0; r < 3; ++r) {
    for (int j = 0; j < 32; ++j) EXPECT_EQ((*out)[r * 32 + j], r + 1.0f) << r << "," << j;
  }

  t.bytes -= 1;
  const absl::Status wrong = DequantizeTensor(t).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.message()),
              AllOf(HasSubstr("'w'"), HasSubstr("101"), HasSubstr("102")));

  GgufTensor k{.name = "k",
               .type = static_cast<GgmlType>(12),
               .dims = {256},
               .data = b.data(),
               .bytes = 144};
  EXPECT_EQ(DequantizeTensor(k).status().code(), absl::StatusCode::kUnimplemented);
}

TEST(GgmlDequantTest, ParallelTensorMatchesRows) {
  // Large enough to be split across threads, with a ragged last chunk.
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1,
                        GgmlType::kQ8_0, GgmlType::kF16}) {
    const int64_t row = 4096, rows = 77;
    const size_t row_bytes = *GgmlRowBytes(type, row);
    std::vector<uint8_t> data(row_bytes * rows);
    std::mt19937 rng(7);
    for (uint8_t& x : data) x = static_cast<uint8_t>(rng());
    // Keep the fp16 scales finite: clear the top exponent bit of every
    // 16-bit word (random bytes would otherwise hold Inf/NaN scales, which
    // compare unequal to themselves).
    for (size_t i = 1; i < data.size(); i += 2) data[i] &= 0xbf;
    GgufTensor t{
        .name = "r", .type = type, .dims = {row, rows}, .data = data.data(), .bytes = data.size()};
    auto out = DequantizeTensor(t);
    ASSERT_TRUE(out.ok()) << out.status();
    std::vector<float> want(row);
    for (int64_t r = 0; r < rows; ++r) {
      ASSERT_TRUE(DequantizeRow(type, data.data() + r * row_bytes, row, want.data()).ok());
      ASSERT_EQ(std::memcmp(want.data(), out->data() + r * row, row * sizeof(float)), 0)
          << GgmlTypeName(type) << " row " << r;
    }
  }
}

// --- The real model against the gguf Python package ---


struct GoldenTensor {
  std::string type;
  std::vector<int64_t> dims;
  std::vector<std::pair<int64_t, float>> values;  // (flat index, value)
};

// Parses tests/eval/testdata/gguf_golden.txt (make_gguf_golden.py).
std::map<std::string, GoldenTensor> ReadGolden() {
  const std::string path = std::string(KVQ_GGUF_TESTDATA_DIR) + "/gguf_golden.txt";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::map<std::string, GoldenTensor> golden;
  GoldenTensor* cur = nullptr;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    if (line.rfind("tensor ", 0) == 0) {
      std::string word, name;
      int n_dims = 0;
      ls >> word >> name;
      cur = &golden[name];
      ls >> cur->type >> n_dims;
      cur->dims.resize(n_dims);
      for (int64_t& d : cur->dims) ls >> d;
    } else if (cur != nullptr) {
      int64_t i;
      float v;
      ls >> i >> v;
      cur->values.emplace_back(i, v);
    }
  }
  return golden;
}

TEST(GgmlDequantRealModelTest, MatchesPythonGguf) {
  std::unique_ptr<GgufFile> f = OpenEvalModel();
  ASSERT_NE(f, nullptr);
  const std::map<std::string, GoldenTensor> golden = ReadGolden();
  ASSERT_EQ(golden.size(), 4u);
  for (const auto& [name, g] : golden) {
    SCOPED_TRACE(name);
    auto t = f->Tensor(name);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(GgmlTypeName((*t)->type), g.type);
    EXPECT_EQ((*t)->dims, g.dims);
    auto values = DequantizeTensor(**t);
    ASSERT_TRUE(values.ok()) << values.status();
    ASSERT_GT(g.values.size(), 64u);
    int bad = 0;
    for (const auto& [i, want] : g.values) {
      ASSERT_LT(i, static_cast<int64_t>(values->size()));
      const float got = (*values)[i];
      // %.9g round-trips a float, so this is exact unless the arithmetic
      // differs; 1e-6 relative is the agreed bound.
      if (!(std::fabs(got - want) <= 1e-6f * std::fabs(want))) {
        if (++bad <= 5) ADD_FAILURE() << name << "[" << i << "] = " << got << ", want " << want;
      }
    }
    EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << g.values.size() << " values differ";
  }
}

TEST(GgmlDequantRealModelTest, EveryTensorDequantizesToFiniteValues) {
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<GgufFile> f = OpenEvalModel();
  ASSERT_NE(f, nullptr);
  int64_t elements = 0;
  double dequant_seconds = 0;
  for (const GgufTensor& t : f->tensors()) {
    const auto t0 = std::chrono::steady_clock::now();
    auto values = DequantizeTensor(t);
    dequant_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(values.ok()) << values.status();
    ASSERT_EQ(static_cast<int64_t>(values->size()), t.elements());
    for (float v : *values) ASSERT_TRUE(std::isfinite(v)) << t.name;
    elements += t.elements();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Reported, not asserted: wall time on a shared CI machine is too noisy to
  // gate on.
  std::cout << "[ timing ] " << f->tensors().size() << " tensors, " << elements
            << " weights: dequantized in " << dequant_seconds << " s, " << seconds
            << " s with open and checks\n";
  EXPECT_EQ(elements, 134515008);  // SmolLM2-135M; the output matrix is tied to token_embd.
}

}  // namespace
}  // namespace kvq::eval
