// Fuzz target: validation of raw (client-quantized) pages, as Append of
// raw pages runs it (KvStream::AppendPages), and every reader of a page
// it accepts.
//
// Input (raw_page_input.h): [scheme][shape][tokens][cut] then the page
// bytes. scheme picks one of kPageSchemes; shape picks head_dim, the
// backend (the scalar reference or the SIMD one) and whether pages already
// precede; tokens how many tokens the pages claim; cut where the bytes are
// split into two runs (a page may straddle the received message's slices).
//
// Checked beyond "no crash, no sanitizer report":
//   - a refused append is INVALID_ARGUMENT (FAILED_PRECONDITION for
//     fp8_e4m3) and leaves the stream as it was;
//   - an accepted page reads back as finite fp32 values through Read(),
//     ReadPages() of the same bytes gives the same values, and attention
//     over the stream gives a finite output and log-sum-exp.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/byte_reader.h"
#include "kernels/kv_stream.h"
#include "kernels/quant_spec.h"
#include "kernels/stream_config.h"
#include "tests/fuzz/raw_page_input.h"

namespace {

[[noreturn]] void Fail(const std::string& what, const char* scheme) {
  std::fprintf(stderr, "raw_page_fuzz: %s (scheme %s)\n", what.c_str(), scheme);
  std::abort();
}

// A deterministic, ordinary-looking row for dense appends and queries.
std::vector<float> Rows(int n, int d, float phase) {
  std::vector<float> v(static_cast<size_t>(n) * d);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.37f * static_cast<float>(i) + phase);
  return v;
}

