// Chunking of prompts and client-side quantization into raw pages.
#include "client/append_plan.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/local_sequence.h"
#include "gtest/gtest.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

// Checks that `chunks` cover every (layer, token) of layers x tokens exactly
// once, layer-major with each layer's tokens in order.
void ExpectExactCover(const std::vector<ChunkRange>& chunks, int layers, int tokens) {
  std::vector<int> next_token(layers, 0);
  for (const ChunkRange& c : chunks) {
    ASSERT_GT(c.layers, 0);
    ASSERT_GT(c.tokens, 0);
    ASSERT_GE(c.layer_begin, 0);
    ASSERT_LE(c.layer_begin + c.layers, layers);
    for (int l = c.layer_begin; l < c.layer_begin + c.layers; ++l) {
      ASSERT_EQ(next_token[l], c.token_begin) << "layer " << l << " out of order or overlapping";
      next_token[l] += c.tokens;
    }
  }
  for (int l = 0; l < layers; ++l) EXPECT_EQ(next_token[l], tokens) << "layer " << l;
}

TEST(PlanChunksTest, LargePromptSplitsAlongTokensWithinOneLayer) {
  // 32 layers x 8 kv heads x 4096 tokens x 128 dims of fp16: K+V is 4 KiB
  // per token and layer, 16 MiB per layer; 1 MiB chunks hold 256 tokens.
  const int64_t token_bytes = 2 * 8 * 128 * 2;
  const std::vector<ChunkRange> chunks = PlanChunks(32, 4096, 1, token_bytes, 1 << 20);
  EXPECT_EQ(chunks.size(), 32u * 16u);
  for (const ChunkRange& c : chunks) {
    EXPECT_EQ(c.layers, 1);
    EXPECT_EQ(c.tokens, 256);
  }
  ExpectExactCover(chunks, 32, 4096);
}

TEST(PlanChunksTest, SmallLayersAreGroupedWholeIntoChunks) {
  // 100 tokens x 1 KiB = 100 KiB per layer: 10 whole layers per 1 MiB chunk.
  const std::vector<ChunkRange> chunks = PlanChunks(32, 100, 1, 1024, 1 << 20);
  ASSERT_EQ(chunks.size(), 4u);  // 10 + 10 + 10 + 2 layers.
  EXPECT_EQ(chunks[0].layers, 10);
  EXPECT_EQ(chunks[3].layers, 2);
  for (const ChunkRange& c : chunks) EXPECT_EQ(c.tokens, 100);
  ExpectExactCover(chunks, 32, 100);
}

TEST(PlanChunksTest, CoversExactlyAndRespectsTheLimitAcrossASweep) {
  for (int layers : {1, 3, 7}) {
    for (int tokens : {1, 5, 64, 129, 1000}) {
      for (int unit : {1, 32, 128}) {
        for (int64_t max_bytes : {int64_t{1}, int64_t{100}, int64_t{4096}, int64_t{1} << 20}) {
          const int64_t unit_bytes = 40;
          SCOPED_TRACE(testing::Message() << layers << " layers, " << tokens << " tokens, unit "
                                          << unit << ", max " << max_bytes);
          const std::vector<ChunkRange> chunks =
              PlanChunks(layers, tokens, unit, unit_bytes, max_bytes);
          ExpectExactCover(chunks, layers, tokens);
          for (const ChunkRange& c : chunks) {
            const int64_t units = (c.tokens + unit - 1) / unit;
            // Within the limit, or a single unit of a single layer.
            EXPECT_TRUE(c.layers * units * unit_bytes <= max_bytes || (c.layers == 1 && units == 1));
            // Token splits fall on unit boundaries.
            EXPECT_EQ(c.token_begin % unit, 0);
          }
        }
      }
    }
  }
  EXPECT_TRUE(PlanChunks(0, 10, 1, 1, 100).empty());
  EXPECT_TRUE(PlanChunks(4, 0, 1, 1, 100).empty());
}

// A deterministic prompt [layers, heads, tokens, d]: keys with a few large
// channels and an offset (like real keys), values N(0, 1).
struct Prompt {
  HostTensor k, v;
};

