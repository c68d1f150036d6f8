// Shared fixtures of the unit tests: the backend x scheme matrix, synthetic
// KV data, test allocators, a stream's dequantized contents and an fp64
// attention reference.
#ifndef KVQ_TESTS_UNIT_TEST_UTIL_H_
#define KVQ_TESTS_UNIT_TEST_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kernels/page_allocator.h"
#include "kernels/stream_config.h"

namespace kvq {
namespace testutil {

// A RoPE of `pairing` over the first `rotary_dim` channels (0: all), with
// the default theta.
RopeConfig MakeRope(RopeConfig::Pairing pairing, int rotary_dim = 0,
                    RopeConfig::Scaling scaling = RopeConfig::Scaling::kNone,
                    float factor = 1.0f);

// One storage scheme under test: a scheme string plus the stream shape.
struct SchemeCase {
  std::string spec;  // As written (not necessarily canonical).
  int head_dim = 128;
  RopeConfig rope;   // Used only by pre_rope schemes.
  std::string rope_label;  // Short tag of a non-default RoPE, for test names.

  StreamConfig Config() const;  // Aborts the test binary on an invalid spec.
  std::string Label() const;    // Identifier-safe name.
};

// How gtest (and so ctest's test list) prints a case: the scheme as
// written, the head_dim and the RoPE tag.
void PrintTo(const SchemeCase& c, std::ostream* os);

// Every scheme of the typed suites: the base names, the option variants and
// combinations.
const std::vector<SchemeCase>& AllSchemeCases();
// The backends every typed test runs on.
const std::vector<std::string>& BackendNames();

struct StreamParam {
  std::string backend;
  SchemeCase scheme;
  // Pages from SharedHiddenPages() (hidden_page_allocator.h), which the
  // host cannot address, where a test gives MakeStream no allocator.
  bool hidden_pages = false;
};
std::vector<StreamParam> AllStreamParams();
// cuda_host over hidden pages, every scheme: the stand-in for a device
// backend whose pages only it can address; only the schemes `keep` passes
// when given.
std::vector<StreamParam> HiddenPageStreamParams(bool (*keep)(const QuantSpec&) = nullptr);
// The backend x scheme pairs whose spec satisfies `keep`.
std::vector<StreamParam> StreamParamsWhere(bool (*keep)(const QuantSpec&));
std::string StreamParamName(const StreamParam& p);
void PrintTo(const StreamParam& p, std::ostream* os);

// The common start of the typed suites' fixtures: the case's stream config,
// its backend and head_dim. A subclass's SetUp runs this one first
// (ASSERT_NO_FATAL_FAILURE(StreamTest::SetUp())).
class StreamTest : public ::testing::TestWithParam<StreamParam> {
 protected:
  void SetUp() override {
    config_ = GetParam().scheme.Config();
    absl::StatusOr<const KernelBackend*> b = BackendByName(GetParam().backend);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *b;
    d_ = config_.head_dim;
  }

