// Raw pages: CopyPages on one stream, AppendPages on another, as a client
// library that quantizes locally and a server that validates would (the
// server reading them from the slices they arrived in).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/byte_reader.h"
#include "tests/unit/test_util.h"

namespace kvq {
namespace {

using testutil::StreamParam;

bool TakesPages(const QuantSpec& s) { return s.kind != SchemeKind::kFp8E4m3; }

// The error of a page set whose second page has an infinite first value
// scale (or p8 scale step).
void ExpectPage1ValueScaleNamed(const absl::Status& st, const PageLayout& L) {
  ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(L.value.param_bits == 8
                                  ? "page 1 value block 0: scale step must be finite and >= 0"
                                  : "page 1 value row 0"),
            absl::string_view::npos)
      << st;
}

class RawPagesTest : public ::testing::TestWithParam<StreamParam> {};

TEST_P(RawPagesTest, CopiedPagesAppendToAnEquivalentStream) {
  std::unique_ptr<KvStream> src = testutil::MakeStream(GetParam());
  std::unique_ptr<KvStream> dst = testutil::MakeStream(GetParam());
  const int d = src->head_dim();
  const QuantSpec& spec = src->spec();
  const int n = spec.sink + 3 * std::max(spec.flush_tokens(), 64) + 5;
  std::vector<float> k = testutil::MakeKeys(n, d, 31);
  std::vector<float> v = testutil::MakeValues(n, d, 32);
  ASSERT_TRUE(testutil::AppendRows(*src, k, v, 0, n).ok());
  // The destination takes the sink as rows, the quantized part as pages,
  // the tail as rows again.
  ASSERT_TRUE(testutil::AppendRows(*dst, k, v, 0, spec.sink).ok());
  ASSERT_TRUE(dst->AcceptsPages());
  const int q = src->quantized_tokens();
  std::vector<uint8_t> wire(static_cast<size_t>(src->PagesFor(q)) * src->layout().page_bytes);
  ASSERT_TRUE(src->CopyPages(0, q, wire.data()).ok());
  absl::Status st = dst->AppendPages(wire.data(), q);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(testutil::AppendRows(*dst, k, v, spec.sink + q, n).ok());
  for (Side side : {Side::kKey, Side::kValue}) {
    EXPECT_EQ(testutil::ReadSide(*dst, side, 0, n), testutil::ReadSide(*src, side, 0, n));
  }
  EXPECT_EQ(dst->AllocatedBytes(), src->AllocatedBytes());
}

// A stream of `p` holding the sink, three flush blocks (at least 64 tokens
// each) and 5 tokens more, of synthetic K/V.
std::unique_ptr<KvStream> ThreeBlocksAndATail(const StreamParam& p, uint64_t seed) {
  std::unique_ptr<KvStream> s = testutil::MakeStream(p);
  const int d = s->head_dim();
  const QuantSpec& spec = s->spec();
  const int n = spec.sink + 3 * std::max(spec.flush_tokens(), 64) + 5;
  EXPECT_TRUE(testutil::AppendRows(*s, testutil::MakeKeys(n, d, seed),
                                   testutil::MakeValues(n, d, seed + 1), 0, n)
                  .ok());
  return s;
}

// AppendPagesTo writes CopyPages' bytes after what the string holds, for a
// whole range and one starting at a later page, and refuses CopyPages'
// invalid ranges with its message, leaving the string as it was.
TEST_P(RawPagesTest, AppendedPagesAreTheCopiedPages) {
  std::unique_ptr<KvStream> src = ThreeBlocksAndATail(GetParam(), 35);
  const int q = src->quantized_tokens();
  const int pt = src->layout().page_tokens;
  const size_t page_bytes = src->layout().page_bytes;
  for (const int begin : {0, q > pt ? pt : 0}) {
    std::vector<uint8_t> copied(static_cast<size_t>(src->PagesFor(q - begin)) * page_bytes);
    ASSERT_TRUE(src->CopyPages(begin, q, copied.data()).ok());
    std::string appended = "head";
    ASSERT_TRUE(src->AppendPagesTo(begin, q, &appended).ok());
    ASSERT_EQ(appended.size(), 4 + copied.size());
    EXPECT_EQ(appended.substr(0, 4), "head");
    EXPECT_EQ(std::memcmp(appended.data() + 4, copied.data(), copied.size()), 0)
        << "pages from token " << begin;
  }
  for (const auto& [begin, end] : {std::pair{0, q + 1}, std::pair{-pt, q}, std::pair{1, q}}) {
    if (begin == 1 && pt == 1) continue;  // Every token starts a page.
    std::string out = "kept";
    std::vector<uint8_t> unused(static_cast<size_t>(src->PagesFor(q + pt)) * page_bytes);
    const absl::Status copied = src->CopyPages(begin, end, unused.data());
    const absl::Status appended = src->AppendPagesTo(begin, end, &out);
    EXPECT_EQ(appended.code(), absl::StatusCode::kOutOfRange) << appended;
    EXPECT_EQ(appended, copied);
    EXPECT_EQ(out, "kept");
  }
}

// `bytes` cut into runs at sizes that cycle through `cuts`, each run in a
// buffer of its own at an odd address, followed by 0xff bytes (a received
// message's slices fall anywhere, pages in them lie at any address, and a
// read past a run's end must not find the next one).
struct CutBytes {
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<ByteReader::Run> runs;
};
CutBytes CutInto(const std::vector<uint8_t>& bytes, const std::vector<size_t>& cuts) {
  CutBytes out;
  size_t at = 0;
  for (size_t i = 0; at < bytes.size(); ++i) {
    const size_t n = std::min(cuts[i % cuts.size()], bytes.size() - at);
    std::vector<uint8_t> buffer(1 + n + 64, 0xff);
    std::memcpy(buffer.data() + 1, bytes.data() + at, n);
    out.buffers.push_back(std::move(buffer));
    at += n;
  }
  for (const std::vector<uint8_t>& buffer : out.buffers) {
    out.runs.emplace_back(buffer.data() + 1, buffer.size() - 65);
  }
  return out;
}

// VisitPages visits CopyPages' pages in order, and says which are full:
// every page of the range but a last one that the quantized tokens fill in
// part.
TEST_P(RawPagesTest, VisitedPagesAreTheCopiedPagesAndTheLastMayBePartial) {
  std::unique_ptr<KvStream> src = ThreeBlocksAndATail(GetParam(), 41);
  const int q = src->quantized_tokens();
  const int pt = src->layout().page_tokens;
  const size_t page_bytes = src->layout().page_bytes;
  std::vector<uint8_t> copied(static_cast<size_t>(src->PagesFor(q)) * page_bytes);
  ASSERT_TRUE(src->CopyPages(0, q, copied.data()).ok());
  std::vector<uint8_t> visited;
  std::vector<bool> full;
  ASSERT_TRUE(src->VisitPages(0, q, [&](const uint8_t* page, bool is_full) {
                    visited.insert(visited.end(), page, page + page_bytes);
                    full.push_back(is_full);
                  }).ok());
  EXPECT_EQ(visited, copied);
  ASSERT_EQ(full.size(), static_cast<size_t>(src->PagesFor(q)));
  for (size_t i = 0; i < full.size(); ++i) {
    // Pages the host cannot address are visited as staged copies, which a
    // reader must copy: never full.
    EXPECT_EQ(full[i], src->allocator()->host_accessible() && static_cast<int>(i + 1) * pt <= q)
        << "page " << i << " of " << q
                                                          << " tokens, " << pt << " per page";
  }
  EXPECT_EQ(src->VisitPages(1, q, [](const uint8_t*, bool) {}).code(),
            pt == 1 ? absl::StatusCode::kOk : absl::StatusCode::kOutOfRange);
}

// AppendPages reads pages cut anywhere across runs exactly as it reads them
// whole; a run set too short for the tokens is refused, nothing stored.
TEST_P(RawPagesTest, PagesCutAcrossRunsAppendAsWhole) {
  std::unique_ptr<KvStream> src = testutil::MakeStream(GetParam());
  const int d = src->head_dim();
  const QuantSpec& spec = src->spec();
  const int n = spec.sink + 3 * std::max(spec.flush_tokens(), 64);
  std::vector<float> k = testutil::MakeKeys(n, d, 43);
  std::vector<float> v = testutil::MakeValues(n, d, 44);
  ASSERT_TRUE(testutil::AppendRows(*src, k, v, 0, n).ok());
  const int q = src->quantized_tokens();
  const size_t page_bytes = src->layout().page_bytes;
  std::vector<uint8_t> wire(static_cast<size_t>(src->PagesFor(q)) * page_bytes);
  ASSERT_TRUE(src->CopyPages(0, q, wire.data()).ok());
  for (const std::vector<size_t>& cuts :
       {std::vector<size_t>{1, 7, 0, page_bytes - 1}, std::vector<size_t>{page_bytes + 3},
        std::vector<size_t>{page_bytes}, std::vector<size_t>{wire.size()}}) {
    std::unique_ptr<KvStream> dst = testutil::MakeStream(GetParam());
    ASSERT_TRUE(testutil::AppendRows(*dst, k, v, 0, spec.sink).ok());
    const CutBytes cut = CutInto(wire, cuts);
    absl::Status st = dst->AppendPages(ByteReader(cut.runs), q);
    ASSERT_TRUE(st.ok()) << st << " with " << cut.runs.size() << " runs";
    std::vector<uint8_t> stored(wire.size());
    ASSERT_TRUE(dst->CopyPages(0, q, stored.data()).ok());
    EXPECT_EQ(stored, wire) << cut.runs.size() << " runs";
    EXPECT_EQ(dst->num_tokens(), n);
  }
  std::unique_ptr<KvStream> dst = testutil::MakeStream(GetParam());
  ASSERT_TRUE(testutil::AppendRows(*dst, k, v, 0, spec.sink).ok());
  const ByteBreakdown before = dst->AllocatedBytes();
  const ByteReader::Run short_run(wire.data(), wire.size() - 1);
  absl::Status st = dst->AppendPages(ByteReader({&short_run, 1}), q);
  EXPECT_EQ(st, absl::InvalidArgumentError(absl::StrCat("raw pages: ", q, " tokens take ",
                                                          wire.size(), " bytes, only ",
                                                          wire.size() - 1, " given")));
  EXPECT_EQ(dst->num_tokens(), spec.sink);
  EXPECT_EQ(dst->AllocatedBytes(), before);
}

// The corruption cases below are written for scaled pages (kivi, int8) and,
// where stated, fp16 pages.
bool HasScaledPages(const QuantSpec& s) { return s.is_kivi() || s.kind == SchemeKind::kInt8; }
bool HasScaledOrFp16Pages(const QuantSpec& s) {
  return HasScaledPages(s) || s.kind == SchemeKind::kFp16;
}
class RawPagesScaledOrFp16Test : public RawPagesTest {};
class RawPagesScaledTest : public RawPagesTest {};

TEST_P(RawPagesScaledOrFp16Test, CorruptPagesAreRejectedAndNothingIsStored) {
  std::unique_ptr<KvStream> src = testutil::MakeStream(GetParam());
  const QuantSpec& spec = src->spec();
  std::unique_ptr<KvStream> dst = testutil::MakeStream(GetParam());
  const int d = src->head_dim();
  const int n = spec.sink + 2 * std::max(spec.flush_tokens(), 64);
  std::vector<float> k = testutil::MakeKeys(n, d, 33);
  std::vector<float> v = testutil::MakeValues(n, d, 34);
  ASSERT_TRUE(testutil::AppendRows(*src, k, v, 0, n).ok());
  ASSERT_TRUE(testutil::AppendRows(*dst, k, v, 0, spec.sink).ok());
  const int q = src->quantized_tokens();
  const PageLayout& L = src->layout();
  std::vector<uint8_t> wire(static_cast<size_t>(src->PagesFor(q)) * L.page_bytes);
  ASSERT_TRUE(src->CopyPages(0, q, wire.data()).ok());
  // An infinite fp16 value in the second page's value side.
  uint8_t* page1 = wire.data() + L.page_bytes;
  const uint16_t inf = 0x7c00;
  if (L.value.axis == ParamAxis::kNone) {
    std::memcpy(PageLayout::CodeRow(page1, L.value, 0), &inf, 2);
  } else {
    // The first scale (fp16 parameters) or the scale step (p8 header).
    std::memcpy(L.ParamBlock(page1, L.value, 0), &inf, 2);
  }
  const ByteBreakdown before = dst->AllocatedBytes();
  absl::Status st = dst->AppendPages(wire.data(), q);
  ExpectPage1ValueScaleNamed(st, L);
  EXPECT_EQ(dst->num_tokens(), spec.sink);
  EXPECT_EQ(dst->AllocatedBytes(), before);
  // The same with the corrupt page cut between two runs: checked in a copy.
  const CutBytes cut = CutInto(wire, {L.page_bytes + 5});
  st = dst->AppendPages(ByteReader(cut.runs), q);
  ExpectPage1ValueScaleNamed(st, L);
  EXPECT_EQ(dst->num_tokens(), spec.sink);
  EXPECT_EQ(dst->AllocatedBytes(), before);
}

// Whatever bytes a client sends, AppendPages either rejects them
// (INVALID_ARGUMENT, the stream as it was) or stores pages whose every read
// is finite: the dequantized rows, and attention's output and log-sum-exp.
// Random bit flips anywhere in a valid page set (codes, parameters, p8
// headers, outlier tables, padding), seeded per case; under the sanitizer
// build (docs/DEVELOPING.md) this also checks that no read leaves its page.
TEST_P(RawPagesTest, RandomlyCorruptedPagesAreRejectedOrReadFinite) {
  std::unique_ptr<KvStream> src = testutil::MakeStream(GetParam());
  const QuantSpec& spec = src->spec();
  const int d = src->head_dim();
  const int n = spec.sink + 2 * std::max(spec.flush_tokens(), 64);
  std::vector<float> k = testutil::MakeKeys(n, d, 36);
  std::vector<float> v = testutil::MakeValues(n, d, 37);
  ASSERT_TRUE(testutil::AppendRows(*src, k, v, 0, n).ok());
  const int q = src->quantized_tokens();
  const PageLayout& L = src->layout();
  std::vector<uint8_t> wire(static_cast<size_t>(src->PagesFor(q)) * L.page_bytes);
  ASSERT_TRUE(src->CopyPages(0, q, wire.data()).ok());
  absl::StatusOr<const KernelBackend*> backend = BackendByName(GetParam().backend);
  ASSERT_TRUE(backend.ok()) << backend.status();
  // One query row per KV head (group 1) with a large norm, so that scores
  // over corrupted keys reach far from zero.
  std::vector<float> query(static_cast<size_t>(d));
  for (int c = 0; c < d; ++c) query[c] = (c % 3 == 0 ? 40.0f : -25.0f) + static_cast<float>(c);
  std::mt19937_64 rng(std::hash<std::string>()(testutil::StreamParamName(GetParam())));
  int accepted = 0;
  for (int trial = 0; trial < 40; ++trial) {
    std::unique_ptr<KvStream> dst = testutil::MakeStream(GetParam());
    ASSERT_TRUE(testutil::AppendRows(*dst, k, v, 0, spec.sink).ok());
    std::vector<uint8_t> bad = wire;
    const int flips = 1 + static_cast<int>(rng() % 6);
    for (int f = 0; f < flips; ++f) bad[rng() % bad.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    const ByteBreakdown before = dst->AllocatedBytes();
    const absl::Status st = dst->AppendPages(bad.data(), q);
    if (!st.ok()) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_EQ(dst->num_tokens(), spec.sink);
      EXPECT_EQ(dst->AllocatedBytes(), before);
      continue;
    }
    ++accepted;
    const int end = spec.sink + q;
    for (Side side : {Side::kKey, Side::kValue}) {
      const std::vector<float> rows = testutil::ReadSide(*dst, side, 0, end);
      for (size_t i = 0; i < rows.size(); ++i) {
        ASSERT_TRUE(std::isfinite(rows[i])) << "trial " << trial << " side " << static_cast<int>(side)
                                            << " element " << i << " = " << rows[i];
      }
    }
    std::vector<float> out(static_cast<size_t>(d), NAN);
    float lse = NAN;
    AttentionTask task;
    task.stream = dst.get();
    task.q = query.data();
    task.q_stride = d;
    task.out = out.data();
    task.out_stride = d;
    task.lse = &lse;
    task.lse_stride = 1;
    // Finite stored values can still overflow float attention (bf16 codes
    // up to 3.4e38): then the call fails rather than return NaN.
    const absl::Status att = (*backend)->Attend({&task, 1}, AttentionOptions());
    if (!att.ok()) {
      EXPECT_EQ(att.code(), absl::StatusCode::kOutOfRange) << att;
      continue;
    }
    EXPECT_TRUE(std::isfinite(lse)) << "trial " << trial;
    for (int c = 0; c < d; ++c) ASSERT_TRUE(std::isfinite(out[c])) << "trial " << trial << " c " << c;
  }
  // Scaled schemes see both outcomes; a flip in an fp16 or bf16 code that
  // stays finite is a different valid page, accepted.
  if (spec.kind == SchemeKind::kFp16 || spec.kind == SchemeKind::kBf16) EXPECT_GT(accepted, 0);
}

TEST_P(RawPagesTest, PagesOnlyAtABoundary) {
  std::unique_ptr<KvStream> s = testutil::MakeStream(GetParam());
  const QuantSpec& spec = s->spec();
  const int d = s->head_dim();
  std::vector<float> k = testutil::MakeKeys(spec.sink + 3, d, 35);
  std::vector<float> v = testutil::MakeValues(spec.sink + 3, d, 36);
  ASSERT_TRUE(testutil::AppendRows(*s, k, v, 0, spec.sink + 3).ok());
  std::vector<uint8_t> page(s->layout().page_bytes);
  absl::Status st = s->AppendPages(page.data(), spec.flush_tokens());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(s->num_tokens(), spec.sink + 3);
}

// Bytes of Read(begin, end) (or ReadPages of `wire`) in `dtype`, K then V.
// The outputs start `skew` bytes past a 64-byte line, with guard bytes
// around them that must stay as they were (streaming stores write whole
// lines).
std::vector<uint8_t> ReadBytes(const KvStream& s, const uint8_t* wire, int tokens, int first,
                               int begin, int end, DType dtype, bool apply_rope,
                               absl::Status* status, bool streaming = false, int skew = 0) {
  const int d = s.head_dim();
  const size_t side_bytes = static_cast<size_t>(end - begin) * d * DTypeBytes(dtype);
  constexpr size_t kGuard = 128;
  std::vector<uint8_t> buffer(kGuard + 64 + skew + 2 * side_bytes + kGuard, 0xAB);
  uint8_t* base = buffer.data() + kGuard;
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  uint8_t* out = base + skew;
  const TensorView k{out, dtype, end - begin, d, 0};
  const TensorView v{out + side_bytes, dtype, end - begin, d, 0};
  ReadOptions options;
  options.dtype = dtype;
  options.apply_rope = apply_rope;
  options.streaming_output = streaming;
  *status = wire == nullptr ? s.Read(begin, end, options, k, v)
                            : s.ReadPages(wire, tokens, first, begin, end, options, k, v);
  for (const uint8_t* p = buffer.data(); p < out; ++p) EXPECT_EQ(*p, 0xAB) << "before the outputs";
  for (const uint8_t* p = out + 2 * side_bytes; p < buffer.data() + buffer.size(); ++p) {
    EXPECT_EQ(*p, 0xAB) << "after the outputs";
  }
  return std::vector<uint8_t>(out, out + 2 * side_bytes);
}

// A stream holding the sink and `blocks` flush blocks (at least 64 tokens
// each) of synthetic K/V, and its quantized tokens as raw pages.
struct StoredPages {
  std::unique_ptr<KvStream> stream;
  std::vector<uint8_t> wire;
  int q = 0;  // Quantized tokens.
};
StoredPages StorePages(const StreamParam& p, int blocks, uint64_t seed) {
  StoredPages out;
  out.stream = testutil::MakeStream(p);
  const int d = out.stream->head_dim();
  const QuantSpec& spec = out.stream->spec();
  const int n = spec.sink +
                blocks * std::max({spec.flush_tokens(), 64, out.stream->layout().page_tokens});
  const std::vector<float> k = testutil::MakeKeys(n, d, seed);
  const std::vector<float> v = testutil::MakeValues(n, d, seed + 1);
  EXPECT_TRUE(testutil::AppendRows(*out.stream, k, v, 0, n).ok());
  out.q = out.stream->quantized_tokens();
  out.wire.resize(static_cast<size_t>(out.stream->PagesFor(out.q)) *
                  out.stream->layout().page_bytes);
  EXPECT_TRUE(out.stream->CopyPages(0, out.q, out.wire.data()).ok());
  return out;
}

TEST_P(RawPagesTest, ReadPagesEqualsReadOfTheStoredPages) {
  const StoredPages stored = StorePages(GetParam(), 3, 37);
  const KvStream* src = stored.stream.get();
  // An empty stream of the same config reads the pages without storing them.
  std::unique_ptr<KvStream> reader = testutil::MakeStream(GetParam());
  const int q = stored.q;
  const int first = src->page_base();
  ASSERT_GT(q, 0);
  const std::vector<uint8_t>& wire = stored.wire;
  const int pt = src->layout().page_tokens;
  // The whole range, one inside a page, one across a page boundary.
  const std::pair<int, int> ranges[] = {{first, first + q},
                                        {first + 1, first + std::min(q, 3)},
                                        {first + std::max(0, std::min(pt, q) - 2),
                                         first + std::min(q, pt + 3)}};
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (bool rope : {true, false}) {
      for (auto [b, e] : ranges) {
        absl::Status want_st, got_st;
        const std::vector<uint8_t> want =
            ReadBytes(*src, nullptr, 0, 0, b, e, dtype, rope, &want_st);
        ASSERT_TRUE(want_st.ok()) << want_st;
        // Streaming stores write the same bytes, wherever the outputs start.
        for (auto [streaming, skew] : {std::pair{false, 0}, std::pair{true, 0},
                                       std::pair{true, 16}, std::pair{true, 50}}) {
          const std::vector<uint8_t> got = ReadBytes(*reader, wire.data(), q, first, b, e, dtype,
                                                     rope, &got_st, streaming, skew);
          ASSERT_TRUE(got_st.ok()) << got_st;
          EXPECT_EQ(got, want) << DTypeName(dtype) << " rope " << rope << " [" << b << ", " << e
                               << ") streaming " << streaming << " skew " << skew;
        }
      }
    }
  }
  EXPECT_EQ(reader->num_tokens(), 0);
}

