#include "client/local_sequence.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/parallel_for.h"
#include "kernels/page_allocator.h"
#include "kernels/status_macros.h"

namespace kvq {

namespace {

// Raw pages are only meaningful in the layout that wrote them: the same page
// size and tokens per page as this sequence's streams.
absl::Status CheckPageGeometry(const v1::QuantizedPages& pages, const PageLayout& L) {
  if (pages.page_bytes() != static_cast<int64_t>(L.page_bytes) ||
      pages.page_tokens() != L.page_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pages are ", pages.page_bytes(), " bytes of ", pages.page_tokens(),
        " tokens; this sequence's pages are ", L.page_bytes, " bytes of ", L.page_tokens));
  }
  return absl::OkStatus();
}

}  // namespace

TokenPlacement PlaceTokens(const StreamConfig& config, int num_tokens) {
  TokenPlacement p;
  p.sink = std::clamp(config.spec.sink, 0, std::max(num_tokens, 0));
  const int rest = std::max(num_tokens, 0) - p.sink;
  p.quantized = config.spec.has_tail() ? rest - rest % config.spec.flush_tokens() : rest;
  p.tail = rest - p.quantized;
  return p;
}

absl::StatusOr<std::unique_ptr<LocalSequence>> LocalSequence::Create(
    const SequenceConfig& config, int layer_begin, int layers, const KernelBackend* backend,
    PageAllocator* pages) {
  KVQ_ASSIGN_OR_RETURN(StreamConfig stream_config, config.ToStreamConfig());
  const ModelLayout& m = config.layout;
  if (m.num_kv_heads <= 0 || m.num_layers <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("layout needs num_layers and num_kv_heads > 0, got ",
                                                   m.num_layers, " and ", m.num_kv_heads));
  }
  if (layers < 0) layers = m.num_layers - layer_begin;
  if (layer_begin < 0 || layers < 0 || layer_begin + layers > m.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers [", layer_begin, ", ",
                                                   layer_begin + layers, ") are not inside [0, ",
                                                   m.num_layers, ")"));
  }
  std::unique_ptr<LocalSequence> s(new LocalSequence());
  s->config_ = stream_config;
  s->layer_begin_ = layer_begin;
  s->layers_ = layers;
  s->kv_heads_ = m.num_kv_heads;
  s->held_.resize(layers);
  for (int l = layer_begin; l < layer_begin + layers; ++l) {
    for (int h = 0; h < m.num_kv_heads; ++h) {
      KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvStream> stream,
                           KvStream::Create(stream_config, backend,
                                            pages != nullptr ? pages : HeapPageAllocator(),
                                            stream_config.spec.nuq ? config.codebook(l, h) : nullptr));
      s->streams_.push_back(std::move(stream));
    }
  }
  return s;
}

const KvStream& LocalSequence::stream(int layer, int head) const {
  return *streams_[static_cast<size_t>(layer - layer_begin_) * kv_heads_ + head];
}

int LocalSequence::layer_tokens(int layer) const {
  if (layer < layer_begin_ || layer >= layer_begin_ + layers_) return -1;
  return stream(layer, 0).num_tokens();
}

int LocalSequence::num_tokens() const {
  int n = layers_ > 0 ? layer_tokens(layer_begin_) : 0;
  for (int l = layer_begin_; l < layer_begin_ + layers_; ++l) n = std::min(n, layer_tokens(l));
  return n;
}

absl::Status LocalSequence::CheckLayers(int layer, int layers) const {
  if (layers <= 0 || layer < layer_begin_ || layer + layers > layer_begin_ + layers_) {
    return absl::OutOfRangeError(absl::StrCat("layers [", layer, ", ", layer + layers,
                                              ") are not inside the held layers [", layer_begin_,
                                              ", ", layer_begin_ + layers_, ")"));
  }
  return absl::OkStatus();
}

