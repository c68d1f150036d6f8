#include "client/append_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/parallel_for.h"
#include "kernels/page_allocator.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

struct PromptShape {
  int layers = 0;
  int kv_heads = 0;
  int tokens = 0;
  int head_dim = 0;
};

absl::StatusOr<PromptShape> CheckPrompt(const HostTensor& k, const HostTensor& v) {
  if (k.rank() != 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k must be [layers, kv_heads, tokens, head_dim], got ", k.DebugString()));
  }
  if (k.shape != v.shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("k is ", k.DebugString(), " but v is ", v.DebugString()));
  }
  if (k.dtype != v.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("k is ", DTypeName(k.dtype), " but v is ",
                                                   DTypeName(v.dtype), "; use one dtype"));
  }
  KVQ_RETURN_IF_ERROR(k.Validate());
  KVQ_RETURN_IF_ERROR(v.Validate());
  for (int i = 0; i < 4; ++i) {
    if (k.shape[i] > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat("k.shape[", i, "] = ", k.shape[i], " is too large"));
    }
  }
  return PromptShape{static_cast<int>(k.shape[0]), static_cast<int>(k.shape[1]),
                     static_cast<int>(k.shape[2]), static_cast<int>(k.shape[3])};
}

int64_t DenseTokenBytes(const PromptShape& s, DType dtype) {
  return 2 * int64_t{s.kv_heads} * s.head_dim * static_cast<int64_t>(DTypeBytes(dtype));
}

// Appends dense chunks of tokens [begin, begin + count) to `plan`.
void AddDense(const PromptShape& s, int begin, int count, int64_t max_bytes, AppendPlan* plan) {
  const int64_t token_bytes = DenseTokenBytes(s, plan->dense_dtype);
  for (ChunkRange r : PlanChunks(s.layers, count, 1, token_bytes, max_bytes)) {
    r.token_begin += begin;
    const int64_t bytes = token_bytes * r.layers * r.tokens;
    plan->chunks.push_back({PlannedChunk::Kind::kDense, r, bytes});
    plan->total_bytes += bytes;
  }
}

}  // namespace

std::vector<ChunkRange> PlanChunks(int layers, int tokens, int token_unit, int64_t unit_bytes,
                                   int64_t max_bytes) {
  std::vector<ChunkRange> out;
  if (layers <= 0 || tokens <= 0) return out;
  token_unit = std::max(token_unit, 1);
  unit_bytes = std::max<int64_t>(unit_bytes, 1);
  max_bytes = std::max<int64_t>(max_bytes, 1);
  const int64_t units = (tokens + int64_t{token_unit} - 1) / token_unit;
  const int64_t layer_bytes = units * unit_bytes;
  if (layer_bytes <= max_bytes) {
    const int per_chunk = static_cast<int>(std::min<int64_t>(layers, max_bytes / layer_bytes));
    for (int l = 0; l < layers; l += per_chunk) {
      out.push_back({l, std::min(per_chunk, layers - l), 0, tokens});
    }
    return out;
  }
  const int64_t units_per_chunk = std::max<int64_t>(1, max_bytes / unit_bytes);
  const int64_t step = units_per_chunk * token_unit;
  for (int l = 0; l < layers; ++l) {
    for (int64_t t = 0; t < tokens; t += step) {
      out.push_back({l, 1, static_cast<int>(t), static_cast<int>(std::min<int64_t>(step, tokens - t))});
    }
  }
  return out;
}

absl::StatusOr<QuantizedSplit> SplitForPages(const StreamConfig& config, int start_tokens,
                                             int tokens, int block_tokens) {
  if (start_tokens < 0 || tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("start_tokens (", start_tokens,
                                                   ") and tokens (", tokens,
                                                   ") must be >= 0"));
  }
  KVQ_ASSIGN_OR_RETURN(const PageLayout layout,
                       PageLayout::Make(config.spec, config.head_dim, config.page_tokens));
  const QuantSpec& spec = config.spec;
  QuantizedSplit split;
  split.page_tokens = layout.page_tokens;
  split.page_bytes = static_cast<int64_t>(layout.page_bytes);
  const int flush = spec.flush_tokens();
  split.block_tokens =
      block_tokens > 0 ? block_tokens : (spec.has_tail() ? flush : layout.page_tokens);
  if (split.block_tokens % flush != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_tokens ", split.block_tokens,
                     " is not a multiple of the scheme's flush block ", flush));
  }
  if (spec.kind == SchemeKind::kFp8E4m3) {  // Its scale is per stream: no raw pages.
    split.dense_head = tokens;
    return split;
  }
  // Pages start where the server's stream accepts them: the sink complete,
  // the fp16 tail empty and the quantized part on a page and block boundary.
  const int64_t align = std::lcm(std::lcm(int64_t{flush}, int64_t{layout.page_tokens}),
                                 int64_t{split.block_tokens});
  int64_t head = std::max(0, spec.sink - start_tokens);
  const int64_t stored_quantizable = std::max(start_tokens, spec.sink) - spec.sink;
  head += (align - stored_quantizable % align) % align;
  split.dense_head = static_cast<int>(std::min<int64_t>(head, tokens));
  const int rest = tokens - split.dense_head;
  split.paged = rest / split.block_tokens * split.block_tokens;
  split.dense_tail = rest - split.paged;
  return split;
}