TEST_P(RawPagesScaledTest, ReadPagesChecksThePagesItReadsAndTheRange) {
  StoredPages stored = StorePages(GetParam(), 2, 39);
  const KvStream* src = stored.stream.get();
  const QuantSpec& spec = src->spec();
  std::unique_ptr<KvStream> reader = testutil::MakeStream(GetParam());
  const PageLayout& L = src->layout();
  const int q = stored.q;
  ASSERT_GT(src->PagesFor(q), 1);
  std::vector<uint8_t>& wire = stored.wire;
  const uint16_t inf = 0x7c00;
  std::memcpy(L.ParamBlock(wire.data() + L.page_bytes, L.value, 0), &inf, 2);
  const int first = src->page_base();
  absl::Status st;
  // The first page alone is intact.
  ReadBytes(*reader, wire.data(), q, first, first, first + L.page_tokens, DType::kFloat32, true,
            &st);
  EXPECT_TRUE(st.ok()) << st;
  ReadBytes(*reader, wire.data(), q, first, first, first + q, DType::kFloat32, true, &st);
  ExpectPage1ValueScaleNamed(st, L);
  ReadBytes(*reader, wire.data(), q, first, first, first + q + 1, DType::kFloat32, true, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_EQ(st.message(), absl::StrCat("token range [", first, ", ", first + q + 1,
                                       ") is not inside the pages' [", first, ", ", first + q,
                                       ")"));
}

// DequantizeRowsHalf, where a backend has it, is FloatToRow(fp16) of
// DequantizeRows for every row range of every page.
TEST_P(RawPagesTest, HalfRowsAreTheFloatRowsRounded) {
  const StoredPages stored = StorePages(GetParam(), 2, 41);
  const KvStream* s = stored.stream.get();
  absl::StatusOr<const KernelBackend*> backend = BackendByName(GetParam().backend);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const KernelBackend& b = **backend;
  const int d = s->head_dim();
  const int q = stored.q;
  const int pt = s->layout().page_tokens;
  const std::vector<uint8_t>& wire = stored.wire;
  const size_t stride = static_cast<size_t>(d) + 8;  // Rows apart, as in a wider tensor.
  for (Side side : {Side::kKey, Side::kValue}) {
    for (int page = 0; page < s->PagesFor(q); ++page) {
      const uint8_t* p = wire.data() + static_cast<size_t>(page) * s->layout().page_bytes;
      const int rows = std::min(pt, q - page * pt);
      for (auto [row0, count] : {std::pair{0, rows}, std::pair{1, std::min(3, rows - 1)}}) {
        if (count <= 0) continue;
        std::vector<uint16_t> half(count * stride, 0xFFFF);
        if (!b.DequantizeRowsHalf(*s, side, p, row0, count, half.data(), stride)) {
          EXPECT_EQ(half, std::vector<uint16_t>(count * stride, 0xFFFF)) << "wrote and declined";
          continue;
        }
        std::vector<float> f(static_cast<size_t>(count) * d);
        b.DequantizeRows(*s, side, p, row0, count, f.data());
        std::vector<uint16_t> want(count * stride, 0xFFFF);
        for (int r = 0; r < count; ++r) {
          FloatToRow(f.data() + static_cast<size_t>(r) * d, d, DType::kFloat16,
                     want.data() + r * stride);
        }
        EXPECT_EQ(half, want) << "page " << page << " rows " << row0 << "+" << count;
      }
    }
  }
}

KVQ_INSTANTIATE_STREAM_SUITES(All, RawPagesTest, &TakesPages);
KVQ_INSTANTIATE_STREAM_SUITES(All, RawPagesScaledOrFp16Test, &HasScaledOrFp16Pages);
KVQ_INSTANTIATE_STREAM_SUITES(All, RawPagesScaledTest, &HasScaledPages);

}  // namespace
}  // namespace kvq
