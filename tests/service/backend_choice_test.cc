// --backend: what auto picks and why, and --backend=cuda refused at start
// where it cannot run; the --device_* flags' bounds.
#include "service/backend_choice.h"

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "gtest/gtest.h"
#include "service/server_config.h"

ABSL_DECLARE_FLAG(int64_t, device_capacity_bytes);
ABSL_DECLARE_FLAG(double, device_capacity_fraction);
ABSL_DECLARE_FLAG(int64_t, device_page_bytes);
ABSL_DECLARE_FLAG(int64_t, capacity_bytes);

namespace kvq {
namespace {

BackendFacts Facts(bool built, int devices, absl::Status backend = absl::OkStatus()) {
  BackendFacts f;
  f.cuda_built = built;
  f.cuda_devices = devices;
  f.cuda_backend = backend;
  return f;
}

TEST(BackendChoiceTest, AutoPicksCpuWithoutCudaAndSaysWhy) {
  absl::StatusOr<BackendChoice> c = ChooseBackend("auto", Facts(false, 0));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name, "cpu");
  EXPECT_EQ(c->reason,
            "--backend=auto: cpu, because this build has no CUDA backend (configure with nvcc on "
            "PATH and -DKVQ_WITH_CUDA=ON)");
  c = ChooseBackend("auto", Facts(true, 0));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name, "cpu");
  EXPECT_EQ(c->reason, "--backend=auto: cpu, because this process sees no CUDA device");
  c = ChooseBackend("auto", Facts(true, 1, absl::UnimplementedError("kernels missing")));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name, "cpu");
  EXPECT_EQ(c->reason,
            "--backend=auto: cpu, because the CUDA backend did not start: kernels missing");
}

TEST(BackendChoiceTest, AutoPicksCudaWithADevice) {
  absl::StatusOr<BackendChoice> c = ChooseBackend("auto", Facts(true, 2));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name, "cuda");
  EXPECT_EQ(c->reason, "--backend=auto: cuda (2 devices visible; pages in device memory)");
}

TEST(BackendChoiceTest, CudaWithoutADeviceIsFailedPreconditionNamingTheFlag) {
  EXPECT_EQ(ChooseBackend("cuda", Facts(true, 0)).status(),
            absl::FailedPreconditionError(
                "--backend=cuda: this process sees no CUDA device; use --backend=cpu or "
                "--backend=auto"));
  EXPECT_EQ(ChooseBackend("cuda", Facts(false, 0)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ChooseBackend("cuda", Facts(true, 1)).value().name, "cuda");
  EXPECT_EQ(ChooseBackend("cpu", Facts(true, 1)).value().name, "cpu");
  EXPECT_EQ(ChooseBackend("gpu", Facts(true, 1)).status(),
            absl::InvalidArgumentError("--backend=gpu: must be auto, cpu, ref or cuda"));
}

// This machine's own facts: whatever it has, auto must answer a backend
// that exists, and cuda must either run or say why not.
TEST(BackendChoiceTest, ProbedFactsGiveAUsableAnswer) {
  const BackendFacts f = ProbeBackends();
  absl::StatusOr<BackendChoice> c = ChooseBackend("auto", f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, f.cuda_built && f.cuda_devices > 0 && f.cuda_backend.ok() ? "cuda" : "cpu");
  if (f.cuda_devices == 0) {
    EXPECT_EQ(ChooseBackend("cuda", f).status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

class DeviceFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override { absl::SetFlag(&FLAGS_capacity_bytes, int64_t{16} << 20); }
  void TearDown() override {
    absl::SetFlag(&FLAGS_device_capacity_bytes, 0);
    absl::SetFlag(&FLAGS_device_capacity_fraction, 0.8);
    absl::SetFlag(&FLAGS_device_page_bytes, int64_t{128} << 10);
    absl::SetFlag(&FLAGS_capacity_bytes, 0);
  }
};

TEST_F(DeviceFlagsTest, DefaultsAreValid) {
  absl::StatusOr<ServerConfig> c = ConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device_pool.capacity_bytes, 0);
  EXPECT_EQ(c->device_pool.capacity_fraction, 0.8);
  EXPECT_EQ(c->device_pool.page_bytes, 128 << 10);
}

TEST_F(DeviceFlagsTest, BoundsAreNamed) {
  absl::SetFlag(&FLAGS_device_capacity_fraction, 0.99);
  EXPECT_EQ(ConfigFromFlags().status(),
            absl::InvalidArgumentError("--device_capacity_fraction=0.99: must be in (0, 0.95]"));
  absl::SetFlag(&FLAGS_device_capacity_fraction, 0.5);
  absl::SetFlag(&FLAGS_device_page_bytes, 100);
  EXPECT_EQ(ConfigFromFlags().status(),
            absl::InvalidArgumentError(
                "--device_page_bytes=100: must be a multiple of 64 in [64, 64 MiB]"));
  absl::SetFlag(&FLAGS_device_page_bytes, 4096);
  absl::SetFlag(&FLAGS_device_capacity_bytes, -1);
  EXPECT_EQ(ConfigFromFlags().status(),
            absl::InvalidArgumentError("--device_capacity_bytes=-1: must be >= 0"));
  absl::SetFlag(&FLAGS_device_capacity_bytes, 1000);
  EXPECT_EQ(ConfigFromFlags().status(),
            absl::InvalidArgumentError("--device_capacity_bytes=1000: must hold at least one "
                                       "page of --device_page_bytes=4096"));
  absl::SetFlag(&FLAGS_device_capacity_bytes, int64_t{1} << 30);
  absl::StatusOr<ServerConfig> c = ConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device_pool.capacity_bytes, int64_t{1} << 30);
  EXPECT_EQ(c->device_pool.page_bytes, 4096);
}

// Without the CUDA backend there is no device pool; with it but without a
// device, the pool says so.
TEST(DevicePagePoolFactoryTest, AnswersWhyItCannotBeMade) {
  const BackendFacts f = ProbeBackends();
  if (f.cuda_devices > 0) GTEST_SKIP() << "this machine has a CUDA device";
  EXPECT_EQ(MakeDevicePagePool({}, nullptr).status().code(),
            f.cuda_built ? absl::StatusCode::kFailedPrecondition
                         : absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace kvq