Prompt MakePrompt(int layers, int heads, int tokens, int d, uint32_t seed,
                  DType dtype = DType::kFloat32) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const size_t count = static_cast<size_t>(layers) * heads * tokens * d;
  std::vector<float> k(count), v(count);
  for (size_t i = 0; i < count; ++i) {
    const int c = static_cast<int>(i % d);
    k[i] = n(rng) * (c % 17 == 3 ? 8.0f : 1.0f) + (c % 5 == 0 ? 2.0f : 0.0f);
    v[i] = n(rng);
  }
  const std::vector<int64_t> shape = {layers, heads, tokens, d};
  return {*HostTensor::FromFloats(k, shape, dtype), *HostTensor::FromFloats(v, shape, dtype)};
}

// Tokens [begin, end) of a prompt as one dense chunk.
v1::KvChunk DenseChunk(const Prompt& p, int begin, int end) {
  v1::KvChunk c;
  const ChunkRange r{0, static_cast<int>(p.k.shape[0]), begin, end - begin};
  ToProto(SliceKv(p.k, r, p.k.dtype), c.mutable_k());
  ToProto(SliceKv(p.v, r, p.v.dtype), c.mutable_v());
  return c;
}

TEST(DensePlanTest, ChunksReassembleToThePrompt) {
  const Prompt p = MakePrompt(3, 2, 300, 64, 1);
  const int64_t token_bytes = 2 * 2 * 64 * 2;  // K+V fp16, one layer.
  PlanOptions options;
  options.max_chunk_bytes = 100 * token_bytes;  // Forces token splits.
  options.layer_begin = 5;
  absl::StatusOr<AppendPlan> plan = PlanDenseAppend(p.k, p.v, DType::kFloat16, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->chunks.size(), 9u);  // 3 layers x 3 chunks of 100 tokens.
  EXPECT_EQ(plan->total_bytes, 3 * 300 * token_bytes);
  std::vector<ChunkRange> ranges;
  // The chunks carry fp16 copies of exactly their rectangle.
  const std::vector<uint16_t> kbits = p.k.ToFp16Bits();
  ChunkBuilder builder(p.k, p.v, *plan, options);
  for (const PlannedChunk& c : plan->chunks) {
    ranges.push_back(c.range);
    absl::StatusOr<v1::KvChunk> chunk = builder.Build(c);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(chunk->layer_begin(), 5 + c.range.layer_begin);
    absl::StatusOr<HostTensor> k = FromProto(chunk->k());
    ASSERT_TRUE(k.ok()) << k.status();
    ASSERT_EQ(k->shape, (std::vector<int64_t>{c.range.layers, 2, c.range.tokens, 64}));
    EXPECT_EQ(static_cast<int64_t>(k->byte_size() * 2), c.payload_bytes);
    const std::vector<uint16_t> got = k->ToFp16Bits();
    for (int l = 0; l < c.range.layers; ++l) {
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < c.range.tokens; ++t) {
          for (int d = 0; d < 64; d += 21) {
            const size_t src = (((c.range.layer_begin + l) * 2 + h) * 300 + c.range.token_begin + t) * 64 + d;
            const size_t dst = ((l * 2 + h) * c.range.tokens + t) * 64 + d;
            ASSERT_EQ(got[dst], kbits[src]);
          }
        }
      }
    }
  }
  ExpectExactCover(ranges, 3, 300);
}

