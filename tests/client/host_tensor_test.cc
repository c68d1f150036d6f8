// HostTensor conversions: bit-exact fp16/bf16, wire form, validation.
#include "client/host_tensor.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "client/sequence_config.h"
#include "gtest/gtest.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

bool HalfIsNan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool Bf16IsNan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; }

std::vector<uint16_t> AllBitPatterns() {
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  return all;
}

TEST(HostTensorTest, EveryFp16ValueRoundTripsBitExactly) {
  const std::vector<uint16_t> all = AllBitPatterns();
  absl::StatusOr<HostTensor> t = HostTensor::FromFp16Bits(all, {256, 256});
  ASSERT_TRUE(t.ok()) << t.status();
  const std::vector<float> f = t->ToFloats();
  absl::StatusOr<HostTensor> back = HostTensor::FromFloats(f, {256, 256}, DType::kFloat16);
  ASSERT_TRUE(back.ok());
  const std::vector<uint16_t> bits = back->ToFp16Bits();
  int mismatches = 0;
  for (int i = 0; i < 65536; ++i) {
    if (HalfIsNan(all[i])) {
      EXPECT_TRUE(std::isnan(f[i])) << i;
      EXPECT_TRUE(HalfIsNan(bits[i])) << i;
    } else {
      mismatches += bits[i] != all[i];
      EXPECT_EQ(FloatBits(f[i]), FloatBits(HalfToFloat(all[i]))) << i;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(HostTensorTest, EveryBf16ValueRoundTripsBitExactly) {
  const std::vector<uint16_t> all = AllBitPatterns();
  absl::StatusOr<HostTensor> t = HostTensor::FromBf16Bits(all, {65536});
  ASSERT_TRUE(t.ok()) << t.status();
  const std::vector<float> f = t->ToFloats();
  const std::vector<uint16_t> bits = t->Cast(DType::kFloat32).ToBf16Bits();
  int mismatches = 0;
  for (int i = 0; i < 65536; ++i) {
    EXPECT_EQ(FloatBits(f[i]), static_cast<uint32_t>(all[i]) << 16) << i;
    if (Bf16IsNan(all[i])) {
      EXPECT_TRUE(Bf16IsNan(bits[i])) << i;
    } else {
      mismatches += bits[i] != all[i];
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(HostTensorTest, RoundsToNearestEven) {
  const float one_plus_half_ulp16 = 1.0f + std::ldexp(1.0f, -11);     // Tie: down to even.
  const float one_plus_3half_ulp16 = 1.0f + 3 * std::ldexp(1.0f, -11);  // Tie: up to even.
  const float one_plus_half_ulp_bf16 = 1.0f + std::ldexp(1.0f, -8);
  const float one_plus_3half_ulp_bf16 = 1.0f + 3 * std::ldexp(1.0f, -8);
  absl::StatusOr<HostTensor> h = HostTensor::FromFloats(
      {one_plus_half_ulp16, one_plus_3half_ulp16, 65520.0f, 65519.0f, std::ldexp(1.0f, -24),
       -0.0f},
      {6}, DType::kFloat16);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->ToFp16Bits(), (std::vector<uint16_t>{0x3c00, 0x3c02, 0x7c00, 0x7bff, 0x0001, 0x8000}));
  absl::StatusOr<HostTensor> b = HostTensor::FromFloats(
      {one_plus_half_ulp_bf16, one_plus_3half_ulp_bf16, -2.0f}, {3}, DType::kBFloat16);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ToBf16Bits(), (std::vector<uint16_t>{0x3f80, 0x3f82, 0xc000}));
}

TEST(HostTensorTest, MatchesTheKernelsConversionsOnRandomFloats) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> values(4096);
  for (float& v : values) {
    do {
      v = BitsToFloat(bits(rng));
    } while (std::isnan(v));
  }
  absl::StatusOr<HostTensor> h = HostTensor::FromFloats(values, {64, 64}, DType::kFloat16);
  absl::StatusOr<HostTensor> b = HostTensor::FromFloats(values, {64, 64}, DType::kBFloat16);
  ASSERT_TRUE(h.ok() && b.ok());
  const std::vector<uint16_t> hb = h->ToFp16Bits(), bb = b->ToBf16Bits();
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(hb[i], FloatToHalf(values[i])) << values[i];
    EXPECT_EQ(bb[i], FloatToBf16(values[i])) << values[i];
  }
}

TEST(HostTensorTest, CastBetweenHalfTypesGoesThroughFloat) {
  // fp16 0x3555 (0.333251953125) is bf16 0x3eaa after rounding.
  absl::StatusOr<HostTensor> h = HostTensor::FromFp16Bits({0x3555}, {1});
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->ToBf16Bits(), (std::vector<uint16_t>{FloatToBf16(HalfToFloat(0x3555))}));
  EXPECT_EQ(h->Cast(DType::kBFloat16).dtype, DType::kBFloat16);
  EXPECT_EQ(h->Cast(DType::kFloat16), *h);
}

TEST(HostTensorTest, ShapeMustMatchTheValues) {
  EXPECT_EQ(HostTensor::FromFloats({1, 2, 3}, {2, 2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostTensor::FromFloats({}, {-1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostTensor::FromFp16Bits({1}, {2}).status().code(), absl::StatusCode::kInvalidArgument);
  HostTensor t = HostTensor::Zeros(DType::kFloat32, {2, 3});
  EXPECT_TRUE(t.Validate().ok());
  t.data.pop_back();
  EXPECT_EQ(t.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// Tensors of 2 MiB and more take the huge-page path: still exactly the
// requested bytes, all zero, at any size (here 6,000,006 bytes).
TEST(HostTensorTest, LargeZerosAreExactAndZero) {
  const HostTensor t = HostTensor::Zeros(DType::kFloat16, {3, 1000001});
  ASSERT_EQ(t.data.size(), size_t{6000006});
  EXPECT_TRUE(t.Validate().ok());
  EXPECT_EQ(t.data.find_first_not_of('\0'), std::string::npos);
}

TEST(HostTensorTest, ProtoRoundTripKeepsDtypeShapeAndBytes) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    absl::StatusOr<HostTensor> t =
        HostTensor::FromFloats({1.5f, -2.25f, 3.0f, 0.0f, 7.0f, -1.0f}, {1, 2, 3}, dtype);
    ASSERT_TRUE(t.ok());
    v1::Tensor wire;
    ToProto(*t, &wire);
    EXPECT_EQ(wire.dtype(), ToProtoDType(dtype));
    EXPECT_EQ(wire.shape_size(), 3);
    EXPECT_EQ(wire.data().size(), 6 * DTypeBytes(dtype));
    absl::StatusOr<HostTensor> back = FromProto(wire);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, *t);
    HostTensor moved = *t;
    v1::Tensor wire2;
    ToProto(std::move(moved), &wire2);
    absl::StatusOr<HostTensor> back2 = FromProto(std::move(wire2));
    ASSERT_TRUE(back2.ok());
    EXPECT_EQ(*back2, *t);
  }
}

TEST(HostTensorTest, FromProtoRejectsMalformedTensors) {
  v1::Tensor t;
  t.add_shape(2);
  t.set_data(std::string(8, '\0'));
  absl::StatusOr<HostTensor> unspecified = FromProto(t, "q");
  EXPECT_EQ(unspecified.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unspecified.status().message().find("q."), absl::string_view::npos)
      << unspecified.status();
  t.set_dtype(v1::DTYPE_FP16);  // 2 fp16 elements are 4 bytes, not 8.
  absl::StatusOr<HostTensor> sized = FromProto(t, "q");
  EXPECT_EQ(sized.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(sized.status().message().find("needs 4 bytes, has 8"), absl::string_view::npos)
      << sized.status();
}

TEST(SequenceConfigTest, RopeAndLayoutSurviveTheWire) {
  ModelLayout m{4, 2, 8, 64, {}};
  m.rope.theta = 500000.0f;
  m.rope.rotary_dim = 32;
  m.rope.pairing = RopeConfig::Pairing::kAdjacent;
  m.rope.scaling = RopeConfig::Scaling::kNtk;
  m.rope.factor = 4.0f;
  v1::ModelLayout wire;
  ToProto(m, &wire);
  const ModelLayout back = FromProto(wire);
  EXPECT_EQ(back.num_layers, 4);
  EXPECT_EQ(back.num_kv_heads, 2);
  EXPECT_EQ(back.num_q_heads, 8);
  EXPECT_EQ(back.head_dim, 64);
  EXPECT_EQ(back.rope, m.rope);
  // Zero means default on the wire.
  const RopeConfig defaults = FromProto(v1::RopeParams());
  EXPECT_EQ(defaults, RopeConfig());
}

TEST(SequenceConfigTest, ToStreamConfigChecksSchemeAndCodebooks) {
  SequenceConfig c;
  c.layout = {2, 2, 2, 64, {}};
  c.scheme = "kivi2:g32:r128:sink=4";
  absl::StatusOr<StreamConfig> ok = c.ToStreamConfig();
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->spec.sink, 4);
  EXPECT_EQ(ok->head_dim, 64);
  c.scheme = "kivi5";
  EXPECT_EQ(c.ToStreamConfig().status().code(), absl::StatusCode::kInvalidArgument);
  c.scheme = "kivi2:nuq";
  EXPECT_EQ(c.ToStreamConfig().status().code(), absl::StatusCode::kInvalidArgument);
  c.codebooks.assign(4, Codebook::Uniform(2, 64));
  EXPECT_TRUE(c.ToStreamConfig().ok());
}

}  // namespace
}  // namespace kvq