  StreamConfig config_;
  const KernelBackend* backend_ = nullptr;
  int d_ = 0;
};

// Synthetic K/V rows [n, d], deterministic in `seed`. Keys have a few large
// outlier channels with an offset (as real keys do); values are N(0, 1).
std::vector<float> MakeKeys(int n, int d, uint64_t seed);
std::vector<float> MakeValues(int n, int d, uint64_t seed);
// Skewed heavy-tailed rows for codebook tests: lognormal (sigma 0.5), the
// long tail pointing up in odd channels and down in even ones, so each
// channel's values crowd one end of their groups' range.
std::vector<float> MakeHeavyTailed(int n, int d, uint64_t seed);
// N(0, 1) floats.
std::vector<float> MakeGaussian(size_t count, uint64_t seed);

// A learned nuq codebook for `config` from calibration data whose seed
// differs from every seed the tests append (learned once per config).
Codebook LearnTestCodebook(const StreamConfig& config);

// A calibration for a crq stream of `config`: MomentCalibration of
// MakeKeys / MakeValues rows drawn with a seed no test appends.
HeadCalibration TestCalibration(const StreamConfig& config);

// The pages a stream of `p` gets where a test names no allocator:
// SharedHiddenPages() for hidden_pages, one device pool per test binary for
// "cuda" (the backend serves only device pages), else null (host memory).
PageAllocator* DefaultPages(const StreamParam& p);

// Creates a stream of `p` (learning a codebook for nuq, a calibration for
// crq) on `allocator`, or DefaultPages(p); fails the test on error.
std::unique_ptr<KvStream> MakeStream(const StreamParam& p, PageAllocator* allocator = nullptr);
absl::StatusOr<std::unique_ptr<KvStream>> TryMakeStream(const StreamConfig& config,
                                                        const KernelBackend* backend,
                                                        PageAllocator* allocator = nullptr);

// A stream of `config` on `backend` holding MakeKeys/MakeValues(tokens, d,
// seed), appended in uneven runs (7 rows first, then next_step(previous)
// rows each) so that the sink, the pages and the tail all get exercised;
// null, with a test failure, when it cannot be made.
std::unique_ptr<KvStream> UnevenlyFilledStream(const StreamConfig& config,
                                               const KernelBackend* backend, int tokens,
                                               uint64_t seed, int (*next_step)(int));

// Page `i` of `s` copied to the host through its allocator (pages may be
// where the host cannot address them: hidden_page_allocator.h).
std::vector<uint8_t> PageBytes(const KvStream& s, int i);

// Appends rows [begin, end) of k and v ([*, d] floats).
absl::Status AppendRows(KvStream& s, const std::vector<float>& k, const std::vector<float>& v,
                        int begin, int end);

// Tokens [begin, end) of one side as floats via Read().
std::vector<float> ReadSide(const KvStream& s, Side side, int begin, int end,
                            bool apply_rope = true);

// The value the quantizer of `s` sees for row `x` of `side` (the stored
// basis): rotated when the scheme rotates, fp16-rounded when the scheme
// passes through the fp16 tail or sink.
std::vector<float> StoredBasis(const KvStream& s, const float* x);

// Where token t of a stream lives.
enum class Place { kSink, kPage, kTail };
Place PlaceOf(const KvStream& s, int t);

// Allowed |stored - quantizer input| of element (t, c) of a page token, derived
// from the parameters stored in its page; 0 for outliers (then exact to fp16).
// `is_outlier` is set when the element is in its block's outlier table.
double ElementBound(const KvStream& s, Side side, int t, int c, float input, bool* is_outlier);

// An allocator that counts live bytes (Allocate minus Free) and checks that
// every Free matches an allocation; it can be told to fail after `budget`
// more successful allocations.
class TestAllocator final : public PageAllocator {
 public:
  ~TestAllocator() override;
  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override;
  void Retain(uint8_t* block, size_t bytes) override;
  void Free(uint8_t* block, size_t bytes) override;

  size_t live_bytes() const { return live_bytes_; }
  int live_blocks() const { return static_cast<int>(blocks_.size()); }
  int allocations() const { return allocations_; }
  // Allows `n` more allocations, then fails every one (n < 0: unlimited).
  void set_budget(int n) { budget_ = n; }
  // Frees that did not match a live block of the same size.
  int bad_frees() const { return bad_frees_; }

 private:
  std::map<uint8_t*, size_t> blocks_;
  std::map<uint8_t*, int> extra_refs_;  // References beyond the first.
  size_t live_bytes_ = 0;
  int allocations_ = 0;
  int budget_ = -1;
  int bad_frees_ = 0;
};

// fp64 softmax attention of one query row q[d] over keys/values rows
// [begin, end) of K and V ([*, d] floats); lse = -inf and zero output when
// the range is empty.
struct Attention64 {
  std::vector<double> out;
  double lse = 0.0;
};
Attention64 ReferenceAttention(const float* q, const float* keys, const float* values, int begin,
                               int end, int d, double scale);

// max |a - b| / max(max |b|, floor): a relative error over a whole row.
double RelativeError(const float* a, const std::vector<double>& b, double floor = 1e-6);

}  // namespace testutil
}  // namespace kvq

// Instantiates the TEST_P suite `fixture` (of StreamParam) over the backend x
// scheme pairs whose spec `keep` passes (named `prefix`/...) and over cuda_host
// on hidden pages for the same schemes (HiddenPages/...): the schemes a test
// applies to, on every backend, so that it never skips for its scheme.
#define KVQ_INSTANTIATE_STREAM_SUITES(prefix, fixture, keep)                         \
  INSTANTIATE_TEST_SUITE_P(                                                          \
      prefix, fixture, ::testing::ValuesIn(::kvq::testutil::StreamParamsWhere(keep)), \
      [](const auto& info) { return ::kvq::testutil::StreamParamName(info.param); }); \
  INSTANTIATE_TEST_SUITE_P(                                                          \
      HiddenPages, fixture, ::testing::ValuesIn(::kvq::testutil::HiddenPageStreamParams(keep)), \
      [](const auto& info) { return ::kvq::testutil::StreamParamName(info.param); })

#endif  // KVQ_TESTS_UNIT_TEST_UTIL_H_