absl::Status LocalSequence::AppendDense(int layer, int layers, const v1::Tensor& k,
                                        const v1::Tensor& v, bool per_layer_shape) {
  KVQ_ASSIGN_OR_RETURN(const HostTensor kt, FromProto(k, "k"));
  KVQ_ASSIGN_OR_RETURN(const HostTensor vt, FromProto(v, "v"));
  // Per-layer messages (FetchResponse) are [kv_heads, tokens, head_dim].
  const size_t rank = per_layer_shape ? 3 : 4;
  const int64_t d = config_.head_dim;
  if (kt.shape.size() != rank || kt.shape != vt.shape || kt.shape[rank - 3] != kv_heads_ ||
      kt.shape[rank - 1] != d) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k and v must both be [", per_layer_shape ? "" : "layers, ", kv_heads_, ", tokens, ", d,
        "], got ", kt.DebugString(), " and ", vt.DebugString()));
  }
  if (!per_layer_shape) layers = static_cast<int>(kt.shape[0]);
  KVQ_RETURN_IF_ERROR(CheckLayers(layer, layers));
  const int n = static_cast<int>(kt.shape[rank - 2]);
  const size_t run_k = static_cast<size_t>(n) * d * DTypeBytes(kt.dtype);
  const size_t run_v = static_cast<size_t>(n) * d * DTypeBytes(vt.dtype);
  for (int l = 0; l < layers; ++l) {
    for (int h = 0; h < kv_heads_; ++h) {
      const size_t i = static_cast<size_t>(l) * kv_heads_ + h;
      KvStream& s = *streams_[static_cast<size_t>(layer - layer_begin_ + l) * kv_heads_ + h];
      const ConstTensorView kv{kt.bytes() + i * run_k, kt.dtype, n, static_cast<int>(d), 0};
      const ConstTensorView vv{vt.bytes() + i * run_v, vt.dtype, n, static_cast<int>(d), 0};
      if (absl::Status st = s.Append(kv, vv); !st.ok()) {
        return absl::Status(st.code(), absl::StrCat("layer ", layer + l, " kv head ", h, ": ",
                                                    st.message()));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LocalSequence::AppendPages(int layer, const v1::QuantizedPages& pages) {
  const int layers = std::max(pages.layers(), 1);
  KVQ_RETURN_IF_ERROR(CheckLayers(layer, layers));
  const KvStream& first = stream(layer, 0);
  const PageLayout& L = first.layout();
  KVQ_RETURN_IF_ERROR(CheckPageGeometry(pages, L));
  if (pages.tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("pages.tokens = ", pages.tokens(), " < 0"));
  }
  const size_t run = static_cast<size_t>(first.PagesFor(pages.tokens())) * L.page_bytes;
  const size_t want = run * layers * kv_heads_;
  if (pages.page_data().size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("page_data has ", pages.page_data().size(),
                                                   " bytes; ", layers, " layers x ", kv_heads_,
                                                   " kv heads x ", pages.tokens(),
                                                   " tokens need ", want));
  }
  const uint8_t* data = reinterpret_cast<const uint8_t*>(pages.page_data().data());
  for (int l = 0; l < layers; ++l) {
    for (int h = 0; h < kv_heads_; ++h) {
      KvStream& s = *streams_[static_cast<size_t>(layer - layer_begin_ + l) * kv_heads_ + h];
      if (absl::Status st = s.AppendPages(data, pages.tokens()); !st.ok()) {
        return absl::Status(st.code(), absl::StrCat("layer ", layer + l, " kv head ", h, ": ",
                                                    st.message()));
      }
      data += run;
    }
  }
  return absl::OkStatus();
}

absl::Status LocalSequence::ApplyChunk(const v1::KvChunk& chunk) {
  if (chunk.has_pages()) {
    if (chunk.has_k() || chunk.has_v()) {
      return absl::InvalidArgumentError("a chunk carries either k/v or pages, not both");
    }
    return AppendPages(chunk.layer_begin(), chunk.pages());
  }
  return AppendDense(chunk.layer_begin(), 0, chunk.k(), chunk.v(), /*per_layer_shape=*/false);
}

absl::Status LocalSequence::HoldPages(int layer, const v1::QuantizedPages& pages) {
  const KvStream& first = stream(layer, 0);
  const PageLayout& L = first.layout();
  KVQ_RETURN_IF_ERROR(CheckPageGeometry(pages, L));
  if (pages.tokens() < 1 || std::max(pages.layers(), 1) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("fetched pages of layer ", layer,
                                                   " must hold >= 1 token of 1 layer"));
  }
  HeldPages& held = held_[layer - layer_begin_];
  const uint8_t* data = reinterpret_cast<const uint8_t*>(pages.page_data().data());
  if (held.tokens % L.page_tokens != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fetched pages of layer ", layer, " continue after a partly filled page"));
  }
  const size_t run = static_cast<size_t>(first.PagesFor(pages.tokens())) * L.page_bytes;
  if (pages.page_data().size() != run * kv_heads_) {
    return absl::InvalidArgumentError(absl::StrCat("page_data has ", pages.page_data().size(),
                                                   " bytes; ", kv_heads_, " kv heads x ",
                                                   pages.tokens(), " tokens need ",
                                                   run * kv_heads_));
  }
  // Whole flush blocks with nothing held back go straight from the message
  // into the streams; the rest waits in `held` for its block to complete.
  if (held.tokens == 0 && pages.tokens() % config_.spec.flush_tokens() == 0) {
    for (int h = 0; h < kv_heads_; ++h) {
      KVQ_RETURN_IF_ERROR(AppendHeadPages(layer, h, data + h * run, pages.tokens()));
    }
    return absl::OkStatus();
  }
  held.heads.resize(kv_heads_);
  for (int h = 0; h < kv_heads_; ++h) held.heads[h].append(pages.page_data(), h * run, run);
  held.tokens += pages.tokens();
  if (held.tokens % config_.spec.flush_tokens() != 0) return absl::OkStatus();
  for (int h = 0; h < kv_heads_; ++h) {
    KVQ_RETURN_IF_ERROR(AppendHeadPages(
        layer, h, reinterpret_cast<const uint8_t*>(held.heads[h].data()), held.tokens));
  }
  held = HeldPages();
  return absl::OkStatus();
}