absl::StatusOr<AppendPlan> PlanDenseAppend(const HostTensor& k, const HostTensor& v,
                                           DType wire_dtype, const PlanOptions& options) {
  KVQ_ASSIGN_OR_RETURN(const PromptShape s, CheckPrompt(k, v));
  AppendPlan plan;
  plan.dense_dtype = wire_dtype;
  AddDense(s, 0, s.tokens, options.max_chunk_bytes, &plan);
  return plan;
}

absl::StatusOr<AppendPlan> PlanQuantizedAppend(const HostTensor& k, const HostTensor& v,
                                               const StreamConfig& config, int start_tokens,
                                               int block_tokens, const PlanOptions& options) {
  KVQ_ASSIGN_OR_RETURN(const PromptShape s, CheckPrompt(k, v));
  KVQ_RETURN_IF_ERROR(config.Validate());
  if (s.head_dim != config.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("k has head_dim ", s.head_dim,
                                                   ", the sequence has ", config.head_dim));
  }
  AppendPlan plan;
  plan.quantized = true;
  plan.dense_dtype =
      config.spec.is_kivi() && !config.spec.rotate ? DType::kFloat16 : k.dtype;
  KVQ_ASSIGN_OR_RETURN(plan.split, SplitForPages(config, start_tokens, s.tokens, block_tokens));
  const QuantizedSplit& q = plan.split;
  AddDense(s, 0, q.dense_head, options.max_chunk_bytes, &plan);
  if (q.paged > 0) {
    // Every chunk but a layer's last ends on a page and block boundary.
    const int unit = std::lcm(q.block_tokens, q.page_tokens);
    const int64_t unit_bytes = int64_t{s.kv_heads} * (unit / q.page_tokens) * q.page_bytes;
    for (ChunkRange r : PlanChunks(s.layers, q.paged, unit, unit_bytes, options.max_chunk_bytes)) {
      const int64_t pages = (r.tokens + int64_t{q.page_tokens} - 1) / q.page_tokens;
      const int64_t bytes = int64_t{r.layers} * s.kv_heads * pages * q.page_bytes;
      r.token_begin += q.dense_head;
      plan.chunks.push_back({PlannedChunk::Kind::kPages, r, bytes});
      plan.total_bytes += bytes;
    }
  }
  AddDense(s, q.dense_head + q.paged, q.dense_tail, options.max_chunk_bytes, &plan);
  return plan;
}

HostTensor SliceKv(const HostTensor& t, const ChunkRange& range, DType dtype) {
  const int64_t heads = t.shape[1], tokens = t.shape[2], d = t.shape[3];
  HostTensor out;
  out.dtype = dtype;
  out.shape = {range.layers, heads, range.tokens, d};
  const size_t in_bytes = DTypeBytes(t.dtype), out_bytes = DTypeBytes(dtype);
  out.data.resize(static_cast<size_t>(range.layers) * heads * range.tokens * d * out_bytes);
  const int64_t run = range.tokens * d;  // Elements per (layer, head).
  std::vector<float> scratch(t.dtype == dtype ? 0 : static_cast<size_t>(std::min<int64_t>(run, 1 << 20)));
  uint8_t* dst = out.mutable_bytes();
  for (int l = 0; l < range.layers; ++l) {
    for (int64_t h = 0; h < heads; ++h) {
      const uint8_t* src =
          t.bytes() + (((range.layer_begin + l) * heads + h) * tokens + range.token_begin) * d * in_bytes;
      if (t.dtype == dtype) {
        std::memcpy(dst, src, run * in_bytes);
      } else {
        for (int64_t i = 0; i < run; i += static_cast<int64_t>(scratch.size())) {
          const int n = static_cast<int>(std::min<int64_t>(scratch.size(), run - i));
          RowToFloat(src + i * in_bytes, t.dtype, n, scratch.data());
          FloatToRow(scratch.data(), n, dtype, dst + i * out_bytes);
        }
      }
      dst += run * out_bytes;
    }
  }
  return out;
}

ChunkBuilder::ChunkBuilder(const HostTensor& k, const HostTensor& v, const AppendPlan& plan,
                           const PlanOptions& options, const SequenceConfig* sequence,
                           const KernelBackend* backend)
    : k_(k), v_(v), plan_(plan), options_(options), sequence_(sequence), backend_(backend) {}

