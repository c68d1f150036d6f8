// KvStream over every backend x scheme: round-trip bounds, exactness of the
// fp16 parts, append patterns, input validation and all-or-nothing appends.
#include "kernels/kv_stream.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/numeric.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::AppendRows;
using testutil::Place;
using testutil::PlaceOf;
using testutil::ReadSide;
using testutil::StreamParam;
using testutil::TestAllocator;

// Failures reported in full per test before the rest are only counted.
constexpr int kMaxReported = 8;

class KvStreamTest : public testutil::StreamTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StreamTest::SetUp());
    const QuantSpec& s = config_.spec;
    g_ = s.is_kivi() ? s.group : 1;
    flush_ = s.flush_tokens();
    // Sink, three flushes (several pages) and a tail ending mid-group.
    n_ = s.is_kivi() ? s.sink + 3 * flush_ + flush_ / 2 + 3 : 200;
    k_ = testutil::MakeKeys(n_, d_, 1);
    v_ = testutil::MakeValues(n_, d_, 1);
  }

  std::unique_ptr<KvStream> NewStream(PageAllocator* allocator = nullptr) {
    return testutil::MakeStream(GetParam(), allocator);
  }
  std::unique_ptr<KvStream> FullStream() {
    std::unique_ptr<KvStream> s = NewStream();
    if (s == nullptr) return nullptr;
    const absl::Status st = AppendRows(*s, k_, v_, 0, n_);
    EXPECT_TRUE(st.ok()) << st;
    return s;
  }
  const float* Row(Side side, int t) const {
    return (side == Side::kKey ? k_ : v_).data() + static_cast<size_t>(t) * d_;
  }

  int g_ = 1, flush_ = 1, n_ = 0;
  std::vector<float> k_, v_;
};