absl::Status LocalSequence::AppendHeadPages(int layer, int head, const uint8_t* data,
                                            int tokens) {
  KvStream& s = *streams_[static_cast<size_t>(layer - layer_begin_) * kv_heads_ + head];
  if (absl::Status st = s.AppendPages(data, tokens); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("layer ", layer, " kv head ", head, ": ",
                                                st.message()));
  }
  return absl::OkStatus();
}

absl::Status LocalSequence::ApplyFetched(const v1::FetchResponse& response) {
  const int layer = response.layer();
  KVQ_RETURN_IF_ERROR(CheckLayers(layer, 1));
  const bool dense = response.has_k() || response.has_v();
  if (dense == response.has_pages()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fetch response for layer ", layer, " must carry either k/v or pages"));
  }
  const HeldPages& held = held_[layer - layer_begin_];
  const int end = layer_tokens(layer) + held.tokens;
  if (response.token_begin() != end) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fetch response for layer ", layer, " starts at token ", response.token_begin(),
        " but the layer's tokens end at ", end, ": responses must come in token order"));
  }
  if (!dense) return HoldPages(layer, response.pages());
  if (held.tokens > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fetched pages of layer ", layer, " end inside a flush block (", held.tokens,
        " tokens held)"));
  }
  return AppendDense(layer, 1, response.k(), response.v(), /*per_layer_shape=*/true);
}

absl::Status LocalSequence::CheckReadRange(int token_begin, int token_end) const {
  for (const HeldPages& held : held_) {
    if (held.tokens > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          held.tokens, " tokens of fetched pages end inside a flush block"));
    }
  }
  if (token_begin < 0 || token_end < token_begin || token_end > num_tokens()) {
    return absl::OutOfRangeError(absl::StrCat("token range [", token_begin, ", ", token_end,
                                              ") is not inside [0, ", num_tokens(), "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<FetchedKv> LocalSequence::Read(int token_begin, int token_end,
                                              const ReadOptions& options, int threads) const {
  if (token_end < 0) token_end = num_tokens();
  KVQ_RETURN_IF_ERROR(CheckReadRange(token_begin, token_end));
  const int n = token_end - token_begin;
  FetchedKv out;
  out.layer_begin = layer_begin_;
  out.token_begin = token_begin;
  out.k = HostTensor::Zeros(options.dtype, {layers_, kv_heads_, n, config_.head_dim});
  out.v = HostTensor::Zeros(options.dtype, {layers_, kv_heads_, n, config_.head_dim});
  KVQ_RETURN_IF_ERROR(ReadInto(token_begin, token_end, options, &out.k, &out.v, threads));
  return out;
}

absl::Status LocalSequence::ReadInto(int token_begin, int token_end, const ReadOptions& options,
                                     HostTensor* k, HostTensor* v, int threads) const {
  KVQ_RETURN_IF_ERROR(CheckReadRange(token_begin, token_end));
  const int n = token_end - token_begin;
  const int d = config_.head_dim;
  const std::vector<int64_t> shape = {layers_, kv_heads_, n, d};
  for (const auto& [t, name] : {std::pair<HostTensor*, const char*>{k, "k"}, {v, "v"}}) {
    if (t == nullptr || t->dtype != options.dtype || t->shape != shape || !t->Validate().ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " is ", t == nullptr ? "null" : t->DebugString(), "; the read needs [",
          absl::StrJoin(shape, ", "), "] ", DTypeName(options.dtype)));
    }
  }
  const size_t run = static_cast<size_t>(n) * d * DTypeBytes(options.dtype);
  // Starting threads costs tens of microseconds: small reads stay on one.
  if (static_cast<int64_t>(n) * d * static_cast<int64_t>(streams_.size()) < (int64_t{1} << 18)) {
    threads = 1;
  }
  std::vector<absl::Status> status(streams_.size());
  ParallelFor(static_cast<int>(streams_.size()), threads, [&](int i) {
    const TensorView kv{k->mutable_bytes() + i * run, options.dtype, n, d, 0};
    const TensorView vv{v->mutable_bytes() + i * run, options.dtype, n, d, 0};
    status[i] = streams_[i]->Read(token_begin, token_end, options, kv, vv);
  });
  for (const absl::Status& st : status) KVQ_RETURN_IF_ERROR(st);
  return absl::OkStatus();
}

}  // namespace kvq
