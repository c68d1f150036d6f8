// A device backend only enqueues its quantize and dequantize work and
// reports errors at KernelBackend::Synchronize(). These tests wrap a host
// backend in one whose Synchronize() fails on demand and check that the
// error fails the KvStream call that queued the work, with nothing of a
// failed append left stored and every page of it freed.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::TestAllocator;

// The cpu backend, with Synchronize() answering the injected error once.
class FaultInjectingBackend final : public KernelBackend {
 public:
  absl::string_view name() const override { return "fault_injecting"; }
  void QuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                    int row0) const override {
    ++queued_;
    CpuBackend().QuantizeRows(s, side, rows, n, page, row0);
  }
  void DequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                      float* out) const override {
    ++queued_;
    CpuBackend().DequantizeRows(s, side, page, row0, n, out);
  }
  bool enqueues() const override { return true; }
  absl::Status Synchronize() const override {
    ++syncs_;
    absl::Status st = std::move(pending_);
    pending_ = absl::OkStatus();
    return st;
  }
  absl::Status Attend(absl::Span<const AttentionTask> tasks,
                      const AttentionOptions& options) const override {
    return CpuBackend().Attend(tasks, options);
  }

  // The next Synchronize() fails with `st`.
  void FailNextSync(absl::Status st) { pending_ = std::move(st); }
  int queued() const { return queued_; }
  int syncs() const { return syncs_; }

 private:
  mutable absl::Status pending_;
  mutable int queued_ = 0;
  mutable int syncs_ = 0;
};

const absl::Status kDeviceFault = absl::InternalError("injected device fault");

class BackendSyncTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    config_ = testutil::SchemeCase{GetParam(), 64, {}, ""}.Config();
    absl::StatusOr<std::unique_ptr<KvStream>> s =
        testutil::TryMakeStream(config_, &backend_, &allocator_);
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = *std::move(s);
    flush_ = config_.spec.flush_tokens();
    n_ = config_.spec.sink + 4 * std::max(flush_, 16);
    k_ = testutil::MakeKeys(n_, 64, 5);
    v_ = testutil::MakeValues(n_, 64, 6);
  }

  // Every token of the stream, both sides, as floats.
  std::vector<float> Contents() {
    std::vector<float> k = testutil::ReadSide(*stream_, Side::kKey, 0, stream_->num_tokens());
    std::vector<float> v = testutil::ReadSide(*stream_, Side::kValue, 0, stream_->num_tokens());
    k.insert(k.end(), v.begin(), v.end());
    return k;
  }

  // Appends [begin, end) with the next Synchronize() failing: the append
  // fails with the device's status and the stream and allocator stay as
  // they were; the same append then succeeds.
  void ExpectFailedAppendUndone(int begin, int end, bool fp16_input) {
    const std::vector<float> before = Contents();
    const int tokens = stream_->num_tokens(), quantized = stream_->quantized_tokens();
    const size_t live = allocator_.live_bytes();
    const int d = 64;
    std::vector<uint16_t> kh(static_cast<size_t>(end - begin) * d), vh(kh.size());
    FloatToRow(&k_[static_cast<size_t>(begin) * d], (end - begin) * d, DType::kFloat16, kh.data());
    FloatToRow(&v_[static_cast<size_t>(begin) * d], (end - begin) * d, DType::kFloat16, vh.data());
    auto append = [&] {
      if (!fp16_input) return testutil::AppendRows(*stream_, k_, v_, begin, end);
      return stream_->Append({kh.data(), DType::kFloat16, end - begin, d, 0},
                             {vh.data(), DType::kFloat16, end - begin, d, 0});
    };
    backend_.FailNextSync(kDeviceFault);
    EXPECT_EQ(append(), kDeviceFault);
    EXPECT_EQ(stream_->num_tokens(), tokens);
    EXPECT_EQ(stream_->quantized_tokens(), quantized);
    EXPECT_EQ(allocator_.live_bytes(), live) << "pages of the failed append leaked";
    EXPECT_EQ(Contents(), before);
    const absl::Status st = append();
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(stream_->num_tokens(), tokens + end - begin);
  }

  FaultInjectingBackend backend_;
  TestAllocator allocator_;
  StreamConfig config_;
  std::unique_ptr<KvStream> stream_;
  int flush_ = 0, n_ = 0;
  std::vector<float> k_, v_;
};

TEST_P(BackendSyncTest, FailedAppendsAreUndone) {
  // Into an empty stream, then one token (the tail or a page row), then a
  // run that flushes a tail holding rows (KIVI) and fills pages.
  ExpectFailedAppendUndone(0, config_.spec.sink + flush_, /*fp16_input=*/false);
  ExpectFailedAppendUndone(config_.spec.sink + flush_, config_.spec.sink + flush_ + 1, false);
  ExpectFailedAppendUndone(config_.spec.sink + flush_ + 1, n_ - flush_, false);
  EXPECT_GT(backend_.queued(), 0);
}

TEST_P(BackendSyncTest, FailedBlockCheckedAppendIsUndone) {
  // Whole flush blocks of contiguous fp16 onto an empty tail: the path that
  // checks and quantizes block by block.
  const int start = config_.spec.sink + flush_;
  ASSERT_TRUE(testutil::AppendRows(*stream_, k_, v_, 0, start).ok());
  ExpectFailedAppendUndone(start, start + 2 * flush_, /*fp16_input=*/true);
}

TEST_P(BackendSyncTest, ReadForkAndAppendPagesReportTheDeviceError) {
  ASSERT_TRUE(testutil::AppendRows(*stream_, k_, v_, 0, n_).ok());
  const int n = stream_->num_tokens();
  std::vector<float> k(static_cast<size_t>(n) * 64);
  backend_.FailNextSync(kDeviceFault);
  EXPECT_EQ(stream_->Read(0, n, {}, Floats(k.data(), n, 64), {}), kDeviceFault);

  const size_t live = allocator_.live_bytes();
  backend_.FailNextSync(kDeviceFault);
  EXPECT_EQ(stream_->Fork(n).status(), kDeviceFault);
  EXPECT_EQ(allocator_.live_bytes(), live) << "a failed fork keeps nothing";

  if (config_.spec.kind == SchemeKind::kFp8E4m3) return;
  std::unique_ptr<KvStream> dst = *testutil::TryMakeStream(config_, &backend_, &allocator_);
  ASSERT_TRUE(testutil::AppendRows(*dst, k_, v_, 0, config_.spec.sink).ok());
  const int q = stream_->quantized_tokens() / flush_ * flush_;
  std::vector<uint8_t> pages(static_cast<size_t>(stream_->PagesFor(q)) *
                             stream_->layout().page_bytes);
  ASSERT_TRUE(stream_->CopyPages(0, q, pages.data()).ok());
  const size_t live_before = allocator_.live_bytes();
  backend_.FailNextSync(kDeviceFault);
  EXPECT_EQ(dst->AppendPages(pages.data(), q), kDeviceFault);
  EXPECT_EQ(dst->num_tokens(), config_.spec.sink);
  EXPECT_EQ(allocator_.live_bytes(), live_before);
  ASSERT_TRUE(dst->AppendPages(pages.data(), q).ok());
  EXPECT_EQ(testutil::ReadSide(*dst, Side::kValue, 0, dst->num_tokens()),
            testutil::ReadSide(*stream_, Side::kValue, 0, dst->num_tokens()));
}

INSTANTIATE_TEST_SUITE_P(Schemes, BackendSyncTest,
                         ::testing::Values("kivi2", "kivi4:v2:sink=4", "int8", "fp16",
                                           "kivi3:g16:r32:p8:outliers=1"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace kvq
