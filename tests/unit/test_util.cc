#include "tests/unit/test_util.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/codebook_learner.h"
#include "kernels/crq_transform.h"
#include "kernels/cpu/range_fit.h"
#include "kernels/group_params.h"
#include "kernels/numeric.h"
#include "tests/unit/hidden_page_allocator.h"
#if KVQ_HAVE_CUDA
#include "kernels/cuda/device_page_pool.h"
#endif

namespace kvq {
namespace testutil {
namespace {

// Calibration data for nuq codebooks uses its own seed, never used to append.
constexpr uint64_t kCalibrationSeed = 0xca1b;

}  // namespace

RopeConfig MakeRope(RopeConfig::Pairing pairing, int rotary_dim, RopeConfig::Scaling scaling,
                    float factor) {
  RopeConfig r;
  r.pairing = pairing;
  r.rotary_dim = rotary_dim;
  r.scaling = scaling;
  r.factor = factor;
  return r;
}

StreamConfig SchemeCase::Config() const {
  absl::StatusOr<QuantSpec> parsed = QuantSpec::Parse(spec);
  if (!parsed.ok()) {
    std::fprintf(stderr, "bad scheme case %s: %s\n", spec.c_str(),
                 std::string(parsed.status().message()).c_str());
    std::abort();
  }
  StreamConfig c;
  c.spec = *parsed;
  c.head_dim = head_dim;
  c.rope = rope;
  return c;
}

std::string SchemeCase::Label() const {
  std::string out;
  for (char ch : spec) out += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  absl::StrAppend(&out, "_d", head_dim);
  if (!rope_label.empty()) absl::StrAppend(&out, "_", rope_label);
  return out;
}

const std::vector<SchemeCase>& AllSchemeCases() {
  using P = RopeConfig::Pairing;
  using S = RopeConfig::Scaling;
  static const auto* cases = new std::vector<SchemeCase>{
      {"fp16", 128, {}, ""},
      {"fp16", 64, {}, ""},
      {"bf16", 64, {}, ""},
      {"int8", 128, {}, ""},
      {"fp8_e4m3", 64, {}, ""},
      {"kivi4", 128, {}, ""},
      {"kivi3", 64, {}, ""},
      {"kivi2", 128, {}, ""},
      {"kivi2", 64, {}, ""},
      {"kivi2:ktok", 64, {}, ""},
      // pre_rope in both pairings, a partial rotary_dim and both scalings.
      {"kivi4:pre_rope", 128, MakeRope(P::kHalfSplit, 0), "half"},
      {"kivi2:pre_rope", 64, MakeRope(P::kAdjacent, 32), "adj_rot32"},
      {"kivi3:pre_rope", 128, MakeRope(P::kHalfSplit, 96, S::kLinear, 2.0f), "half_rot96_lin2"},
      {"kivi4:pre_rope", 64, MakeRope(P::kAdjacent, 0, S::kNtk, 4.0f), "adj_ntk4"},
      {"kivi4:outliers=1", 64, {}, ""},
      {"kivi2:sink=4", 128, {}, ""},
      {"kivi4:nuq", 64, {}, ""},
      {"kivi2:nuq", 128, {}, ""},
      {"kivi2:rotate", 64, {}, ""},
      {"kivi4:rotate", 128, {}, ""},
      {"kivi2:r0", 64, {}, ""},
      {"kivi4:g64", 64, {}, ""},
      {"kivi2:g64:r64", 128, {}, ""},
      {"kivi2:g32:r128:pre_rope:outliers=1:sink=4", 128, MakeRope(P::kHalfSplit, 0), "half"},
      {"kivi3:g16:r32:outliers=2:sink=4:nuq:rotate:ktok", 64, {}, ""},
      // 8-bit group parameters: the fast paths (4 and 2 bits, per-channel
      // keys) and the generic ones (pre_rope, outliers, nuq, per-token keys).
      {"kivi4:p8", 128, {}, ""},
      {"kivi2:g128:r128:p8:sink=4", 64, {}, ""},
      {"kivi3:g16:r32:p8:pre_rope:outliers=1:sink=4", 64, MakeRope(P::kHalfSplit, 0), "half"},
      {"kivi2:g16:r16:p8:nuq:ktok", 128, {}, ""},
      // A flush (16 tokens) smaller than a page (32): pages fill in parts.
      {"kivi4:g16:r16", 128, {}, ""},
      // Keys and values at different bits (vN): both fast paths with
      // different code widths, outlier corrections per side, the generic
      // pre_rope key path beside fast 3-bit values, per-token keys.
      {"kivi4:v2", 128, {}, ""},
      {"kivi2:v4:outliers=1", 64, {}, ""},
      {"kivi4:v3:g64:r64:p8:pre_rope:sink=4", 64, MakeRope(P::kHalfSplit, 0), "half"},
      {"kivi3:v2:ktok", 64, {}, ""},
      // Fitted key ranges (fit): alone, per-token keys, and with the
      // options whose ranges it narrows (outliers leave the range first).
      {"kivi2:fit", 64, {}, ""},
      {"kivi3:v4:fit:ktok", 128, {}, ""},
      {"kivi2:g16:r32:fit:p8:pre_rope:outliers=1:sink=4", 64, MakeRope(P::kHalfSplit, 0), "half"},
      // nuq keys per channel with RoPE in attention: levels picked in lanes.
      {"kivi3:g16:r32:p8:pre_rope:nuq", 64, MakeRope(P::kAdjacent, 0), "adj"},
      // pre_rope keys with outliers, rotated in the dequantizing pass: both
      // pairings, channels beyond a partial rotary_dim.
      {"kivi4:pre_rope:outliers=2", 64, MakeRope(P::kAdjacent, 32), "adj_rot32"},
      {"kivi2:g16:r32:pre_rope:outliers=2", 128, MakeRope(P::kHalfSplit, 96), "half_rot96"},
  };
  return *cases;
}

const std::vector<std::string>& BackendNames() {
  // "cuda" where this build has it and a device is present: every typed
  // suite then runs on the device too (scripts/gpu_check.sh runs them).
  static const auto* names = [] {
    auto* n = new std::vector<std::string>{"ref", "cpu", "cuda_host"};
    if (BackendByName("cuda").ok()) n->push_back("cuda");
    return n;
  }();
  return *names;
}

std::vector<StreamParam> AllStreamParams() {
  std::vector<StreamParam> out;
  for (const std::string& b : BackendNames()) {
    for (const SchemeCase& s : AllSchemeCases()) out.push_back({b, s});
  }
  return out;
}

std::vector<StreamParam> HiddenPageStreamParams(bool (*keep)(const QuantSpec&)) {
  std::vector<StreamParam> out;
  for (const SchemeCase& s : AllSchemeCases()) {
    if (keep == nullptr || keep(s.Config().spec)) out.push_back({"cuda_host", s, true});
  }
  return out;
}

std::vector<StreamParam> StreamParamsWhere(bool (*keep)(const QuantSpec&)) {
  std::vector<StreamParam> out;
  for (const StreamParam& p : AllStreamParams()) {
    if (keep(p.scheme.Config().spec)) out.push_back(p);
  }
  return out;
}

std::string StreamParamName(const StreamParam& p) {
  return absl::StrCat(p.backend, "_", p.scheme.Label());
}

void PrintTo(const SchemeCase& c, std::ostream* os) {
  *os << c.spec << " head_dim=" << c.head_dim;
  if (!c.rope_label.empty()) *os << " rope=" << c.rope_label;
}

void PrintTo(const StreamParam& p, std::ostream* os) {
  *os << p.backend << " ";
  PrintTo(p.scheme, os);
  if (p.hidden_pages) *os << " hidden pages";
}

std::vector<float> MakeGaussian(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> out(count);
  for (float& x : out) x = normal(rng);
  return out;
}

std::vector<float> MakeKeys(int n, int d, uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x6b657973u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Channel statistics are fixed (seed-independent) like a model's; tokens vary.
  std::mt19937_64 channel_rng(0x5eed);
  std::normal_distribution<float> channel_normal(0.0f, 1.0f);
  std::vector<float> mean(d), spread(d);
  for (int c = 0; c < d; ++c) {
    mean[c] = 0.5f * channel_normal(channel_rng);
    spread[c] = 1.0f;
  }
  for (int c : {3, d / 3, d / 2 + 1, d - 5}) {  // Outlier channels.
    mean[c] = 3.0f;
    spread[c] = 4.0f;
  }
  std::vector<float> out(static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t) {
    for (int c = 0; c < d; ++c) out[static_cast<size_t>(t) * d + c] = mean[c] + spread[c] * normal(rng);
  }
  return out;
}

std::vector<float> MakeValues(int n, int d, uint64_t seed) {
  return MakeGaussian(static_cast<size_t>(n) * d, seed ^ 0x76616c73u);
}

std::vector<float> MakeHeavyTailed(int n, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> out(static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t) {
    for (int c = 0; c < d; ++c) {
      const float sign = c % 2 ? 1.0f : -1.0f;
      out[static_cast<size_t>(t) * d + c] = sign * std::exp(0.5f * normal(rng));
    }
  }
  return out;
}

Codebook LearnTestCodebook(const StreamConfig& config) {
  static auto* cache = new std::map<std::string, Codebook>();
  const std::string key = absl::StrCat(config.spec.ToString(), "/", config.head_dim, "/",
                                       config.rotation_seed);
  if (auto it = cache->find(key); it != cache->end()) return it->second;
  const int n = 512;
  const int d = config.head_dim;
  std::vector<float> k = MakeKeys(n, d, kCalibrationSeed);
  std::vector<float> v = MakeValues(n, d, kCalibrationSeed);
  absl::StatusOr<Codebook> cb = LearnCodebook(config, Floats(k.data(), n, d), Floats(v.data(), n, d));
  if (!cb.ok()) {
    std::fprintf(stderr, "LearnCodebook failed: %s\n", std::string(cb.status().message()).c_str());
    std::abort();
  }
  return cache->emplace(key, *std::move(cb)).first->second;
}

HeadCalibration TestCalibration(const StreamConfig& config) {
  const int n = 512;
  const int d = config.head_dim;
  const std::vector<float> k = MakeKeys(n, d, kCalibrationSeed);
  const std::vector<float> v = MakeValues(n, d, kCalibrationSeed);
  absl::StatusOr<HeadCalibration> cal =
      MomentCalibration(config, Floats(k.data(), n, d), Floats(v.data(), n, d));
  if (!cal.ok()) {
    std::fprintf(stderr, "MomentCalibration failed: %s\n", std::string(cal.status().message()).c_str());
    std::abort();
  }
  return *std::move(cal);
}

absl::StatusOr<std::unique_ptr<KvStream>> TryMakeStream(const StreamConfig& config,
                                                        const KernelBackend* backend,
                                                        PageAllocator* allocator) {
  if (config.spec.is_crq()) {
    const HeadCalibration cal = TestCalibration(config);
    return KvStream::Create(config, backend, allocator, nullptr, &cal);
  }
  if (config.spec.nuq) {
    const Codebook cb = LearnTestCodebook(config);
    return KvStream::Create(config, backend, allocator, &cb);
  }
  return KvStream::Create(config, backend, allocator);
}

std::unique_ptr<KvStream> UnevenlyFilledStream(const StreamConfig& config,
                                               const KernelBackend* backend, int tokens,
                                               uint64_t seed, int (*next_step)(int)) {
  absl::StatusOr<std::unique_ptr<KvStream>> s = TryMakeStream(config, backend);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  const int d = config.head_dim;
  const std::vector<float> k = MakeKeys(tokens, d, seed);
  const std::vector<float> v = MakeValues(tokens, d, seed);
  int t = 0, step = 7;
  while (t < tokens) {
    const int n = std::min(step, tokens - t);
    EXPECT_TRUE(AppendRows(**s, k, v, t, t + n).ok());
    t += n;
    step = next_step(step);
  }
  return *std::move(s);
}

// The pages of "cuda" streams: one device pool for the whole test binary
// (the backend serves only streams whose pages are device memory).
PageAllocator* SharedDevicePages() {
#if KVQ_HAVE_CUDA
  static PageAllocator* pool = [] () -> PageAllocator* {
    DevicePagePoolOptions o;
    o.capacity_bytes = size_t{1} << 30;
    o.page_bytes = size_t{256} << 10;
    absl::StatusOr<std::unique_ptr<DevicePagePool>> p = DevicePagePool::Create(o);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->release() : nullptr;
  }();
  return pool;
#else
  return nullptr;
#endif
}

PageAllocator* DefaultPages(const StreamParam& p) {
  if (p.hidden_pages) return SharedHiddenPages();
  return p.backend == "cuda" ? SharedDevicePages() : nullptr;
}

std::unique_ptr<KvStream> MakeStream(const StreamParam& p, PageAllocator* allocator) {
  absl::StatusOr<const KernelBackend*> backend = BackendByName(p.backend);
  EXPECT_TRUE(backend.ok()) << backend.status();
  if (!backend.ok()) return nullptr;
  if (allocator == nullptr) allocator = DefaultPages(p);
  absl::StatusOr<std::unique_ptr<KvStream>> s = TryMakeStream(p.scheme.Config(), *backend, allocator);
  EXPECT_TRUE(s.ok()) << "creating " << p.scheme.spec << ": " << s.status();
  if (!s.ok()) return nullptr;
  return *std::move(s);
}

std::vector<uint8_t> PageBytes(const KvStream& s, int i) {
  std::vector<uint8_t> out(s.layout().page_bytes);
  const absl::Status st = s.allocator()->ReadBlock(s.page(i), 0, out.size(), out.data());
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

absl::Status AppendRows(KvStream& s, const std::vector<float>& k, const std::vector<float>& v,
                        int begin, int end) {
  const int d = s.head_dim();
  return s.Append(Floats(k.data() + static_cast<size_t>(begin) * d, end - begin, d),
                  Floats(v.data() + static_cast<size_t>(begin) * d, end - begin, d));
}

std::vector<float> ReadSide(const KvStream& s, Side side, int begin, int end, bool apply_rope) {
  const int d = s.head_dim();
  std::vector<float> out(static_cast<size_t>(end - begin) * d);
  ReadOptions options;
  options.apply_rope = apply_rope;
  TensorView view = Floats(out.data(), end - begin, d);
  const absl::Status st = side == Side::kKey ? s.Read(begin, end, options, view, TensorView{})
                                             : s.Read(begin, end, options, TensorView{}, view);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

std::vector<float> StoredBasis(const KvStream& s, const float* x) {
  std::vector<float> out(x, x + s.head_dim());
  if (s.rotation()) s.rotation()->Forward(out.data());
  if (s.spec().is_kivi()) {
    for (float& e : out) e = RoundToHalf(e);
  }
  return out;
}

Place PlaceOf(const KvStream& s, int t) {
  if (t < s.sink_tokens()) return Place::kSink;
  if (t - s.page_base() < s.quantized_tokens()) return Place::kPage;
  return Place::kTail;
}

double ElementBound(const KvStream& s, Side side, int t, int c, float input, bool* is_outlier) {
  const PageLayout& L = s.layout();
  const SideLayout& S = L.side(side);
  const int d = L.head_dim;
  const int u = t - s.page_base();
  const std::vector<uint8_t> bytes = PageBytes(s, u / L.page_tokens);
  const uint8_t* page = bytes.data();
  const int row = u % L.page_tokens;
  *is_outlier = false;
  if (L.outliers_per_block > 0) {
    const int g = L.block_tokens;
    const uint16_t* table = L.Outliers(page, S, row / g);
    const int index = (row % g) * d + c;
    for (int e = 0; e < L.outliers_per_block; ++e) {
      if (table[e] == index) {
        *is_outlier = true;
        return 0.0;
      }
    }
  }
  const double x = std::fabs(static_cast<double>(input));
  switch (S.format) {
    case CodeFormat::kFp16:
      return x * std::ldexp(1.0, -11) + std::ldexp(1.0, -25);
    case CodeFormat::kBf16:
      return x * std::ldexp(1.0, -8) + std::ldexp(1.0, -133);
    case CodeFormat::kFp8E4m3: {
      // Half an ulp of a 3-bit mantissa, or half the subnormal step.
      const double scale = s.fp8_scale(side);
      return (x * std::ldexp(1.0, -4) + scale * std::ldexp(1.0, -10)) * (1.0 + 1e-6);
    }
    case CodeFormat::kInt8:
    case CodeFormat::kPacked:
      break;
  }
  const bool channels = S.axis == ParamAxis::kChannelGroups;
  const int np = L.ParamsPerEntry(S);
  std::vector<float> params(2 * np);
  LoadGroupParams(L, S, page, channels ? row / L.block_tokens : row, 1, params.data());
  const int k = channels ? c : c / S.group_channels;
  const double scale = params[k];
  const double zero = params[np + k];
  double step = scale;
  double top = (1 << S.bits) - 1;
  if (s.spec().nuq) {
    const uint16_t* lv = s.levels(side, c);
    double gap = 0.0;
    for (int i = 1; i < (1 << S.bits); ++i) {
      gap = std::max(gap, static_cast<double>(HalfToFloat(lv[i]) - HalfToFloat(lv[i - 1])));
    }
    step = scale * gap;
    top = 1.0;
  }
  // Half a step, plus the fp16 rounding of zero and of scale (times the top
  // code), plus float arithmetic.
  const double span = std::fabs(zero) + scale * top;
  // A fitted key range may leave the rare far element outside: it clips to
  // the nearest end, so its error is its distance to the range on top.
  double clipped = 0.0;
  if (FitsRanges(s.spec(), side)) {
    clipped = std::max({0.0, zero - input, input - (zero + scale * top)});
  }
  return clipped + step / 2.0 + std::ldexp(span, -10) + 1e-6 * (1.0 + span);
}

TestAllocator::~TestAllocator() {
  for (auto& [p, bytes] : blocks_) std::free(p);
}

absl::StatusOr<uint8_t*> TestAllocator::Allocate(size_t bytes) {
  if (budget_ == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("test allocator: budget spent (", bytes,
                                                     " bytes asked)"));
  }
  if (budget_ > 0) --budget_;
  const size_t rounded = std::max<size_t>(kPageAlign, (bytes + kPageAlign - 1) / kPageAlign * kPageAlign);
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kPageAlign, rounded));
  // Poison: the stream must initialise what it reads.
  std::fill(p, p + rounded, uint8_t{0xa5});
  blocks_[p] = bytes;
  live_bytes_ += bytes;
  ++allocations_;
  return p;
}

void TestAllocator::Retain(uint8_t* block, size_t bytes) {
  auto it = blocks_.find(block);
  if (it == blocks_.end() || it->second != bytes) {
    ++bad_frees_;
    return;
  }
  ++extra_refs_[block];
}

void TestAllocator::Free(uint8_t* block, size_t bytes) {
  auto it = blocks_.find(block);
  if (it == blocks_.end() || it->second != bytes) {
    ++bad_frees_;
    return;
  }
  if (auto ref = extra_refs_.find(block); ref != extra_refs_.end()) {
    if (--ref->second == 0) extra_refs_.erase(ref);
    return;
  }
  live_bytes_ -= bytes;
  blocks_.erase(it);
  std::free(block);
}

Attention64 ReferenceAttention(const float* q, const float* keys, const float* values, int begin,
                               int end, int d, double scale) {
  Attention64 r;
  r.out.assign(d, 0.0);
  if (end <= begin) {
    r.lse = -std::numeric_limits<double>::infinity();
    return r;
  }
  std::vector<double> scores(end - begin);
  double mx = -std::numeric_limits<double>::infinity();
  for (int t = begin; t < end; ++t) {
    double dot = 0.0;
    for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * keys[static_cast<size_t>(t) * d + c];
    scores[t - begin] = dot * scale;
    mx = std::max(mx, scores[t - begin]);
  }
  double sum = 0.0;
  for (int t = begin; t < end; ++t) {
    const double p = std::exp(scores[t - begin] - mx);
    sum += p;
    for (int c = 0; c < d; ++c) r.out[c] += p * values[static_cast<size_t>(t) * d + c];
  }
  for (double& o : r.out) o /= sum;
  r.lse = mx + std::log(sum);
  return r;
}

double RelativeError(const float* a, const std::vector<double>& b, double floor) {
  double diff = 0.0, mag = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::fabs(a[i] - b[i]));
    mag = std::max(mag, std::fabs(b[i]));
  }
  return diff / std::max(mag, floor);
}

}  // namespace testutil
}  // namespace kvq
