// crq on the device (kernels/cuda/cuda_crq.h). Without a GPU: the
// launches refuse what the kernels do not take before enqueuing anything.
// With one: the cuda backend's crq pages equal cuda_host's byte for byte
// (both run crq_hd.h's CrqStoreRow, every float operation rounded on its
// own), and its coded-space attention is within 1e-4 of cuda_host's, the
// CPU twin of the split kernel, over the same rows.
#include "kernels/cuda/cuda_crq.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/device_info.h"
#include "kernels/kv_stream.h"
#include "kernels/page_layout.h"
#include "kernels/quant_spec.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

DeviceQuantSide CrqSide(int head_dim) {
  DeviceQuantSide side;
  side.layout = *PageLayout::Make(*QuantSpec::Parse("crq3:r0:pre_rope"), 64, 32);
  side.layout.head_dim = head_dim;  // What a launch would be handed.
  return side;
}

// A shape every check but the one under test passes.
DecodeAttentionShape CrqShape(int head_dim) {
  return {.num_tasks = 1, .head_dim = head_dim, .group_size = 4, .softmax_scale = 0.1f,
          .max_rows = 4, .max_keys = 1000, .sm_count = 132, .max_page_tokens = 32,
          .max_page_bytes = 4096};
}

TEST(CudaCrqLaunchTest, RefusesHeadDimsWithoutAKernel) {
  for (int d : {32, 96}) {
    const std::string want =
        absl::StrCat("head_dim must be 64, 128 or 256 for crq on the device, got ", d);
    const absl::Status q = LaunchCrqQuantizeRows(CrqSide(d), nullptr, {}, nullptr);
    EXPECT_EQ(q.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(q.message(), want);
    const absl::Status r =
        LaunchCrqDequantizeRows(CrqSide(d), DeviceRowType::kFloat32, nullptr, {}, nullptr);
    EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.message(), want);
    const absl::Status a = LaunchCrqAttention(nullptr, CrqShape(d), nullptr, nullptr, 0, nullptr);
    EXPECT_EQ(a.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(a.message(), want);
  }
}

TEST(CudaCrqLaunchTest, RefusesMissingCodebooksAndTensorCores) {
  const absl::Status q = LaunchCrqQuantizeRows(CrqSide(64), nullptr, {}, nullptr);
  EXPECT_EQ(q.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(q.message(), "codebooks is null");
  DecodeAttentionShape shape = CrqShape(128);
  shape.tensor_cores = true;
  alignas(16) float workspace[4] = {};
  const absl::Status a = LaunchCrqAttention(nullptr, shape, nullptr, workspace,
                                            DecodeAttentionWorkspaceBytes(shape), nullptr);
  EXPECT_EQ(a.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(a.message().find("tensor_cores false"), absl::string_view::npos) << a.message();
  const absl::Status w =
      LaunchCrqAttention(nullptr, CrqShape(128), nullptr, workspace, 16, nullptr);
  EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.message(), absl::StrCat("workspace must hold ",
                                      DecodeAttentionWorkspaceBytes(CrqShape(128)),
                                      " bytes, 16-byte aligned; got 16"));
}

struct DeviceCase {
  std::string spec;
  int head_dim;
};

class CudaCrqTest : public ::testing::TestWithParam<DeviceCase> {};

TEST_P(CudaCrqTest, PagesAndAttentionEqualCudaHost) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device: the crq kernels are not run";
  const int d = GetParam().head_dim, n = 300;
  testutil::StreamParam p;
  p.scheme.spec = GetParam().spec;
  p.scheme.head_dim = d;
  p.backend = "cuda";
  std::unique_ptr<KvStream> dev = testutil::MakeStream(p);
  p.backend = "cuda_host";
  std::unique_ptr<KvStream> host = testutil::MakeStream(p);
  ASSERT_TRUE(dev && host);
  const std::vector<float> k = testutil::MakeKeys(n, d, 31), v = testutil::MakeValues(n, d, 32);
  for (int t = 0; t < n; t += 37) {
    ASSERT_TRUE(testutil::AppendRows(*dev, k, v, t, std::min(n, t + 37)).ok());
    ASSERT_TRUE(testutil::AppendRows(*host, k, v, t, std::min(n, t + 37)).ok());
  }
  ASSERT_EQ(dev->quantized_tokens(), host->quantized_tokens());
  ASSERT_GT(dev->quantized_tokens(), 0);

  // Every coded row and gain, byte for byte.
  const PageLayout& L = dev->layout();
  for (int page = 0; page < dev->PagesFor(dev->quantized_tokens()); ++page) {
    const std::vector<uint8_t> a = testutil::PageBytes(*dev, page);
    const std::vector<uint8_t> b = testutil::PageBytes(*host, page);
    const int rows = std::min(L.page_tokens, dev->quantized_tokens() - page * L.page_tokens);
    for (Side side : {Side::kKey, Side::kValue}) {
      const SideLayout& S = L.side(side);
      for (int r = 0; r < rows; ++r) {
        const size_t code = PageLayout::CodeRow(a.data(), S, r) - a.data();
        ASSERT_TRUE(std::equal(a.begin() + code, a.begin() + code + S.code_row_bytes,
                               b.begin() + code))
            << "page " << page << " row " << r << (side == Side::kKey ? " keys" : " values");
        const size_t gain =
            reinterpret_cast<const uint8_t*>(PageLayout::Gain(a.data(), S, r)) - a.data();
        ASSERT_EQ(a[gain], b[gain]) << "gain, page " << page << " row " << r;
        ASSERT_EQ(a[gain + 1], b[gain + 1]) << "gain, page " << page << " row " << r;
      }
    }
  }

  // Attention: 3 queries x GQA 4, causal, over all of it.
  const int group = 4, queries = 3;
  const std::vector<float> q = testutil::MakeGaussian(static_cast<size_t>(queries) * group * d, 33);
  const std::vector<int32_t> positions = {n / 3, n / 2 + 5, n - 1};
  AttentionOptions options;
  options.group_size = group;
  auto attend = [&](const KvStream& s, std::vector<float>* out, std::vector<float>* lse) {
    out->assign(q.size(), 0.0f);
    lse->assign(static_cast<size_t>(queries) * group, 0.0f);
    AttentionTask t;
    t.stream = &s;
    t.num_queries = queries;
    t.q = q.data();
    t.q_stride = group * d;
    t.q_positions = positions.data();
    t.out = out->data();
    t.out_stride = group * d;
    t.lse = lse->data();
    t.lse_stride = group;
    return s.backend()->Attend({&t, 1}, options);
  };
  std::vector<float> out_dev, lse_dev, out_host, lse_host;
  ASSERT_TRUE(attend(*dev, &out_dev, &lse_dev).ok());
  ASSERT_TRUE(attend(*host, &out_host, &lse_host).ok());
  float scale = 0.0f;
  for (float x : out_host) scale = std::max(scale, std::fabs(x));
  for (size_t i = 0; i < out_dev.size(); ++i) {
    ASSERT_NEAR(out_dev[i], out_host[i], 1e-4 * scale) << "element " << i;
  }
  for (size_t i = 0; i < lse_dev.size(); ++i) {
    ASSERT_NEAR(lse_dev[i], lse_host[i], 1e-4 * std::max(1.0f, std::fabs(lse_host[i])))
        << "row " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaCrqTest,
    ::testing::Values(DeviceCase{"crq3:r0:pre_rope", 128},
                      DeviceCase{"crq2.5:r16:pre_rope:sink=4", 64},
                      DeviceCase{"crq4:v2:r32:pre_rope:sink=3", 256}),
    [](const auto& info) {
      std::string name = absl::StrCat("d", info.param.head_dim, "_", info.param.spec);
      for (char& c : name) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return name;
    });

}  // namespace
}  // namespace kvq