TEST(DensePlanTest, RejectsMismatchedTensors) {
  const Prompt p = MakePrompt(2, 2, 10, 32, 2);
  const Prompt q = MakePrompt(2, 2, 11, 32, 2);
  EXPECT_EQ(PlanDenseAppend(p.k, q.v, DType::kFloat16, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  HostTensor flat = p.k;
  flat.shape = {2 * 2 * 10 * 32};
  EXPECT_EQ(PlanDenseAppend(flat, flat, DType::kFloat16, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A sequence of `layers` x `heads` KV heads (as many query heads).
SequenceConfig SequenceOf(const std::string& scheme, int layers, int heads, int head_dim = 64) {
  SequenceConfig seq;
  seq.scheme = scheme;
  seq.layout = {layers, heads, heads, head_dim, {}};
  return seq;
}

StreamConfig ConfigOf(const std::string& scheme, int head_dim) {
  absl::StatusOr<StreamConfig> c = SequenceOf(scheme, 1, 1, head_dim).ToStreamConfig();
  EXPECT_TRUE(c.ok()) << scheme << ": " << c.status();
  return *c;
}

TEST(SplitForPagesTest, SinkPagesAndTail) {
  // kivi2 r128 sink 4: flush 128, pages of 32 tokens.
  const StreamConfig kivi = ConfigOf("kivi2:g32:r128:sink=4", 64);
  absl::StatusOr<QuantizedSplit> s = SplitForPages(kivi, 0, 1000);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->dense_head, 4);
  EXPECT_EQ(s->paged, 896);  // 7 flush blocks.
  EXPECT_EQ(s->dense_tail, 100);
  EXPECT_EQ(s->block_tokens, 128);
  EXPECT_EQ(s->page_tokens, 32);
  // A sequence already holding the sink and 3 blocks starts on a boundary.
  s = SplitForPages(kivi, 4 + 3 * 128, 300);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->dense_head, 0);
  EXPECT_EQ(s->paged, 256);
  EXPECT_EQ(s->dense_tail, 44);
  // 6 tokens into a block: 122 dense tokens fill it first.
  s = SplitForPages(kivi, 10, 300);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->dense_head, 122);
  EXPECT_EQ(s->paged, 128);
  EXPECT_EQ(s->dense_tail, 50);
  // Too short for a page: all dense.
  s = SplitForPages(kivi, 0, 100);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->dense_head + s->dense_tail, 100);
  EXPECT_EQ(s->paged, 0);
}

TEST(SplitForPagesTest, FlushBlocksSmallerThanAPageAlignToPages) {
  // g8 r0: flush 8 tokens, pages of 32: pages start on a multiple of 32.
  const StreamConfig c = ConfigOf("kivi2:g8:r0", 64);
  absl::StatusOr<QuantizedSplit> s = SplitForPages(c, 8, 100);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->dense_head, 24);
  EXPECT_EQ(s->paged, 72);
  EXPECT_EQ(s->dense_tail, 4);
}

TEST(SplitForPagesTest, PerTokenSchemesUsePageBlocksAndFp8StaysDense) {
  absl::StatusOr<QuantizedSplit> s = SplitForPages(ConfigOf("int8", 64), 0, 100);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->block_tokens, 32);
  EXPECT_EQ(s->dense_head, 0);
  EXPECT_EQ(s->paged, 96);
  EXPECT_EQ(s->dense_tail, 4);
  s = SplitForPages(ConfigOf("fp8_e4m3", 64), 0, 100);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->paged, 0);
  EXPECT_EQ(s->dense_head, 100);
  // An explicit block size the flush block does not divide is refused.
  EXPECT_EQ(SplitForPages(ConfigOf("kivi2:g32:r128", 64), 0, 100, 96).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// crq with a residual window keeps an fp16 tail like kivi: the server's
// block is the flush block (rN), not a page; crq r0 codes every token and
// uses page blocks.
TEST(SplitForPagesTest, CrqWithAResidualWindowUsesItsFlushBlock) {
  const StreamConfig crq = ConfigOf("crq3:r64:sink=4:pre_rope", 64);
  absl::StatusOr<QuantizedSplit> s = SplitForPages(crq, 0, 100);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->block_tokens, 64);
  EXPECT_EQ(s->dense_head, 4);
  EXPECT_EQ(s->paged, 64);
  EXPECT_EQ(s->dense_tail, 32);
  s = SplitForPages(ConfigOf("crq3:r0:pre_rope", 64), 0, 100);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->block_tokens, 32);
  EXPECT_EQ(s->paged, 96);
  EXPECT_EQ(s->dense_tail, 4);
}

TEST(PlaceTokensTest, CrqWithAResidualWindowHoldsAnFp16Tail) {
  TokenPlacement p = PlaceTokens(ConfigOf("crq3:r64:sink=4:pre_rope", 64), 100);
  EXPECT_EQ(p.sink, 4);
  EXPECT_EQ(p.quantized, 64);
  EXPECT_EQ(p.tail, 32);
  p = PlaceTokens(ConfigOf("crq3:r0:pre_rope", 64), 100);
  EXPECT_EQ(p.quantized, 100);
  EXPECT_EQ(p.tail, 0);
  p = PlaceTokens(ConfigOf("kivi2:g32:r128:sink=4", 64), 300);
  EXPECT_EQ(p.sink, 4);
  EXPECT_EQ(p.quantized, 256);
  EXPECT_EQ(p.tail, 40);
}