std::vector<float> ReadAll(const kvq::KvStream& s, int begin, int end, const char* scheme) {
  const int n = end - begin, d = s.head_dim();
  std::vector<float> out(static_cast<size_t>(n) * d * 2);
  kvq::ReadOptions ro;
  ro.dtype = kvq::DType::kFloat32;
  absl::Status st = s.Read(begin, end, ro, kvq::Floats(out.data(), n, d),
                           kvq::Floats(out.data() + static_cast<size_t>(n) * d, n, d));
  if (!st.ok()) Fail("Read of stored tokens failed: " + st.ToString(), scheme);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return -1;
  const char* scheme = kvq::fuzz::kPageSchemes[data[0] % kvq::fuzz::kNumPageSchemes];
  const kvq::fuzz::PageShape shape = kvq::fuzz::DecodePageShape(data[1]);
  const int head_dim = shape.head_dim;
  const kvq::KernelBackend& backend = *shape.backend;
  const bool prefill = shape.prefill;
  const uint8_t tokens_byte = data[2];
  const size_t cut = data[3];
  data += 4;
  size -= 4;

  kvq::StreamConfig config;
  absl::StatusOr<kvq::QuantSpec> spec = kvq::QuantSpec::Parse(scheme);
  if (!spec.ok()) Fail("scheme does not parse", scheme);
  config.spec = *spec;
  config.head_dim = head_dim;
  config.rope.rotary_dim = 0;  // All of head_dim.
  kvq::Codebook codebook;
  if (config.spec.nuq) {
    // Levels bunched towards the ends, as k-means leaves them.
    codebook = kvq::Codebook::Uniform(config.spec.bits, head_dim);
    for (float& l : codebook.key_levels) l = l * l;
    for (float& l : codebook.value_levels) l = std::sqrt(l);
  }
  absl::StatusOr<std::unique_ptr<kvq::KvStream>> created =
      kvq::KvStream::Create(config, &backend, nullptr, config.spec.nuq ? &codebook : nullptr);
  if (!created.ok()) Fail("stream creation failed: " + created.status().ToString(), scheme);
  kvq::KvStream& s = **created;

  // The sink, and with `prefill` one page of quantized tokens (whole
  // flushes: the tail stays empty), appended densely so that raw pages
  // follow stored ones.
  const int flush = config.spec.flush_tokens();
  const int pt = s.layout().page_tokens;
  const int dense = config.spec.sink + (prefill ? pt : 0);
  if (dense > 0) {
    std::vector<float> k = Rows(dense, head_dim, 0.1f), v = Rows(dense, head_dim, 0.7f);
    absl::Status st = s.Append(kvq::Floats(k.data(), dense, head_dim),
                               kvq::Floats(v.data(), dense, head_dim));
    if (!st.ok()) Fail("dense append failed: " + st.ToString(), scheme);
  }
  const int before = s.num_tokens();
  const int first = s.quantized_tokens();
  const kvq::ByteBreakdown bytes_before = s.AllocatedBytes();
  const std::vector<float> stored_before = ReadAll(s, 0, before, scheme);

  const int tokens = kvq::fuzz::DecodePageTokens(tokens_byte, flush, pt);
  const kvq::ByteReader::Run runs[2] = {{data, std::min(cut, size)},
                                        {data + std::min(cut, size), size - std::min(cut, size)}};
  kvq::ByteReader reader(runs);
  absl::Status st = s.AppendPages(reader, tokens);
  if (!st.ok()) {
    const absl::StatusCode want = config.spec.kind == kvq::SchemeKind::kFp8E4m3
                                      ? absl::StatusCode::kFailedPrecondition
                                      : absl::StatusCode::kInvalidArgument;
    if (st.code() != want) Fail("refusal is " + st.ToString(), scheme);
    if (s.num_tokens() != before || s.quantized_tokens() != first ||
        s.AllocatedBytes().total() != bytes_before.total()) {
      Fail("a refused append changed the stream", scheme);
    }
    if (ReadAll(s, 0, before, scheme) != stored_before) {
      Fail("a refused append changed stored tokens", scheme);
    }
    return 0;
  }
  if (s.num_tokens() != before + tokens) Fail("accepted pages miscount tokens", scheme);
  const int d = head_dim;

  // Every stored value reads back finite, the earlier ones unchanged.
  const std::vector<float> all = ReadAll(s, 0, s.num_tokens(), scheme);
  for (float x : all) {
    if (!std::isfinite(x)) Fail("an accepted page reads a non-finite value", scheme);
  }
  if (!std::equal(stored_before.begin(), stored_before.begin() + static_cast<size_t>(before) * d,
                  all.begin()) ||
      !std::equal(stored_before.begin() + static_cast<size_t>(before) * d, stored_before.end(),
                  all.begin() + static_cast<size_t>(s.num_tokens()) * d)) {
    Fail("accepted pages changed earlier tokens", scheme);
  }

  // ReadPages of the same bytes (contiguous) reads what Read() reads.
  const size_t page_bytes = static_cast<size_t>(s.PagesFor(tokens)) * s.layout().page_bytes;
  std::vector<uint8_t> contiguous(page_bytes);
  kvq::ByteReader(runs).Read(page_bytes, contiguous.data());
  const int pos = s.page_base() + first;  // Stream position of the raw pages' first token.
  std::vector<float> from_pages(static_cast<size_t>(tokens) * d * 2);
  kvq::ReadOptions ro;
  st = s.ReadPages(contiguous.data(), tokens, pos, pos, pos + tokens, ro,
                   kvq::Floats(from_pages.data(), tokens, d),
                   kvq::Floats(from_pages.data() + static_cast<size_t>(tokens) * d, tokens, d));
  if (!st.ok()) Fail("ReadPages refused accepted pages: " + st.ToString(), scheme);
  const std::vector<float> appended = ReadAll(s, pos, pos + tokens, scheme);
  if (std::memcmp(appended.data(), from_pages.data(), appended.size() * sizeof(float)) != 0) {
    Fail("ReadPages and Read disagree", scheme);
  }

  // Attention over everything stored, causal for the last query.
  const int n = s.num_tokens();
  const int queries = 2;
  std::vector<float> q = Rows(queries, d, 0.3f), out(static_cast<size_t>(queries) * d);
  std::vector<float> lse(queries);
  const int32_t positions[queries] = {n / 2, n - 1};
  kvq::AttentionTask task;
  task.stream = &s;
  task.key_begin = 0;
  task.key_end = n;
  task.num_queries = queries;
  task.q = q.data();
  task.q_stride = d;
  task.q_positions = positions;
  task.out = out.data();
  task.out_stride = d;
  task.lse = lse.data();
  task.lse_stride = 1;
  st = backend.Attend({&task, 1}, kvq::AttentionOptions{});
  if (!st.ok()) Fail("attention over accepted pages failed: " + st.ToString(), scheme);
  for (float x : out) {
    if (!std::isfinite(x)) Fail("attention output is not finite", scheme);
  }
  for (float x : lse) {
    if (!std::isfinite(x)) Fail("attention log-sum-exp is not finite", scheme);
  }
  return 0;
}
