// A device error in the middle of a sequence's append (one stream's
// KernelBackend::Synchronize fails after others succeeded) leaves every
// stream of the sequence as it was: no layer holds tokens another lacks.
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/quant_spec.h"
#include "service/sequence.h"
#include "tests/service/store_test_data.h"

namespace kvq {
namespace {

// The cpu backend, enqueuing in name: its `fail_at`-th Synchronize from
// now (1: the next) answers an error.
class FailingSyncBackend final : public KernelBackend {
 public:
  absl::string_view name() const override { return "failing_sync"; }
  void QuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                    int row0) const override {
    CpuBackend().QuantizeRows(s, side, rows, n, page, row0);
  }
  void DequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                      float* out) const override {
    CpuBackend().DequantizeRows(s, side, page, row0, n, out);
  }
  bool enqueues() const override { return true; }
  absl::Status Synchronize() const override {
    if (countdown_ > 0 && --countdown_ == 0) return absl::InternalError("injected device fault");
    return absl::OkStatus();
  }
  absl::Status Attend(absl::Span<const AttentionTask> tasks,
                      const AttentionOptions& options) const override {
    return CpuBackend().Attend(tasks, options);
  }
  void FailAt(int n) { countdown_ = n; }

 private:
  mutable int countdown_ = 0;
};

constexpr int kLayers = 2, kHeads = 2, kDim = 64;

std::vector<float> Gaussian(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<int> Tokens(const Sequence& s) {
  std::vector<int> t;
  for (int l = 0; l < kLayers; ++l) {
    for (int h = 0; h < kHeads; ++h) t.push_back(s.stream(l, h).num_tokens());
  }
  return t;
}

TEST(SequenceDeviceErrorTest, AFailureHalfWayUndoesTheWholeAppend) {
  FailingSyncBackend backend;
  StreamConfig config;
  config.spec = *QuantSpec::Parse("kivi2");
  config.head_dim = kDim;
  absl::StatusOr<std::unique_ptr<Sequence>> seq = Sequence::Create(
      "", "s", GqaShape(kLayers, kHeads, kDim), config, {}, &backend, HeapPageAllocator());
  ASSERT_TRUE(seq.ok()) << seq.status();
  Sequence& s = **seq;
  // Tail-only appends (no page allocated), then one that flushes pages.
  for (int tokens : {10, 7, 300}) {
    const std::vector<float> k = Gaussian(static_cast<size_t>(kLayers) * kHeads * tokens * kDim,
                                          tokens);
    const std::vector<float> v = Gaussian(k.size(), tokens + 1);
    const DenseKv kv{0, kLayers, tokens, DType::kFloat32,
                     reinterpret_cast<const uint8_t*>(k.data()),
                     reinterpret_cast<const uint8_t*>(v.data())};
    const std::vector<int> before = Tokens(s);
    // The append first snapshots every stream (Fork, one Synchronize each),
    // then appends them in order: the third stream's append fails.
    backend.FailAt(kLayers * kHeads + 3);
    absl::Status st;
    {
      absl::MutexLock lock(&s.mu());
      st = s.AppendDense(kv);
    }
    EXPECT_EQ(st, absl::InternalError("injected device fault")) << tokens << " tokens";
    EXPECT_EQ(Tokens(s), before) << "a failed append of " << tokens << " tokens left a trace";
    backend.FailAt(0);
    absl::MutexLock lock(&s.mu());
    ASSERT_TRUE(s.AppendDense(kv).ok());
    EXPECT_EQ(Tokens(s), std::vector<int>(kLayers * kHeads, before[0] + tokens));
  }
}

}  // namespace
}  // namespace kvq