// Everything observable about a stream's contents.
struct Snapshot {
  int num_tokens, quantized, tail;
  ByteBreakdown bytes;
  std::vector<float> k, v;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

Snapshot Take(const KvStream& s) {
  return {s.num_tokens(), s.quantized_tokens(), s.tail_tokens(), s.AllocatedBytes(),
          ReadSide(s, Side::kKey, 0, s.num_tokens()), ReadSide(s, Side::kValue, 0, s.num_tokens())};
}

void ExpectStatus(const absl::Status& st, absl::StatusCode code, const std::string& message) {
  EXPECT_EQ(st.code(), code) << st;
  EXPECT_EQ(st.message(), message);
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Stored rows against the quantizer's input: fp16-exact in the sink and the
// tail, within the bound derived from the page's parameters in pages,
// fp16-exact for outliers.
TEST_P(KvStreamTest, StoredRowsWithinSchemeBound) {
  std::unique_ptr<KvStream> s = FullStream();
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->num_tokens(), n_);
  ASSERT_GT(s->quantized_tokens(), 0) << "the data must reach the pages";
  if (config_.spec.is_kivi()) {
    ASSERT_GT(s->tail_tokens(), 0) << "the data must leave tokens in the fp16 tail";
    ASSERT_EQ(s->sink_tokens(), config_.spec.sink);
  }
  const KernelBackend& ref = RefBackend();
  const PageLayout& L = s->layout();
  int failures = 0, outliers = 0;
  std::vector<float> stored(d_), via_ref(d_);
  for (Side side : {Side::kKey, Side::kValue}) {
    const char* name = side == Side::kKey ? "k" : "v";
    for (int t = 0; t < n_; ++t) {
      const std::vector<float> input = testutil::StoredBasis(*s, Row(side, t));
      s->ReadStoredRow(side, t, stored.data());
      const Place place = PlaceOf(*s, t);
      if (place == Place::kPage) {
        // The page format is the contract: the reference decodes any
        // backend's pages the same way.
        const int u = t - s->page_base();
        const std::vector<uint8_t> page = testutil::PageBytes(*s, u / L.page_tokens);
        ref.DequantizeRows(*s, side, page.data(), u % L.page_tokens, 1, via_ref.data());
      }
      for (int c = 0; c < d_; ++c) {
        if (place != Place::kPage) {
          if (FloatBits(stored[c]) != FloatBits(RoundToHalf(input[c])) && ++failures <= kMaxReported) {
            ADD_FAILURE() << name << "[" << t << "][" << c << "] in the "
                          << (place == Place::kSink ? "sink" : "tail") << " is " << stored[c]
                          << ", want the fp16 value " << RoundToHalf(input[c]);
          }
          continue;
        }
        bool is_outlier = false;
        const double bound = testutil::ElementBound(*s, side, t, c, input[c], &is_outlier);
        if (is_outlier) {
          ++outliers;
          if (stored[c] != RoundToHalf(input[c]) && ++failures <= kMaxReported) {
            ADD_FAILURE() << name << "[" << t << "][" << c << "] is an outlier stored as "
                          << stored[c] << ", want exactly " << RoundToHalf(input[c]);
          }
        } else if (!(std::fabs(stored[c] - input[c]) <= bound) && ++failures <= kMaxReported) {
          ADD_FAILURE() << name << "[" << t << "][" << c << "] = " << stored[c] << ", input "
                        << input[c] << ": error " << std::fabs(stored[c] - input[c])
                        << " exceeds the bound " << bound;
        }
        // Up to float rounding of zero + scale * level (an FMA may round once
        // where the reference rounds twice): a millionth of the group's span.
        if (!(std::fabs(via_ref[c] - stored[c]) <= 1e-6 * (1.0 + std::fabs(stored[c])) + 1e-3 * bound) &&
            ++failures <= kMaxReported) {
          ADD_FAILURE() << name << "[" << t << "][" << c << "]: the reference decodes this "
                        << "page as " << via_ref[c] << ", the stream's backend as " << stored[c];
        }
      }
    }
  }
  EXPECT_EQ(failures, 0) << failures << " elements out of bounds";
  if (config_.spec.has_outliers()) {
    const int blocks = s->quantized_tokens() / g_;
    EXPECT_EQ(outliers, 2 * blocks * L.outliers_per_block) << "every table entry is used";
  }
}

// Read() is the stored row with RoPE (pre_rope keys) and the inverse rotation
// applied, and lands within the scheme's bound of the original input.
TEST_P(KvStreamTest, ReadUndoesTheStoredBasis) {
  std::unique_ptr<KvStream> s = FullStream();
  ASSERT_NE(s, nullptr);
  int failures = 0;
  std::vector<float> stored(d_);
  for (Side side : {Side::kKey, Side::kValue}) {
    const char* name = side == Side::kKey ? "k" : "v";
    const std::vector<float> with_rope = ReadSide(*s, side, 0, n_, true);
    const std::vector<float> raw = ReadSide(*s, side, 0, n_, false);
    for (int t = 0; t < n_; ++t) {
      s->ReadStoredRow(side, t, stored.data());
      std::vector<float> want_raw = stored;
      if (s->rotation()) s->rotation()->Inverse(want_raw.data());
      std::vector<float> want_rope = stored;
      if (side == Side::kKey && s->rope()) s->rope()->Apply(want_rope.data(), t);
      if (s->rotation()) s->rotation()->Inverse(want_rope.data());
      const float* got_raw = &raw[static_cast<size_t>(t) * d_];
      const float* got_rope = &with_rope[static_cast<size_t>(t) * d_];
      if (std::memcmp(got_raw, want_raw.data(), d_ * sizeof(float)) != 0 && ++failures <= kMaxReported) {
        ADD_FAILURE() << name << " row " << t << ": Read(apply_rope=false) differs from the "
                      << "inverse-rotated stored row";
      }
      if (std::memcmp(got_rope, want_rope.data(), d_ * sizeof(float)) != 0 && ++failures <= kMaxReported) {
        ADD_FAILURE() << name << " row " << t << ": Read() differs from the stored row with "
                      << "RoPE and the inverse rotation applied";
      }
      // Against the original input, in the original basis.
      const std::vector<float> input = testutil::StoredBasis(*s, Row(side, t));
      double err2 = 0.0, allowed2 = 0.0;
      for (int c = 0; c < d_; ++c) {
        double bound = 0.0;
        bool is_outlier = false;
        if (PlaceOf(*s, t) == Place::kPage) {
          bound = testutil::ElementBound(*s, side, t, c, input[c], &is_outlier);
        }
        // Plus the fp16 rounding of the stored basis itself.
        bound += std::fabs(input[c]) * std::ldexp(1.0, -11) + 1e-7;
        const double e = got_raw[c] - Row(side, t)[c];
        if (!s->rotation() && !(std::fabs(e) <= bound) && ++failures <= kMaxReported) {
          ADD_FAILURE() << name << "[" << t << "][" << c << "]: Read gives " << got_raw[c]
                        << " for input " << Row(side, t)[c] << ", bound " << bound;
        }
        err2 += e * e;
        allowed2 += bound * bound;
      }
      // The rotation is orthonormal: the error's norm is preserved.
      if (!(std::sqrt(err2) <= std::sqrt(allowed2) * (1 + 1e-4) + 1e-5) && ++failures <= kMaxReported) {
        ADD_FAILURE() << name << " row " << t << ": |Read - input| = " << std::sqrt(err2)
                      << " exceeds " << std::sqrt(allowed2);
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

// fp16 and bf16 streams store their own dtype bit-exactly; kivi keeps the
// sink and the tail as the fp16 input. Schemes with such a part and no
// rotation (rotated streams store H x, not x).
class KvStreamFp16PartsTest : public KvStreamTest {};

bool HasUnrotatedFp16Parts(const QuantSpec& s) {
  return !s.rotate &&
         (s.is_kivi() || s.kind == SchemeKind::kFp16 || s.kind == SchemeKind::kBf16);
}

TEST_P(KvStreamFp16PartsTest, Fp16PartsAreBitExact) {
  const QuantSpec& spec = config_.spec;
  const bool bf16 = spec.kind == SchemeKind::kBf16;
  const DType dtype = bf16 ? DType::kBFloat16 : DType::kFloat16;
  std::vector<uint16_t> kh(k_.size()), vh(v_.size());
  FloatToRow(k_.data(), static_cast<int>(k_.size()), dtype, kh.data());
  FloatToRow(v_.data(), static_cast<int>(v_.size()), dtype, vh.data());
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  const ConstTensorView kt{kh.data(), dtype, n_, d_, 0};
  const ConstTensorView vt{vh.data(), dtype, n_, d_, 0};
  ASSERT_TRUE(s->Append(kt, vt).ok());
  std::vector<uint16_t> ko(kh.size()), vo(vh.size());
  ReadOptions options;
  options.dtype = dtype;
  options.apply_rope = false;
  ASSERT_TRUE(s->Read(0, n_, options, TensorView{ko.data(), dtype, n_, d_, 0},
                      TensorView{vo.data(), dtype, n_, d_, 0})
                  .ok());
  int checked = 0;
  for (int t = 0; t < n_; ++t) {
    if (spec.is_kivi() && PlaceOf(*s, t) == Place::kPage) continue;
    ++checked;
    const size_t at = static_cast<size_t>(t) * d_;
    EXPECT_EQ(std::memcmp(&ko[at], &kh[at], d_ * 2), 0) << "key row " << t << " is not bit-exact";
    EXPECT_EQ(std::memcmp(&vo[at], &vh[at], d_ * 2), 0) << "value row " << t << " is not bit-exact";
  }
  EXPECT_GT(checked, 0);
}

// A key spike (an isolated extreme value) is kept in the outlier table and
// read back exactly.
// Schemes with outliers and no rotation (rotation spreads a spike over every
// channel).
class KvStreamOutlierTest : public KvStreamTest {};

TEST_P(KvStreamOutlierTest, PlantedOutliersReproducedExactly) {
  std::vector<float> k = k_, v = v_;
  struct Spike {
    Side side;
    int t, c;
    float x;
  };
  std::vector<Spike> spikes;
  for (int t = 0; t < n_; t += 5) {
    const int c = (t * 7) % d_;
    const float x = (t % 2 ? 1.0f : -1.0f) * (40.0f + 0.3f * (t % 17));
    spikes.push_back({t % 10 ? Side::kKey : Side::kValue, t, c, x});
    (spikes.back().side == Side::kKey ? k : v)[static_cast<size_t>(t) * d_ + c] = x;
  }
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(AppendRows(*s, k, v, 0, n_).ok());
  const std::vector<float> rk = ReadSide(*s, Side::kKey, 0, n_, false);
  const std::vector<float> rv = ReadSide(*s, Side::kValue, 0, n_, false);
  int in_pages = 0;
  for (const Spike& sp : spikes) {
    const float got = (sp.side == Side::kKey ? rk : rv)[static_cast<size_t>(sp.t) * d_ + sp.c];
    EXPECT_EQ(got, RoundToHalf(sp.x)) << (sp.side == Side::kKey ? "k" : "v") << "[" << sp.t
                                      << "][" << sp.c << "] spike not reproduced exactly";
    if (PlaceOf(*s, sp.t) == Place::kPage) {
      ++in_pages;
      bool is_outlier = false;
      testutil::ElementBound(*s, sp.side, sp.t, sp.c, sp.x, &is_outlier);
      EXPECT_TRUE(is_outlier) << "spike at [" << sp.t << "][" << sp.c << "] not in the outlier table";
    }
  }
  EXPECT_GT(in_pages, 10);
}

// Constant groups (zero range) reproduce exactly. Affine (scale/zero)
// schemes only, the ones with groups, and unrotated: a constant group is not
// constant after rotation.
class KvStreamConstantGroupsTest : public KvStreamTest {};

bool HasUnrotatedGroups(const QuantSpec& s) {
  return !s.rotate && (s.is_kivi() || s.kind == SchemeKind::kInt8);
}

TEST_P(KvStreamConstantGroupsTest, ConstantGroupsReproduceExactly) {
  absl::StatusOr<PageLayout> L = PageLayout::Make(config_.spec, d_, config_.page_tokens);
  ASSERT_TRUE(L.ok());
  std::vector<float> k = k_, v = v_;
  const bool key_channels = L->key.axis == ParamAxis::kChannelGroups;
  const int key_gc = key_channels ? 1 : L->key.group_channels;
  const int val_gc = L->value.group_channels;
  // p8 parameters are codes under a per-block step, so one constant group
  // among others decodes to within a zero step of its value (the round-trip
  // bound); a block that is constant throughout is exact.
  const bool whole = config_.spec.param_bits == 8;
  auto key_const = [&](int t, int c) {
    return whole || (key_channels ? c == 5 : (t % 3 == 0 && c < key_gc));
  };
  auto val_const = [&](int t, int c) { return whole || (t % 3 == 0 && c >= d_ - val_gc); };
  for (int t = 0; t < n_; ++t) {
    for (int c = 0; c < d_; ++c) {
      if (key_const(t, c)) k[static_cast<size_t>(t) * d_ + c] = 0.375f;
      if (val_const(t, c)) v[static_cast<size_t>(t) * d_ + c] = -1.25f;
    }
  }
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(AppendRows(*s, k, v, 0, n_).ok());
  const std::vector<float> rk = ReadSide(*s, Side::kKey, 0, n_, false);
  const std::vector<float> rv = ReadSide(*s, Side::kValue, 0, n_, false);
  int failures = 0;
  for (int t = 0; t < n_; ++t) {
    for (int c = 0; c < d_; ++c) {
      const size_t i = static_cast<size_t>(t) * d_ + c;
      if (key_const(t, c) && rk[i] != 0.375f && ++failures <= kMaxReported) {
        ADD_FAILURE() << "k[" << t << "][" << c << "] of a constant group reads " << rk[i];
      }
      if (val_const(t, c) && rv[i] != -1.25f && ++failures <= kMaxReported) {
        ADD_FAILURE() << "v[" << t << "][" << c << "] of a constant group reads " << rv[i];
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

// Any split of the same tokens into appends gives the same stream.
TEST_P(KvStreamTest, AppendPatternsMatchOneBigAppend) {
  // fp8 fixes its per-stream scale on the first append: put the largest
  // magnitude of both sides in token 0 so every pattern picks the same one.
  std::vector<float> k = k_, v = v_;
  float kmax = 0, vmax = 0;
  for (float x : k) kmax = std::max(kmax, std::fabs(x));
  for (float x : v) vmax = std::max(vmax, std::fabs(x));
  k[1] = kmax * 1.01f;
  v[2] = -vmax * 1.01f;
  std::unique_ptr<KvStream> big = NewStream();
  ASSERT_NE(big, nullptr);
  ASSERT_TRUE(AppendRows(*big, k, v, 0, n_).ok());
  const Snapshot want = Take(*big);
  const int r = config_.spec.is_kivi() ? config_.spec.residual : 0;
  std::vector<std::vector<int>> patterns = {{1}, {7}, {3, 1, 7, 2, 5}};
  for (int size : {g_ - 1, g_, r - 1, r, r + 1, flush_ + 1, 2 * flush_ + 5}) {
    if (size > 0) patterns.push_back({size});
  }
  patterns.push_back({1, 7, std::max(1, g_ - 1), r + 1, 3, g_, 2 * flush_ + 5, std::max(1, r - 1)});
  const int sink = config_.spec.sink;
  for (const std::vector<int>& pattern : patterns) {
    const std::string label = absl::StrCat("pattern {", absl::StrJoin(pattern, ", "), "}");
    std::unique_ptr<KvStream> s = NewStream();
    ASSERT_NE(s, nullptr);
    int t = 0;
    for (size_t i = 0; t < n_; ++i) {
      const int end = std::min(n_, t + pattern[i % pattern.size()]);
      const absl::Status st = AppendRows(*s, k, v, t, end);
      ASSERT_TRUE(st.ok()) << label << ": " << st;
      t = end;
      // Residual boundaries: the tail flushes exactly when it fills.
      const int rest = std::max(0, t - sink);
      ASSERT_EQ(s->num_tokens(), t) << label;
      ASSERT_EQ(s->sink_tokens(), std::min(t, sink)) << label;
      ASSERT_EQ(s->quantized_tokens(), rest / flush_ * flush_) << label << " after " << t << " tokens";
      ASSERT_EQ(s->tail_tokens(), rest % flush_) << label << " after " << t << " tokens";
    }
    const Snapshot got = Take(*s);
    EXPECT_EQ(got.num_tokens, want.num_tokens) << label;
    EXPECT_EQ(got.bytes, want.bytes) << label;
    EXPECT_TRUE(SameBits(got.k, want.k)) << label << ": keys differ from one big append";
    EXPECT_TRUE(SameBits(got.v, want.v)) << label << ": values differ from one big append";
  }
}

// kivi schemes only: per-token schemes quantize on append, with no residual.
class KvStreamResidualTest : public KvStreamTest {};

bool IsKivi(const QuantSpec& s) { return s.is_kivi(); }

TEST_P(KvStreamResidualTest, ResidualBoundaryExplicit) {
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  const int sink = config_.spec.sink;
  ASSERT_TRUE(AppendRows(*s, k_, v_, 0, sink + flush_ - 1).ok());
  EXPECT_EQ(s->quantized_tokens(), 0) << "one token short of a flush stays fp16";
  EXPECT_EQ(s->tail_tokens(), flush_ - 1);
  EXPECT_EQ(s->num_pages(), 0);
  ASSERT_TRUE(AppendRows(*s, k_, v_, sink + flush_ - 1, sink + flush_).ok());
  EXPECT_EQ(s->quantized_tokens(), flush_) << "the token that fills the tail flushes it";
  EXPECT_EQ(s->tail_tokens(), 0);
  EXPECT_EQ(s->num_pages(), (flush_ + s->layout().page_tokens - 1) / s->layout().page_tokens);
  ASSERT_TRUE(AppendRows(*s, k_, v_, sink + flush_, sink + flush_ + 1).ok());
  EXPECT_EQ(s->quantized_tokens(), flush_);
  EXPECT_EQ(s->tail_tokens(), 1);
}

TEST_P(KvStreamTest, StridedAndHalfInputsMatchContiguousFloat) {
  std::unique_ptr<KvStream> want = FullStream();
  ASSERT_NE(want, nullptr);
  // Rows padded to a stride of d + 16.
  const int stride = d_ + 16;
  std::vector<float> ks(static_cast<size_t>(n_) * stride, 1e30f), vs(ks.size(), -1e30f);
  for (int t = 0; t < n_; ++t) {
    std::copy(Row(Side::kKey, t), Row(Side::kKey, t) + d_, &ks[static_cast<size_t>(t) * stride]);
    std::copy(Row(Side::kValue, t), Row(Side::kValue, t) + d_, &vs[static_cast<size_t>(t) * stride]);
  }
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(s->Append({ks.data(), DType::kFloat32, n_, d_, stride},
                        {vs.data(), DType::kFloat32, n_, d_, stride})
                  .ok());
  const Snapshot a = Take(*want), b = Take(*s);
  EXPECT_TRUE(SameBits(a.k, b.k) && SameBits(a.v, b.v)) << "strided input changed the stream";
}

// fp16 and bf16 input, contiguous and strided (NaN in the padding, which is
// not data), stores exactly what float input of the same values stores: the
// 16-bit paths that copy rows instead of converting them change nothing.
TEST_P(KvStreamTest, SixteenBitInputsMatchFloatInput) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (int stride : {d_, d_ + 8}) {
      std::vector<uint16_t> kh(static_cast<size_t>(n_) * stride, 0x7e00),
          vh(kh.size(), 0x7fc0);  // fp16 / bf16 NaN in the padding.
      std::vector<float> kf(static_cast<size_t>(n_) * d_), vf(kf.size());
      for (int t = 0; t < n_; ++t) {
        FloatToRow(Row(Side::kKey, t), d_, dtype, &kh[static_cast<size_t>(t) * stride]);
        FloatToRow(Row(Side::kValue, t), d_, dtype, &vh[static_cast<size_t>(t) * stride]);
        RowToFloat(&kh[static_cast<size_t>(t) * stride], dtype, d_, &kf[static_cast<size_t>(t) * d_]);
        RowToFloat(&vh[static_cast<size_t>(t) * stride], dtype, d_, &vf[static_cast<size_t>(t) * d_]);
      }
      // The copy paths zero fresh pages themselves: give them poisoned ones.
      // (Hidden pages come poisoned as well.)
      TestAllocator poisoned;
      std::unique_ptr<KvStream> want = NewStream(),
                                got = NewStream(GetParam().hidden_pages ? nullptr : &poisoned);
      ASSERT_NE(want, nullptr);
      ASSERT_NE(got, nullptr);
      ASSERT_TRUE(AppendRows(*want, kf, vf, 0, n_).ok());
      // Two appends, so the second starts mid-page / mid-tail.
      const int first = n_ / 3;
      for (auto [b, e] : {std::pair{0, first}, std::pair{first, n_}}) {
        const size_t off = static_cast<size_t>(b) * stride;
        const absl::Status st = got->Append({kh.data() + off, dtype, e - b, d_, stride},
                                            {vh.data() + off, dtype, e - b, d_, stride});
        ASSERT_TRUE(st.ok()) << st;
      }
      const Snapshot a = Take(*want), b = Take(*got);
      EXPECT_TRUE(SameBits(a.k, b.k) && SameBits(a.v, b.v) && a.bytes == b.bytes)
          << DTypeName(dtype) << " input, stride " << stride;
      ASSERT_EQ(want->num_pages(), got->num_pages());
      for (int p = 0; p < want->num_pages(); ++p) {
        EXPECT_EQ(testutil::PageBytes(*want, p), testutil::PageBytes(*got, p))
            << DTypeName(dtype) << " input, stride " << stride << ": page " << p;
      }
    }
  }
}

// Each 16-bit input type is range-checked on its bits: the largest value
// inside the limit passes, the next one up, Inf and NaN are named.
TEST_P(KvStreamTest, SixteenBitInputsAreRangeChecked) {
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  const bool bf16_scheme = config_.spec.kind == SchemeKind::kBf16;
  const int m = 3;
  auto append = [&](DType dtype, int row, int col, uint16_t bits) {
    std::vector<uint16_t> k(static_cast<size_t>(m) * d_, 0), v(k.size(), 0);
    k[static_cast<size_t>(row) * d_ + col] = bits;
    return s->Append({k.data(), dtype, m, d_, 0}, {v.data(), dtype, m, d_, 0});
  };
  EXPECT_TRUE(append(DType::kFloat16, 1, 2, 0xfbff).ok());  // -65504
  ExpectStatus(append(DType::kFloat16, 2, 7, 0xfc00), absl::StatusCode::kInvalidArgument,
               "k[2][7] is not finite");
  ExpectStatus(append(DType::kFloat16, 0, 1, 0x7e00), absl::StatusCode::kInvalidArgument,
               "k[0][1] is not finite");
  ExpectStatus(append(DType::kBFloat16, 1, 3, 0xffc0), absl::StatusCode::kInvalidArgument,
               "k[1][3] is not finite");
  if (bf16_scheme) {
    EXPECT_TRUE(append(DType::kBFloat16, 0, 0, 0x7f7f).ok());  // Largest finite bf16.
    // Read as fp16, a value outside fp16's range converts as IEEE does (inf);
    // as bf16 it comes back exactly.
    std::vector<uint16_t> row(static_cast<size_t>(d_));
    for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      ReadOptions options;
      options.dtype = dtype;
      ASSERT_TRUE(s->Read(m, m + 1, options, {row.data(), dtype, 1, d_, 0}, {}).ok());
      EXPECT_EQ(row[0], dtype == DType::kFloat16 ? 0x7c00 : 0x7f7f);
    }
  } else {
    EXPECT_TRUE(append(DType::kBFloat16, 0, 0, 0x477f).ok());  // 65280 <= 65504.
    ExpectStatus(append(DType::kBFloat16, 2, 4, 0xc780), absl::StatusCode::kInvalidArgument,
                 "k[2][4] = -65536 is outside the fp16 range +-65504");
  }
  EXPECT_EQ(s->num_tokens(), 2 * m);
}

TEST_P(KvStreamTest, ReadSubrangesMatchFullRead) {
  std::unique_ptr<KvStream> s = FullStream();
  ASSERT_NE(s, nullptr);
  const std::vector<float> all_k = ReadSide(*s, Side::kKey, 0, n_);
  const std::vector<float> all_v = ReadSide(*s, Side::kValue, 0, n_);
  const int pt = s->layout().page_tokens;
  const int pb = s->page_base();
  const int q = s->quantized_tokens();
  for (auto [b, e] : std::vector<std::pair<int, int>>{{0, 1},
                                                      {1, 3},
                                                      {pb + pt / 2, pb + pt + 3},
                                                      {pb + 1, pb + q},
                                                      {pb + q - 1, n_},
                                                      {std::max(0, n_ - 2), n_},
                                                      {n_, n_},
                                                      {0, n_}}) {
    const std::vector<float> rk = ReadSide(*s, Side::kKey, b, e);
    const std::vector<float> rv = ReadSide(*s, Side::kValue, b, e);
    EXPECT_TRUE(std::equal(rk.begin(), rk.end(), all_k.begin() + static_cast<size_t>(b) * d_))
        << "keys [" << b << ", " << e << ")";
    EXPECT_TRUE(std::equal(rv.begin(), rv.end(), all_v.begin() + static_cast<size_t>(b) * d_))
        << "values [" << b << ", " << e << ")";
  }
  // Half-precision reads are the float read rounded.
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<uint16_t> out(static_cast<size_t>(n_) * d_), want(out.size());
    ReadOptions options;
    options.dtype = dtype;
    ASSERT_TRUE(s->Read(0, n_, options, TensorView{out.data(), dtype, n_, d_, 0}, TensorView{}).ok());
    FloatToRow(all_k.data(), static_cast<int>(all_k.size()), dtype, want.data());
    EXPECT_EQ(out, want) << "Read as " << DTypeName(dtype);
  }
}

TEST_P(KvStreamTest, RejectsBadValuesAndLeavesStreamUnchanged) {
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  const int first = config_.spec.sink + flush_ + 5;
  ASSERT_TRUE(AppendRows(*s, k_, v_, 0, first).ok());
  const Snapshot before = Take(*s);
  const int m = 6;
  auto try_append = [&](const std::vector<float>& k, const std::vector<float>& v) {
    return s->Append(Floats(k.data(), m, d_), Floats(v.data(), m, d_));
  };
  std::vector<float> k(k_.begin() + static_cast<size_t>(first) * d_,
                       k_.begin() + static_cast<size_t>(first + m) * d_);
  std::vector<float> v(v_.begin() + static_cast<size_t>(first) * d_,
                       v_.begin() + static_cast<size_t>(first + m) * d_);
  {
    std::vector<float> bad = k;
    bad[3 * d_ + 17] = std::numeric_limits<float>::quiet_NaN();
    ExpectStatus(try_append(bad, v), absl::StatusCode::kInvalidArgument, "k[3][17] is not finite");
  }
  {
    std::vector<float> bad = v;
    bad[2 * d_ + 5] = -std::numeric_limits<float>::infinity();
    ExpectStatus(try_append(k, bad), absl::StatusCode::kInvalidArgument, "v[2][5] is not finite");
  }
  {
    // Half-precision input holding an infinity.
    std::vector<uint16_t> kh(k.size()), vh(v.size());
    FloatToRow(k.data(), static_cast<int>(k.size()), DType::kFloat16, kh.data());
    FloatToRow(v.data(), static_cast<int>(v.size()), DType::kFloat16, vh.data());
    vh[5 * d_ + 1] = 0x7c00;
    ExpectStatus(s->Append({kh.data(), DType::kFloat16, m, d_, 0}, {vh.data(), DType::kFloat16, m, d_, 0}),
                 absl::StatusCode::kInvalidArgument, "v[5][1] is not finite");
  }
  if (config_.spec.kind == SchemeKind::kBf16) {
    std::vector<float> bad = k;
    bad[1 * d_ + 0] = std::numeric_limits<float>::max();
    ExpectStatus(try_append(bad, v), absl::StatusCode::kInvalidArgument,
                 "k[1][0] = 3.40282e+38 is outside the bf16 range +-3.38953e+38");
  } else {
    std::vector<float> bad = k;
    bad[1 * d_ + 0] = 70000.0f;
    ExpectStatus(try_append(bad, v), absl::StatusCode::kInvalidArgument,
                 "k[1][0] = 70000 is outside the fp16 range +-65504");
    bad = v;
    bad[4 * d_ + 9] = -65505.0f;
    ExpectStatus(try_append(k, bad), absl::StatusCode::kInvalidArgument,
                 "v[4][9] = -65505 is outside the fp16 range +-65504");
  }
  // Shapes, naming the field.
  ExpectStatus(s->Append(Floats(k.data(), m, d_ - 1), Floats(v.data(), m, d_)),
               absl::StatusCode::kInvalidArgument,
               absl::StrCat("k has ", d_ - 1, " columns, head_dim is ", d_));
  ExpectStatus(s->Append(Floats(k.data(), m, d_), Floats(v.data(), m, d_ + 16)),
               absl::StatusCode::kInvalidArgument,
               absl::StrCat("v has ", d_ + 16, " columns, head_dim is ", d_));
  ExpectStatus(s->Append(Floats(k.data(), m, d_), Floats(v.data(), m - 1, d_)),
               absl::StatusCode::kInvalidArgument, absl::StrCat("v has ", m - 1, " rows, k has ", m));
  ExpectStatus(s->Append({nullptr, DType::kFloat32, m, d_, 0}, Floats(v.data(), m, d_)),
               absl::StatusCode::kInvalidArgument, "k data is null");
  ExpectStatus(s->Append(Floats(k.data(), m, d_), {v.data(), DType::kFloat32, m, d_, d_ - 1}),
               absl::StatusCode::kInvalidArgument, "v row_stride < cols");
  EXPECT_TRUE(Take(*s) == before) << "a rejected append changed the stream";
  // An empty append is accepted and changes nothing.
  EXPECT_TRUE(s->Append(Floats(k.data(), 0, d_), Floats(v.data(), 0, d_)).ok());
  EXPECT_TRUE(Take(*s) == before);
  // And the stream still takes the good rows.
  ASSERT_TRUE(try_append(k, v).ok());
  EXPECT_EQ(s->num_tokens(), first + m);
}

class KvStreamBf16Test : public KvStreamTest {};

TEST_P(KvStreamBf16Test, KeepsValuesBeyondTheFp16Range) {
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  std::vector<float> k(d_, 1e5f), v(d_, -3e20f);
  ASSERT_TRUE(s->Append(Floats(k.data(), 1, d_), Floats(v.data(), 1, d_)).ok());
  EXPECT_EQ(ReadSide(*s, Side::kKey, 0, 1)[0], Bf16ToFloat(FloatToBf16(1e5f)));
  EXPECT_EQ(ReadSide(*s, Side::kValue, 0, 1)[d_ - 1], Bf16ToFloat(FloatToBf16(-3e20f)));
}

// An append the allocator cannot serve fails with its status and changes
// nothing, neither in the stream nor in the allocator.
TEST_P(KvStreamTest, AllocatorFailureLeavesStreamUnchanged) {
  TestAllocator allocator;
  {
    std::unique_ptr<KvStream> s = NewStream(&allocator);
    ASSERT_NE(s, nullptr);
    const int first = config_.spec.sink + flush_ + 3;
    ASSERT_TRUE(AppendRows(*s, k_, v_, 0, first).ok());
    const Snapshot before = Take(*s);
    const size_t live = allocator.live_bytes();
    const int blocks = allocator.live_blocks();
    // Let the append get one page and fail on the next, when it needs two or
    // more (a flush smaller than a page may need only one).
    auto pages_for = [&](int tokens) {
      const int pt = s->layout().page_tokens;
      const int quantized = std::max(0, tokens - config_.spec.sink) / flush_ * flush_;
      return (quantized + pt - 1) / pt;
    };
    ASSERT_GE(pages_for(n_) - pages_for(first), 1) << "the append below must need a page";
    allocator.set_budget(pages_for(n_) - pages_for(first) >= 2 ? 1 : 0);
    const absl::Status st = AppendRows(*s, k_, v_, first, n_);
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_EQ(st.message(), absl::StrCat("test allocator: budget spent (", s->layout().page_bytes,
                                         " bytes asked)"));
    EXPECT_TRUE(Take(*s) == before) << "a failed append changed the stream";
    EXPECT_EQ(allocator.live_bytes(), live) << "pages of the failed append leaked";
    EXPECT_EQ(allocator.live_blocks(), blocks);
    // With memory back, the same append succeeds and gives the same stream.
    allocator.set_budget(-1);
    ASSERT_TRUE(AppendRows(*s, k_, v_, first, n_).ok());
    // The same two appends into a fresh stream (fp8 fixes its scale on the first).
    std::unique_ptr<KvStream> want = NewStream();
    ASSERT_NE(want, nullptr);
    ASSERT_TRUE(AppendRows(*want, k_, v_, 0, first).ok());
    ASSERT_TRUE(AppendRows(*want, k_, v_, first, n_).ok());
    const Snapshot a = Take(*s), b = Take(*want);
    EXPECT_TRUE(SameBits(a.k, b.k) && SameBits(a.v, b.v));
    EXPECT_EQ(allocator.live_bytes(), s->AllocatedBytes().total());
  }
  EXPECT_EQ(allocator.live_bytes(), 0u) << "destroying the stream returns every byte";
  EXPECT_EQ(allocator.bad_frees(), 0);
}

// Whole flush blocks of contiguous fp16 rows onto an empty tail (a client
// quantizing a prompt) are checked a block at a time as they are quantized
// (KvStream::AppendBlocksChecked): a bad value in any block, first or last,
// in K or in V, fails the append with the message of the whole-input check
// and leaves the stream and the allocator as they were; the good rows then
// append as float input would.
TEST_P(KvStreamTest, BlockCheckedAppendRejectsBadBlocksAndLeavesStreamUnchanged) {
  TestAllocator allocator;
  std::unique_ptr<KvStream> s = NewStream(&allocator);
  ASSERT_NE(s, nullptr);
  // The sink and one flush: the tail is empty again.
  const int first = config_.spec.sink + flush_;
  const int m = std::max(2 * flush_, 4);  // Two flushes (kivi: two blocks or more each).
  const std::vector<float> k = testutil::MakeKeys(first + m, d_, 5);
  const std::vector<float> v = testutil::MakeValues(first + m, d_, 5);
  ASSERT_TRUE(AppendRows(*s, k, v, 0, first).ok());
  ASSERT_EQ(s->tail_tokens(), 0);
  const Snapshot before = Take(*s);
  const size_t live = allocator.live_bytes();
  std::vector<uint16_t> kh(static_cast<size_t>(m) * d_), vh(kh.size());
  FloatToRow(k.data() + static_cast<size_t>(first) * d_, m * d_, DType::kFloat16, kh.data());
  FloatToRow(v.data() + static_cast<size_t>(first) * d_, m * d_, DType::kFloat16, vh.data());
  auto append = [&](const std::vector<uint16_t>& kb, const std::vector<uint16_t>& vb) {
    return s->Append({kb.data(), DType::kFloat16, m, d_, 0}, {vb.data(), DType::kFloat16, m, d_, 0});
  };
  struct Bad {
    bool key;
    int row, col;
    uint16_t bits;
  };
  for (const Bad& b : {Bad{true, 0, 3, 0x7e00}, Bad{false, m - 1, d_ - 1, 0xfc00},
                       Bad{false, m / 2 + 1, 7, 0x7c00}, Bad{true, m - 2, 0, 0x7c01}}) {
    std::vector<uint16_t> kb = kh, vb = vh;
    (b.key ? kb : vb)[static_cast<size_t>(b.row) * d_ + b.col] = b.bits;
    ExpectStatus(append(kb, vb), absl::StatusCode::kInvalidArgument,
                 absl::StrCat(b.key ? "k[" : "v[", b.row, "][", b.col, "] is not finite"));
    EXPECT_TRUE(Take(*s) == before) << "a rejected append changed the stream";
    EXPECT_EQ(allocator.live_bytes(), live) << "pages of the rejected append leaked";
  }
  // With no pages to be had, bad input is still named first, and good input
  // gets the allocator's status; nothing changes either way.
  if (s->PagesNeeded(m) > 0) {
    allocator.set_budget(0);
    std::vector<uint16_t> bad = vh;
    bad[static_cast<size_t>(m - 1) * d_ + 2] = 0x7e00;
    ExpectStatus(append(kh, bad), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("v[", m - 1, "][2] is not finite"));
    ExpectStatus(append(kh, vh), absl::StatusCode::kResourceExhausted,
                 absl::StrCat("test allocator: budget spent (", s->layout().page_bytes,
                              " bytes asked)"));
    EXPECT_TRUE(Take(*s) == before);
    EXPECT_EQ(allocator.live_bytes(), live);
    allocator.set_budget(-1);
  }
  ASSERT_TRUE(append(kh, vh).ok());
  // The same values as floats (the fp16 rows widened, exactly).
  std::vector<float> kf(kh.size()), vf(vh.size());
  RowToFloat(kh.data(), DType::kFloat16, m * d_, kf.data());
  RowToFloat(vh.data(), DType::kFloat16, m * d_, vf.data());
  std::unique_ptr<KvStream> want = NewStream();
  ASSERT_NE(want, nullptr);
  ASSERT_TRUE(AppendRows(*want, k, v, 0, first).ok());
  ASSERT_TRUE(AppendRows(*want, kf, vf, 0, m).ok());
  const Snapshot a = Take(*s), b = Take(*want);
  EXPECT_EQ(a.num_tokens, b.num_tokens);
  EXPECT_EQ(a.quantized, b.quantized);
  EXPECT_TRUE(SameBits(a.k, b.k) && SameBits(a.v, b.v)) << "fp16 blocks differ from float input";
  EXPECT_EQ(allocator.live_bytes(), s->AllocatedBytes().total());
}

// The block-checked append leaves the pages that its blocks fill unzeroed
// (KvStream::BlocksWriteWholePages): every byte of them must then be the
// quantizer's. The test allocator hands out pages filled with 0xa5, so a
// byte left unwritten differs from the same rows appended as floats, whose
// pages are zeroed first. Two flushes after a first one cover a page that
// the new blocks fill in part where pages hold several blocks (g16:r16).
TEST_P(KvStreamTest, BlockCheckedAppendWritesEveryByteOfItsPages) {
  TestAllocator poisoned, other;
  std::unique_ptr<KvStream> s = NewStream(GetParam().hidden_pages ? nullptr : &poisoned);
  std::unique_ptr<KvStream> want = NewStream(&other);
  ASSERT_NE(s, nullptr);
  ASSERT_NE(want, nullptr);
  const int first = config_.spec.sink + flush_;
  const int m = std::max(2 * flush_, 4);
  const std::vector<float> k = testutil::MakeKeys(first + m, d_, 9);
  const std::vector<float> v = testutil::MakeValues(first + m, d_, 9);
  ASSERT_TRUE(AppendRows(*s, k, v, 0, first).ok());
  ASSERT_TRUE(AppendRows(*want, k, v, 0, first).ok());
  std::vector<uint16_t> kh(static_cast<size_t>(m) * d_), vh(kh.size());
  FloatToRow(k.data() + static_cast<size_t>(first) * d_, m * d_, DType::kFloat16, kh.data());
  FloatToRow(v.data() + static_cast<size_t>(first) * d_, m * d_, DType::kFloat16, vh.data());
  std::vector<float> kf(kh.size()), vf(vh.size());
  RowToFloat(kh.data(), DType::kFloat16, m * d_, kf.data());
  RowToFloat(vh.data(), DType::kFloat16, m * d_, vf.data());
  ASSERT_TRUE(s->Append({kh.data(), DType::kFloat16, m, d_, 0}, {vh.data(), DType::kFloat16, m, d_, 0})
                  .ok());
  ASSERT_TRUE(AppendRows(*want, kf, vf, 0, m).ok());
  ASSERT_EQ(s->num_pages(), want->num_pages());
  for (int i = 0; i < s->num_pages(); ++i) {
    EXPECT_EQ(testutil::PageBytes(*s, i), testutil::PageBytes(*want, i))
        << "page " << i << " of " << s->num_pages() << " differs from the float append's";
  }
}

TEST_P(KvStreamTest, CreateFailsCleanlyWhenAllocatorIsEmpty) {
  TestAllocator allocator;
  allocator.set_budget(0);
  absl::StatusOr<std::unique_ptr<KvStream>> s =
      testutil::TryMakeStream(config_, backend_, &allocator);
  if (AuxBytes(config_) == 0) {
    EXPECT_TRUE(s.ok()) << "nothing to allocate at creation: " << s.status();
  } else {
    EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  }
  EXPECT_EQ(allocator.live_bytes(), 0u);
}

TEST_P(KvStreamTest, ReadOutOfRangeAndBadOutputs) {
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  ASSERT_TRUE(AppendRows(*s, k_, v_, 0, 10).ok());
  std::vector<float> buf(static_cast<size_t>(16) * d_);
  auto read = [&](int b, int e, ReadOptions o = {}) {
    return s->Read(b, e, o, TensorView{buf.data(), o.dtype, std::max(0, e - b), d_, 0}, TensorView{});
  };
  ExpectStatus(read(-1, 2), absl::StatusCode::kOutOfRange, "token range [-1, 2) is not inside [0, 10]");
  ExpectStatus(read(0, 11), absl::StatusCode::kOutOfRange, "token range [0, 11) is not inside [0, 10]");
  ExpectStatus(read(5, 4), absl::StatusCode::kOutOfRange, "token range [5, 4) is not inside [0, 10]");
  EXPECT_TRUE(read(10, 10).ok());
  EXPECT_TRUE(read(0, 10).ok());
  ExpectStatus(s->Read(0, 4, {}, Floats(buf.data(), 3, d_), TensorView{}),
               absl::StatusCode::kInvalidArgument,
               absl::StrCat("output must be [4, ", d_, "] of fp32, got [3, ", d_, "] of fp32"));
  ReadOptions half;
  half.dtype = DType::kFloat16;
  ExpectStatus(s->Read(0, 4, half, TensorView{}, Floats(buf.data(), 4, d_)),
               absl::StatusCode::kInvalidArgument,
               absl::StrCat("output must be [4, ", d_, "] of fp16, got [4, ", d_, "] of fp32"));
}

class KvStreamFp8Test : public KvStreamTest {};

TEST_P(KvStreamFp8Test, ScaleFixedByFirstAppend) {
  std::unique_ptr<KvStream> s = NewStream();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->fp8_scale(Side::kKey), 0.0f) << "no scale before the first append";
  ASSERT_TRUE(AppendRows(*s, k_, v_, 0, 20).ok());
  float kmax = 0, vmax = 0;
  for (int i = 0; i < 20 * d_; ++i) kmax = std::max(kmax, std::fabs(k_[i]));
  for (int i = 0; i < 20 * d_; ++i) vmax = std::max(vmax, std::fabs(v_[i]));
  // The first append's max maps to half of the fp8 range (2x headroom).
  EXPECT_FLOAT_EQ(s->fp8_scale(Side::kKey), kmax * 2.0f / kFp8E4m3Max);
  EXPECT_FLOAT_EQ(s->fp8_scale(Side::kValue), vmax * 2.0f / kFp8E4m3Max);
  const float k_scale = s->fp8_scale(Side::kKey);
  std::vector<float> big(d_, kmax * 1.5f);
  ASSERT_TRUE(s->Append(Floats(big.data(), 1, d_), Floats(big.data(), 1, d_)).ok());
  EXPECT_EQ(s->fp8_scale(Side::kKey), k_scale) << "later appends keep the scale";
  EXPECT_NEAR(ReadSide(*s, Side::kKey, 20, 21)[0], kmax * 1.5f, kmax * 1.5f / 16)
      << "values up to 2x the first max still fit";
}

TEST_P(KvStreamTest, CreateRejectsBadConfigs) {
  StreamConfig c = config_;
  c.head_dim = 72;
  EXPECT_EQ(KvStream::Create(c, backend_).status().message(),
            "head_dim must be a multiple of 16 in [16, 256], got 72");
  EXPECT_EQ(KvStream::Create(config_, nullptr).status().message(), "backend is null");
  if (config_.spec.nuq) {
    absl::StatusOr<std::unique_ptr<KvStream>> s = KvStream::Create(config_, backend_);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.status().message(),
              "scheme has nuq but no codebook was given: learn one with LearnCodebook()");
    Codebook wrong = Codebook::Uniform(config_.spec.bits == 2 ? 3 : 2, d_);
    EXPECT_EQ(KvStream::Create(config_, backend_, nullptr, &wrong).status().message(),
              absl::StrCat("codebook is for ", wrong.bits, " bits and head_dim ", d_,
                           ", stream has ", config_.spec.bits, " bits and head_dim ", d_));
  }
  if (config_.spec.rotate) {
    c = config_;
    c.head_dim = 96;
    EXPECT_EQ(KvStream::Create(c, backend_).status().message(),
              "rotate needs a power-of-two head_dim, got 96");
  }
  if (config_.spec.pre_rope) {
    c = config_;
    c.rope.rotary_dim = 7;
    EXPECT_EQ(KvStream::Create(c, backend_).status().message(),
              absl::StrCat("rope.rotary_dim must be even and in [2, head_dim=", d_, "], got 7"));
  }
}

std::string ParamName(const ::testing::TestParamInfo<StreamParam>& info) {
  return testutil::StreamParamName(info.param);
}

INSTANTIATE_TEST_SUITE_P(AllBackendsAndSchemes, KvStreamTest,
                         ::testing::ValuesIn(testutil::AllStreamParams()), ParamName);
// cuda_host over pages the host cannot address: a direct access of page
// bytes anywhere in KvStream faults.
INSTANTIATE_TEST_SUITE_P(HiddenPages, KvStreamTest,
                         ::testing::ValuesIn(testutil::HiddenPageStreamParams()), ParamName);
// The suites of one kind of scheme, over every backend and over hidden pages
// as KvStreamTest is.
KVQ_INSTANTIATE_STREAM_SUITES(AllBackendsAndSchemes, KvStreamFp16PartsTest,
                              &HasUnrotatedFp16Parts);
KVQ_INSTANTIATE_STREAM_SUITES(AllBackendsAndSchemes, KvStreamConstantGroupsTest,
                              &HasUnrotatedGroups);
KVQ_INSTANTIATE_STREAM_SUITES(AllBackendsAndSchemes, KvStreamResidualTest, &IsKivi);
INSTANTIATE_TEST_SUITE_P(
    OutlierSchemes, KvStreamOutlierTest,
    ::testing::ValuesIn(testutil::StreamParamsWhere(
        [](const QuantSpec& s) { return s.has_outliers() && !s.rotate; })),
    ParamName);
INSTANTIATE_TEST_SUITE_P(Bf16, KvStreamBf16Test,
                         ::testing::ValuesIn(testutil::StreamParamsWhere(
                             [](const QuantSpec& s) { return s.kind == SchemeKind::kBf16; })),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Fp8, KvStreamFp8Test,
                         ::testing::ValuesIn(testutil::StreamParamsWhere(
                             [](const QuantSpec& s) { return s.kind == SchemeKind::kFp8E4m3; })),
                         ParamName);

// nuq with uniform levels is plain kivi: the same stored values.
TEST(KvStreamNuqTest, UniformCodebookEqualsUniformKivi) {
  for (const std::string& backend : testutil::BackendNames()) {
    const KernelBackend* b = *BackendByName(backend);
    StreamConfig plain;
    plain.spec = *QuantSpec::Parse("kivi3");
    plain.head_dim = 64;
    StreamConfig nuq = plain;
    nuq.spec.nuq = true;
    const Codebook cb = Codebook::Uniform(3, 64);
    auto a = KvStream::Create(plain, b);
    auto c = KvStream::Create(nuq, b, nullptr, &cb);
    ASSERT_TRUE(a.ok() && c.ok());
    const int n = 300;
    const std::vector<float> k = testutil::MakeKeys(n, 64, 4), v = testutil::MakeValues(n, 64, 4);
    ASSERT_TRUE(AppendRows(**a, k, v, 0, n).ok());
    ASSERT_TRUE(AppendRows(**c, k, v, 0, n).ok());
    for (Side side : {Side::kKey, Side::kValue}) {
      const std::vector<float> x = ReadSide(**a, side, 0, n), y = ReadSide(**c, side, 0, n);
      const std::vector<float>& in = side == Side::kKey ? k : v;
      int differ = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        // The same code: the two agree up to the fp16 rounding of the levels
        // and of the scale (range vs range / 7), far below a step.
        if (std::fabs(x[i] - y[i]) <= 0.05) continue;
        ++differ;
        // Rounding to the nearest level and rounding (x - zero) / scale may
        // only disagree on a tie: the input halfway between the two answers.
        const double mid = 0.5 * (double{x[i]} + y[i]);
        EXPECT_LE(std::fabs(RoundToHalf(in[i]) - mid), 0.02 * std::fabs(x[i] - y[i]))
            << backend << " element " << i << ": kivi3 " << x[i] << ", nuq(uniform) " << y[i]
            << ", input " << in[i];
      }
      EXPECT_LT(differ, static_cast<int>(x.size() / 200)) << backend;
    }
  }
}

}  // namespace
}  // namespace kvq
