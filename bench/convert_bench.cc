#include "bench/convert_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/smollm_prompt.h"
#include "client/append_plan.h"
#include "client/fetch_placer.h"
#include "client/local_sequence.h"
#include "kernels/malloc_tuning.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Times `fn` (warmup untimed calls, then reps timed ones) into a row.
absl::Status Time(const ConvertBenchOptions& o, ConvertRow* row,
                  const std::function<absl::Status()>& fn) {
  for (int i = 0; i < o.warmup + o.reps; ++i) {
    const Clock::time_point start = Clock::now();
    KVQ_RETURN_IF_ERROR(fn());
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    if (i >= o.warmup) row->seconds.push_back(s);
  }
  row->median_s = Median(row->seconds);
  return absl::OkStatus();
}

// The raw fetch messages of a sequence's quantized tokens, cut as the
// server cuts them: per layer, whole pages of every KV head, up to
// `chunk_bytes` per message.
std::vector<v1::FetchResponse> RawMessages(const LocalSequence& stored, int64_t chunk_bytes) {
  std::vector<v1::FetchResponse> out;
  const KvStream& s0 = stored.stream(stored.layer_begin(), 0);
  const PageLayout& layout = s0.layout();
  const int pt = layout.page_tokens;
  const int heads = stored.kv_heads();
  const int q = s0.quantized_tokens();
  const int pages_per_msg = static_cast<int>(
      std::max<int64_t>(1, chunk_bytes / (int64_t{heads} * static_cast<int64_t>(layout.page_bytes))));
  for (int l = stored.layer_begin(); l < stored.layer_begin() + stored.layers(); ++l) {
    for (int t = 0; t < q; t += pages_per_msg * pt) {
      const int n = std::min(q, t + pages_per_msg * pt) - t;
      v1::FetchResponse m;
      m.set_layer(l);
      m.set_token_begin(s0.page_base() + t);
      v1::QuantizedPages* p = m.mutable_pages();
      p->set_layers(1);
      p->set_tokens(n);
      p->set_page_bytes(static_cast<int64_t>(layout.page_bytes));
      p->set_page_tokens(pt);
      const size_t per = static_cast<size_t>(s0.PagesFor(n)) * layout.page_bytes;
      p->mutable_page_data()->resize(per * heads);
      auto* data = reinterpret_cast<uint8_t*>(p->mutable_page_data()->data());
      for (int h = 0; h < heads; ++h) (void)stored.stream(l, h).CopyPages(t, t + n, data + h * per);
      out.push_back(std::move(m));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<ConvertBenchResult> RunConvertBench(const ConvertBenchOptions& o,
                                                   std::ostream* progress) {
  // As the client does on Connect: message-sized buffers from the heap.
  (void)RetainMessageBuffers();
  ConvertBenchResult result;
  result.tokens = o.tokens;
  result.hardware_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const HostTensor k = smollm::MakeKv(smollm::kLayers, o.tokens, 1, /*keys=*/true);
  const HostTensor v = smollm::MakeKv(smollm::kLayers, o.tokens, 2, /*keys=*/false);
  result.fp16_bytes = static_cast<int64_t>(k.byte_size() + v.byte_size());
  const std::vector<int> thread_counts = {1, 0};  // 0: one per hardware thread.
  auto threads_of = [&](int t) { return t > 0 ? t : result.hardware_threads; };

  std::string buffer(static_cast<size_t>(result.fp16_bytes), '\1');
  const int64_t all = result.fp16_bytes;
  ConvertRow copy{"memcpy", "", "memcpy of the prompt's fp16 K+V (baseline)", 1, all, {}, 0.0};
  KVQ_RETURN_IF_ERROR(Time(o, &copy, [&] {
    std::memcpy(buffer.data(), k.bytes(), k.byte_size());
    std::memcpy(buffer.data() + k.byte_size(), v.bytes(), v.byte_size());
    return absl::OkStatus();
  }));
  ConvertRow fill{"memset", "", "memset of the same bytes (the writes alone)", 1, all,
                  {}, 0.0};
  KVQ_RETURN_IF_ERROR(Time(o, &fill, [&] {
    std::memset(buffer.data(), 0, buffer.size());
    return absl::OkStatus();
  }));
  result.rows = {copy, fill};

  for (const std::string& scheme : o.schemes) {
    SequenceConfig config;
    config.layout = smollm::Layout();
    config.scheme = scheme;
    KVQ_ASSIGN_OR_RETURN(const StreamConfig stream_config, config.ToStreamConfig());
    if (progress) *progress << "convert: " << scheme << "\n";
    for (int t : thread_counts) {
      PlanOptions plan_options;
      plan_options.max_chunk_bytes = o.chunk_bytes;
      plan_options.threads = t;
      KVQ_ASSIGN_OR_RETURN(const AppendPlan plan,
                           PlanQuantizedAppend(k, v, stream_config, 0, 0, plan_options));
      ConvertRow row{absl::StrCat(scheme, "_quantize_t", threads_of(t)), scheme,
                     "quantize the prompt into Append chunks", threads_of(t), all, {}, 0.0};
      KVQ_RETURN_IF_ERROR(Time(o, &row, [&]() -> absl::Status {
        ChunkBuilder builder(k, v, plan, plan_options, &config);
        for (const PlannedChunk& chunk : plan.chunks) {
          KVQ_RETURN_IF_ERROR(builder.Build(chunk).status());
        }
        return absl::OkStatus();
      }));
      result.rows.push_back(std::move(row));
    }

    // What the server would hold, and the raw messages it would send.
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<LocalSequence> stored, LocalSequence::Create(config));
    {
      PlanOptions plan_options;
      plan_options.max_chunk_bytes = o.chunk_bytes;
      KVQ_ASSIGN_OR_RETURN(const AppendPlan plan,
                           PlanQuantizedAppend(k, v, stream_config, 0, 0, plan_options));
      ChunkBuilder builder(k, v, plan, plan_options, &config);
      for (const PlannedChunk& chunk : plan.chunks) {
        KVQ_ASSIGN_OR_RETURN(const v1::KvChunk built, builder.Build(chunk));
        KVQ_RETURN_IF_ERROR(stored->ApplyChunk(built));
      }
    }
    const std::vector<v1::FetchResponse> messages = RawMessages(*stored, o.chunk_bytes);
    const KvStream& s0 = stored->stream(0, 0);
    const int first = s0.page_base(), q = s0.quantized_tokens();
    const int64_t paged = all / o.tokens * q;  // The quantized tokens' fp16 K+V.
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<LocalSequence> reader, LocalSequence::Create(config));
    ReadOptions read;
    read.dtype = DType::kFloat16;
    read.apply_rope = false;
    HostTensor k_out = HostTensor::Zeros(read.dtype, {smollm::kLayers, smollm::kKvHeads, q,
                                                      smollm::kHeadDim});
    HostTensor v_out = HostTensor::Zeros(read.dtype, k_out.shape);
    // FetchDequantLocalInto streams outputs this large past the caches
    // (FetchOptions::streaming_output_bytes); ordinary stores are timed
    // once beside it.
    auto dequantize = [&](int t, bool streaming, ConvertRow row) -> absl::Status {
      ReadOptions r = read;
      r.streaming_output = streaming;
      KVQ_RETURN_IF_ERROR(Time(o, &row, [&]() -> absl::Status {
        RawPagePlacer placer(*reader, r, first, first, first + q, first, &k_out, &v_out, t);
        for (const v1::FetchResponse& m : messages) KVQ_RETURN_IF_ERROR(placer.Place(m));
        return placer.CheckComplete();
      }));
      result.rows.push_back(std::move(row));
      return absl::OkStatus();
    };
    for (int t : thread_counts) {
      KVQ_RETURN_IF_ERROR(dequantize(
          t, true,
          ConvertRow{absl::StrCat(scheme, "_dequantize_t", threads_of(t)), scheme,
                     "dequantize raw pages into fp16 tensors", threads_of(t), paged, {}, 0.0}));
    }
    KVQ_RETURN_IF_ERROR(dequantize(
        1, false,
        ConvertRow{absl::StrCat(scheme, "_dequantize_cached_t1"), scheme,
                   "the same with ordinary (cached) stores", 1, paged, {}, 0.0}));
    // The same reads into one reused page-sized tile: the conversion
    // without the stream of output writes.
    const int pt = s0.layout().page_tokens;
    std::vector<uint16_t> tile(2 * static_cast<size_t>(pt) * smollm::kHeadDim);
    ConvertRow row{absl::StrCat(scheme, "_dequantize_tile_t1"), scheme,
                   "dequantize raw pages into one reused tile", 1, paged, {}, 0.0};
    KVQ_RETURN_IF_ERROR(Time(o, &row, [&]() -> absl::Status {
      for (const v1::FetchResponse& m : messages) {
        const int n = m.pages().tokens();
        const size_t per = static_cast<size_t>(s0.PagesFor(n)) * s0.layout().page_bytes;
        const auto* data = reinterpret_cast<const uint8_t*>(m.pages().page_data().data());
        for (int h = 0; h < smollm::kKvHeads; ++h) {
          for (int t = 0; t < n; t += pt) {
            const int rows = std::min(pt, n - t);
            const TensorView kt{tile.data(), read.dtype, rows, smollm::kHeadDim, 0};
            const TensorView vt{tile.data() + tile.size() / 2, read.dtype, rows,
                                smollm::kHeadDim, 0};
            KVQ_RETURN_IF_ERROR(reader->stream(m.layer(), h).ReadPages(
                data + h * per, n, m.token_begin(), m.token_begin() + t,
                m.token_begin() + t + rows, read, kt, vt));
          }
        }
      }
      return absl::OkStatus();
    }));
    result.rows.push_back(std::move(row));
  }
  return result;
}

std::string FormatConvertTable(const ConvertBenchResult& r, const std::string& command) {
  std::string out = absl::StrFormat(
      "# %s\n# SmolLM2-135M layout: %d layers, %d KV heads, head_dim %d; prompt %d tokens = "
      "%.1f MiB of fp16 K+V; %d hardware threads; median of the timed repetitions; no server, "
      "no wire\n\n",
      command, smollm::kLayers, smollm::kKvHeads, smollm::kHeadDim, r.tokens,
      r.fp16_bytes / 1048576.0, r.hardware_threads);
  const double copy_s = r.rows.empty() ? 0.0 : r.rows[0].median_s;
  absl::StrAppendFormat(&out, "%-28s %-48s %7s %10s %12s %9s\n", "scheme", "path", "threads",
                        "median ms", "GB/s of fp16", "x memcpy");
  for (const ConvertRow& row : r.rows) {
    const double gbs = row.median_s > 0 ? row.fp16_bytes / row.median_s / 1e9 : 0.0;
    absl::StrAppendFormat(&out, "%-28s %-48s %7d %10.1f %12.2f %9.2f\n",
                          row.scheme.empty() ? "-" : row.scheme, row.label, row.threads,
                          1e3 * row.median_s, gbs, copy_s > 0 ? row.median_s / copy_s : 0.0);
  }
  out +=
      "\n(GB/s of fp16: fp16 K+V converted per second; the dequantize rows count the quantized\n"
      " tokens only, as a sink and an fp16 tail travel dense. x memcpy: time over the memcpy's.\n"
      " The quantize rows include copying pages into the chunks; the dequantize rows validate\n"
      " every page, as the client does.)\n";
  return out;
}

std::string FormatConvertJson(const ConvertBenchResult& r, const std::string& command) {
  std::string out = absl::StrFormat(
      "{\n  \"command\": \"%s\",\n  \"tokens\": %d,\n  \"fp16_bytes\": %d,\n"
      "  \"hardware_threads\": %d,\n  \"rows\": [",
      command, r.tokens, r.fp16_bytes, r.hardware_threads);
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const ConvertRow& row = r.rows[i];
    absl::StrAppendFormat(&out,
                          "%s\n    {\"id\": \"%s\", \"scheme\": \"%s\", \"label\": \"%s\", "
                          "\"threads\": %d, \"fp16_bytes\": %d, \"median_s\": %.6g, "
                          "\"gb_per_s_fp16\": %.4g}",
                          i ? "," : "", row.id, row.scheme, row.label, row.threads,
                          row.fp16_bytes, row.median_s,
                          row.median_s > 0 ? row.fp16_bytes / row.median_s / 1e9 : 0.0);
  }
  out += "\n  ]\n}\n";
  return out;
}

}  // namespace kvq