struct QuantCase {
  std::string scheme;
  int start_tokens;  // Tokens the sequence holds before the prompt.
  int tokens;
  int64_t max_chunk_bytes;
};

void PrintTo(const QuantCase& c, std::ostream* os) {
  *os << c.scheme << " from token " << c.start_tokens << ", " << c.tokens << " tokens, chunks <= "
      << c.max_chunk_bytes << " B";
}

std::string CaseName(const testing::TestParamInfo<QuantCase>& info) {
  std::string s = info.param.scheme + "_start" + std::to_string(info.param.start_tokens) + "_n" +
                  std::to_string(info.param.tokens) + "_max" +
                  std::to_string(info.param.max_chunk_bytes);
  for (char& c : s) {
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

class QuantizedAppendTest : public testing::TestWithParam<QuantCase> {};

// The quantized plan, applied chunk by chunk to a separate sequence (as the
// server applies an Append stream: AppendPages for pages, Append for rows),
// stores exactly what appending the floats directly stores.
TEST_P(QuantizedAppendTest, PagesDequantizeLikeAppendingTheFloats) {
  const QuantCase& qc = GetParam();
  constexpr int kLayers = 3, kHeads = 2, kDim = 64;
  SequenceConfig seq;
  seq.scheme = qc.scheme;
  seq.layout = {kLayers, kHeads, kHeads * 2, kDim, {}};
  seq.layout.rope.theta = 50000.0f;
  absl::StatusOr<StreamConfig> config = seq.ToStreamConfig();
  if (!config.ok() && config.status().message().find("codebook") != absl::string_view::npos) {
    seq.codebooks.assign(kLayers * kHeads, Codebook::Uniform(QuantSpec::Parse(qc.scheme)->bits, kDim));
    config = seq.ToStreamConfig();
  }
  ASSERT_TRUE(config.ok()) << config.status();

  const Prompt prefix = MakePrompt(kLayers, kHeads, qc.start_tokens, kDim, 11);
  const Prompt prompt = MakePrompt(kLayers, kHeads, qc.tokens, kDim, 12);
  absl::StatusOr<std::unique_ptr<LocalSequence>> direct = LocalSequence::Create(seq);
  absl::StatusOr<std::unique_ptr<LocalSequence>> wire = LocalSequence::Create(seq);
  ASSERT_TRUE(direct.ok() && wire.ok()) << direct.status();
  if (qc.start_tokens > 0) {
    ASSERT_TRUE((*direct)->ApplyChunk(DenseChunk(prefix, 0, qc.start_tokens)).ok());
    ASSERT_TRUE((*wire)->ApplyChunk(DenseChunk(prefix, 0, qc.start_tokens)).ok());
  }
  ASSERT_TRUE((*direct)->ApplyChunk(DenseChunk(prompt, 0, qc.tokens)).ok());

  PlanOptions options;
  options.max_chunk_bytes = qc.max_chunk_bytes;
  absl::StatusOr<AppendPlan> plan =
      PlanQuantizedAppend(prompt.k, prompt.v, *config, qc.start_tokens, 0, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const QuantizedSplit& split = plan->split;
  EXPECT_EQ(split.dense_head + split.paged + split.dense_tail, qc.tokens);
  int page_chunks = 0;
  std::vector<ChunkRange> ranges;
  ChunkBuilder builder(prompt.k, prompt.v, *plan, options, &seq);
  for (const PlannedChunk& c : plan->chunks) {
    absl::StatusOr<v1::KvChunk> chunk = builder.Build(c);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    if (c.kind == PlannedChunk::Kind::kPages) {
      ++page_chunks;
      ASSERT_TRUE(chunk->has_pages());
      EXPECT_EQ(chunk->pages().tokens() % split.block_tokens, 0);
      EXPECT_EQ(static_cast<int64_t>(chunk->pages().page_data().size()), c.payload_bytes);
    }
    const absl::Status st = (*wire)->ApplyChunk(*chunk);
    ASSERT_TRUE(st.ok()) << "chunk at layer " << c.range.layer_begin << " token "
                         << c.range.token_begin << ": " << st;
    ranges.push_back(c.range);
  }
  if (config->spec.kind != SchemeKind::kFp8E4m3 && split.paged > 0) EXPECT_GT(page_chunks, 0);
  // Dense head, pages and tail each cover every layer: three exact covers
  // laid end to end make one.
  std::vector<ChunkRange> merged;
  for (const ChunkRange& r : ranges) merged.push_back(r);
  ExpectExactCover(merged, kLayers, qc.tokens);

  const int total = qc.start_tokens + qc.tokens;
  ASSERT_EQ((*wire)->num_tokens(), total);
  for (bool rope : {false, true}) {
    ReadOptions read;
    read.apply_rope = rope;
    absl::StatusOr<FetchedKv> a = (*direct)->Read(0, total, read);
    absl::StatusOr<FetchedKv> b = (*wire)->Read(0, total, read);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    EXPECT_TRUE(a->k == b->k) << "keys differ";
    EXPECT_TRUE(a->v == b->v) << "values differ";
  }
  for (int l = 0; l < kLayers; ++l) {
    for (int h = 0; h < kHeads; ++h) {
      EXPECT_EQ((*wire)->stream(l, h).AllocatedBytes(), (*direct)->stream(l, h).AllocatedBytes());
      EXPECT_EQ((*wire)->stream(l, h).quantized_tokens(), (*direct)->stream(l, h).quantized_tokens());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Schemes, QuantizedAppendTest,
    testing::Values(QuantCase{"kivi2:g32:r128", 0, 700, 1 << 20},
                    QuantCase{"kivi2:g32:r128", 0, 700, 4096},
                    QuantCase{"kivi4:g32:r128:pre_rope:outliers=1:sink=4", 0, 600, 1 << 20},
                    QuantCase{"kivi4:g32:r128:pre_rope:outliers=1:sink=4", 2, 600, 6000},
                    QuantCase{"kivi4:g32:r128:pre_rope:outliers=1:sink=4", 300, 600, 1 << 20},
                    QuantCase{"kivi3:g32:r64:rotate:sink=2", 0, 500, 1 << 20},
                    QuantCase{"kivi2:g8:r0", 8, 200, 2000},
                    QuantCase{"kivi2:g32:r128:ktok", 0, 400, 1 << 20},
                    QuantCase{"kivi2:g32:r128:nuq", 0, 400, 1 << 20},
                    QuantCase{"kivi2:g32:r128", 0, 60, 1 << 20},
                    QuantCase{"kivi4:g64:r64:p8:pre_rope:sink=4", 0, 600, 1 << 20},
                    // p8 with flushes of half a page, from mid-stream.
                    QuantCase{"kivi2:g16:r16:p8:sink=4", 2, 300, 4096},
                    // Keys and values at different bits.
                    QuantCase{"kivi4:v2:g64:r64:p8:pre_rope:sink=4", 0, 600, 1 << 20},
                    QuantCase{"kivi2:v3:g16:r16:outliers=1", 2, 300, 4096},
                    QuantCase{"int8", 5, 150, 3000}, QuantCase{"fp16", 0, 100, 1 << 20},
                    QuantCase{"bf16", 0, 100, 1 << 20}, QuantCase{"fp8_e4m3", 0, 100, 1 << 20}),
    CaseName);

TEST(QuantizedAppendTest, ChunksDoNotDependOnTheThreadCount) {
  const Prompt p = MakePrompt(3, 3, 700, 64, 5);
  const SequenceConfig seq = SequenceOf("kivi2:g32:r128:outliers=1:sink=4", 3, 3);
  std::vector<std::string> wire[2];
  for (int i = 0; i < 2; ++i) {
    PlanOptions options;
    options.threads = i == 0 ? 1 : 4;
    absl::StatusOr<AppendPlan> plan =
        PlanQuantizedAppend(p.k, p.v, *seq.ToStreamConfig(), 0, 0, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ChunkBuilder builder(p.k, p.v, *plan, options, &seq);
    for (const PlannedChunk& c : plan->chunks) {
      absl::StatusOr<v1::KvChunk> chunk = builder.Build(c);
      ASSERT_TRUE(chunk.ok()) << chunk.status();
      wire[i].push_back(chunk->SerializeAsString());
    }
  }
  EXPECT_EQ(wire[0], wire[1]);
}

// LocalSequence::Read dequantizes streams on several threads: the same
// bytes for any count, including a large read that does use them.
TEST(LocalSequenceTest, ReadDoesNotDependOnTheThreadCount) {
  const Prompt p = MakePrompt(3, 3, 1000, 64, 6);  // 576k elements per side.
  const SequenceConfig seq = SequenceOf("kivi4:g32:r128:pre_rope:sink=4", 3, 3);
  absl::StatusOr<std::unique_ptr<LocalSequence>> local = LocalSequence::Create(seq);
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_TRUE((*local)->ApplyChunk(DenseChunk(p, 0, 1000)).ok());
  ReadOptions read;
  read.apply_rope = true;
  absl::StatusOr<FetchedKv> one = (*local)->Read(0, -1, read, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  for (int threads : {2, 5, 0}) {
    absl::StatusOr<FetchedKv> many = (*local)->Read(0, -1, read, threads);
    ASSERT_TRUE(many.ok()) << many.status();
    EXPECT_TRUE(many->k == one->k && many->v == one->v) << threads << " threads";
  }
  // A range past the end is still refused.
  EXPECT_EQ((*local)->Read(0, 1001, read, 4).status().code(), absl::StatusCode::kOutOfRange);
}

// ReadInto writes what Read returns into the caller's tensors, reused, and
// from a sequence whose pages come from a recycling allocator; a tensor of
// the wrong shape or dtype is named.
TEST(LocalSequenceTest, ReadIntoMatchesReadAndNamesABadTensor) {
  const Prompt p = MakePrompt(2, 3, 500, 64, 8);
  const SequenceConfig seq = SequenceOf("kivi2:g32:r128:sink=4", 2, 3);
  RecyclingPageAllocator pages;
  for (int round = 0; round < 2; ++round) {  // The second reuses the first's pages.
    absl::StatusOr<std::unique_ptr<LocalSequence>> local =
        LocalSequence::Create(seq, 0, -1, &CpuBackend(), &pages);
    ASSERT_TRUE(local.ok()) << local.status();
    ASSERT_TRUE((*local)->ApplyChunk(DenseChunk(p, 0, 500)).ok());
    ReadOptions read;
    read.dtype = DType::kFloat16;
    absl::StatusOr<FetchedKv> want = (*local)->Read(10, 490, read);
    ASSERT_TRUE(want.ok()) << want.status();
    HostTensor k = HostTensor::Zeros(DType::kFloat16, {2, 3, 480, 64});
    HostTensor v = HostTensor::Zeros(DType::kFloat16, k.shape);
    for (int rep = 0; rep < 2; ++rep) {
      const absl::Status st = (*local)->ReadInto(10, 490, read, &k, &v);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_TRUE(k == want->k && v == want->v) << "round " << round << " rep " << rep;
    }
    HostTensor bad = HostTensor::Zeros(DType::kFloat32, k.shape);
    absl::Status st = (*local)->ReadInto(10, 490, read, &k, &bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(), "v is [2, 3, 480, 64] fp32; the read needs [2, 3, 480, 64] fp16");
    st = (*local)->ReadInto(10, 491, read, &k, &v);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(), "k is [2, 3, 480, 64] fp16; the read needs [2, 3, 481, 64] fp16");
    EXPECT_EQ((*local)->ReadInto(10, 501, read, &k, &v).code(), absl::StatusCode::kOutOfRange);
  }
  EXPECT_GT(pages.cached_bytes(), 0u);
}

// Raw pages in another page geometry (a different page size or tokens per
// page) are refused by name on both the append and the fetch paths, and
// nothing of them is stored.
TEST(LocalSequenceTest, PagesOfAnotherGeometryAreRefusedAndNothingIsStored) {
  const Prompt p = MakePrompt(1, 2, 128, 64, 9);
  const SequenceConfig seq = SequenceOf("kivi2:g32:r128", 1, 2);
  PlanOptions options;
  absl::StatusOr<AppendPlan> plan =
      PlanQuantizedAppend(p.k, p.v, *seq.ToStreamConfig(), 0, 0, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ChunkBuilder builder(p.k, p.v, *plan, options, &seq);
  std::optional<v1::KvChunk> paged;
  for (const PlannedChunk& c : plan->chunks) {
    if (c.kind != PlannedChunk::Kind::kPages) continue;
    absl::StatusOr<v1::KvChunk> chunk = builder.Build(c);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    paged = *std::move(chunk);
  }
  ASSERT_TRUE(paged.has_value());
  const int64_t page_bytes = paged->pages().page_bytes();
  const int page_tokens = paged->pages().page_tokens();
  absl::StatusOr<std::unique_ptr<LocalSequence>> local = LocalSequence::Create(seq);
  ASSERT_TRUE(local.ok()) << local.status();

  v1::KvChunk wrong_size = *paged;
  wrong_size.mutable_pages()->set_page_bytes(page_bytes + 64);
  absl::Status st = (*local)->ApplyChunk(wrong_size);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), absl::StrCat("pages are ", page_bytes + 64, " bytes of ", page_tokens,
                                       " tokens; this sequence's pages are ", page_bytes,
                                       " bytes of ", page_tokens));

  v1::FetchResponse fetched;
  fetched.set_layer(0);
  fetched.set_token_begin(0);
  *fetched.mutable_pages() = paged->pages();
  fetched.mutable_pages()->set_page_tokens(page_tokens * 2);
  st = (*local)->ApplyFetched(fetched);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), absl::StrCat("pages are ", page_bytes, " bytes of ", page_tokens * 2,
                                       " tokens; this sequence's pages are ", page_bytes,
                                       " bytes of ", page_tokens));
  EXPECT_EQ((*local)->num_tokens(), 0);

  // The same pages in the right geometry are taken.
  ASSERT_TRUE((*local)->ApplyChunk(*paged).ok());
  EXPECT_EQ((*local)->num_tokens(), paged->pages().tokens());
}

TEST(QuantizedAppendTest, KiviPagesCarryTwoToFiveBitsPerElement) {
  const Prompt p = MakePrompt(2, 2, 2048, 128, 3);
  for (const char* scheme : {"kivi2:g32:r128", "kivi4:g32:r128"}) {
    absl::StatusOr<AppendPlan> plan =
        PlanQuantizedAppend(p.k, p.v, ConfigOf(scheme, 128), 0, 0, {});
    ASSERT_TRUE(plan.ok()) << plan.status();
    const double bits = 8.0 * plan->total_bytes / (2.0 * 2 * 2 * 2048 * 128);
    EXPECT_GE(bits, 2.0) << scheme;
    EXPECT_LE(bits, 5.0) << scheme;
  }
}

TEST(QuantizedAppendTest, LocalQuantizationErrorsNameLayerAndHead) {
  Prompt p = MakePrompt(2, 2, 300, 64, 4);
  std::vector<float> k = p.k.ToFloats();
  k[((1 * 2 + 1) * 300 + 200) * 64 + 5] = std::nanf("");  // Layer 1, head 1, token 200.
  p.k = *HostTensor::FromFloats(k, p.k.shape);
  const SequenceConfig seq = SequenceOf("kivi2:g32:r128", 2, 2);
  PlanOptions options;
  absl::StatusOr<AppendPlan> plan =
      PlanQuantizedAppend(p.k, p.v, *seq.ToStreamConfig(), 0, 0, options);
  ASSERT_TRUE(plan.ok());
  ChunkBuilder builder(p.k, p.v, *plan, options, &seq);
  absl::Status failure;
  for (const PlannedChunk& c : plan->chunks) {
    absl::StatusOr<v1::KvChunk> chunk = builder.Build(c);
    if (!chunk.ok()) {
      failure = chunk.status();
      break;
    }
  }
  EXPECT_EQ(failure.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(failure.message().find("layer 1 kv head 1"), absl::string_view::npos) << failure;
  EXPECT_NE(failure.message().find("not finite"), absl::string_view::npos) << failure;
}

}  // namespace
}  // namespace kvq