absl::StatusOr<std::unique_ptr<KvStream>> ChunkBuilder::QuantizeStream(int layer, int head) {
  const int heads = static_cast<int>(k_.shape[1]);
  const int tokens = static_cast<int>(k_.shape[2]);
  const int d = static_cast<int>(k_.shape[3]);
  const QuantizedSplit& q = plan_.split;
  const int model_layer = options_.layer_begin + layer;
  const Codebook* codebook = config_.spec.nuq ? sequence_->codebook(model_layer, head) : nullptr;
  KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvStream> s,
                       KvStream::Create(config_, backend_, &pages_, codebook));
  // The sink only has to be complete: its contents do not reach pages.
  if (config_.spec.sink > 0) {
    const std::vector<uint16_t> zeros(static_cast<size_t>(config_.spec.sink) * d, 0);
    const ConstTensorView z{zeros.data(), DType::kFloat16, config_.spec.sink, d, 0};
    KVQ_RETURN_IF_ERROR(s->Append(z, z));
  }
  const size_t elem = DTypeBytes(k_.dtype);
  const size_t offset =
      ((static_cast<size_t>(layer) * heads + head) * tokens + q.dense_head) * d * elem;
  const ConstTensorView kv{k_.bytes() + offset, k_.dtype, q.paged, d, 0};
  const ConstTensorView vv{v_.bytes() + offset, v_.dtype, q.paged, d, 0};
  if (absl::Status st = s->Append(kv, vv); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("layer ", model_layer, " kv head ", head,
                                                ", from prompt token ", q.dense_head, ": ",
                                                st.message()));
  }
  if (s->quantized_tokens() != q.paged || s->tail_tokens() != 0) {
    return absl::InternalError(absl::StrCat("local stream quantized ", s->quantized_tokens(),
                                            " of ", q.paged, " tokens"));
  }
  return s;
}

int ChunkBuilder::WindowLayers(int layer_begin, int layers) const {
  const int threads = options_.threads > 0
                          ? options_.threads
                          : static_cast<int>(std::thread::hardware_concurrency());
  const int heads = static_cast<int>(k_.shape[1]);
  // Four streams per thread: the last round leaves a thread idle for at
  // most a quarter of the window.
  const int wanted = (4 * std::max(threads, 1) + heads - 1) / heads;
  const int left = static_cast<int>(k_.shape[0]) - layer_begin;
  return std::max(layers, std::min(wanted, left));
}

absl::Status ChunkBuilder::QuantizeLayers(int layer_begin, int layers) {
  if (sequence_ == nullptr) {
    return absl::FailedPreconditionError("a quantized plan needs the sequence's config");
  }
  if (!config_ready_) {
    KVQ_ASSIGN_OR_RETURN(config_, sequence_->ToStreamConfig());
    config_ready_ = true;
  }
  streams_.clear();
  quantized_begin_ = -1;
  // Streams are independent: quantize them on several threads. The result
  // does not depend on the thread count.
  const int heads = static_cast<int>(k_.shape[1]);
  const int count = layers * heads;
  std::vector<absl::StatusOr<std::unique_ptr<KvStream>>> out;
  out.reserve(count);
  for (int i = 0; i < count; ++i) out.emplace_back(absl::UnknownError("not quantized"));
  ParallelFor(count, options_.threads,
              [&](int i) { out[i] = QuantizeStream(layer_begin + i / heads, i % heads); });
  for (absl::StatusOr<std::unique_ptr<KvStream>>& s : out) {
    if (!s.ok()) {
      streams_.clear();
      return s.status();
    }
    streams_.push_back(std::move(*s));
  }
  quantized_begin_ = layer_begin;
  quantized_layers_ = layers;
  return absl::OkStatus();
}

absl::StatusOr<v1::KvChunk> ChunkBuilder::Build(const PlannedChunk& chunk) {
  const ChunkRange& r = chunk.range;
  v1::KvChunk out;
  out.set_layer_begin(options_.layer_begin + r.layer_begin);
  if (chunk.kind == PlannedChunk::Kind::kDense) {
    ToProto(SliceKv(k_, r, plan_.dense_dtype), out.mutable_k());
    ToProto(SliceKv(v_, r, plan_.dense_dtype), out.mutable_v());
    return out;
  }
  if (quantized_begin_ < 0 || r.layer_begin < quantized_begin_ ||
      r.layer_begin + r.layers > quantized_begin_ + quantized_layers_) {
    KVQ_RETURN_IF_ERROR(QuantizeLayers(r.layer_begin, WindowLayers(r.layer_begin, r.layers)));
  }
  const QuantizedSplit& q = plan_.split;
  const int heads = static_cast<int>(k_.shape[1]);
  const size_t first = static_cast<size_t>(r.layer_begin - quantized_begin_) * heads;
  const int begin = r.token_begin - q.dense_head;  // Within the quantized part.
  const int pages = (r.tokens + q.page_tokens - 1) / q.page_tokens;
  const size_t run = static_cast<size_t>(pages) * q.page_bytes;
  v1::QuantizedPages* p = out.mutable_pages();
  p->set_layers(r.layers);
  p->set_tokens(r.tokens);
  p->set_page_bytes(q.page_bytes);
  p->set_page_tokens(q.page_tokens);
  // Appended, not resized and overwritten: the message's bytes are written
  // once (BENCHMARKS.md section 7).
  std::string* data = p->mutable_page_data();
  data->reserve(run * r.layers * heads);
  for (size_t i = first; i < first + static_cast<size_t>(r.layers) * heads; ++i) {
    KVQ_RETURN_IF_ERROR(streams_[i]->AppendPagesTo(begin, begin + r.tokens, data));
  }
  return out;
}

}  // namespace kvq
