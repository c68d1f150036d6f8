#include "client/python/native/kv_layer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/calibration_file.h"
#include "kernels/quoted.h"
#include "kernels/status_macros.h"

namespace kvq {

ConstTensorView HeadsView::Head(int h) const {
  const auto* base = static_cast<const uint8_t*>(data) +
                     static_cast<size_t>(h) * head_stride * DTypeBytes(dtype);
  return {base, dtype, tokens, head_dim, static_cast<int>(row_stride)};
}

TensorView MutableHeadsView::Head(int h) const {
  return {data + static_cast<size_t>(h) * head_stride, DType::kFloat32, tokens, head_dim,
          static_cast<int>(row_stride)};
}

absl::StatusOr<std::unique_ptr<KvLayer>> KvLayer::Create(
    const StreamConfig& config, int num_kv_heads, const KernelBackend* backend,
    const std::vector<Codebook>& codebooks, const ModelCalibration* calibration,
    int calibration_layer) {
  if (num_kv_heads < 1 || num_kv_heads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads must be in [1, 1024], got ", num_kv_heads));
  }
  if (config.spec.nuq && codebooks.size() != static_cast<size_t>(num_kv_heads)) {
    return absl::InvalidArgumentError(
        absl::StrCat("scheme ", config.spec.ToString(), " has nuq: it needs ", num_kv_heads,
                     " codebooks (one per kv head), got ", codebooks.size()));
  }
  if (calibration != nullptr) {
    // Any layer count: a KvLayer is one layer, calibration_layer says which.
    KVQ_RETURN_IF_ERROR(CheckCalibrationShape(*calibration, calibration->num_layers, num_kv_heads,
                                              config.head_dim));
    if (calibration_layer < 0 || calibration_layer >= calibration->num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration_layer ", calibration_layer, " is not a layer of calibration ",
                       Quoted(calibration->name), " (0 to ", calibration->num_layers - 1, ")"));
    }
  }
  std::vector<std::unique_ptr<KvStream>> streams;
  for (int h = 0; h < num_kv_heads; ++h) {
    const Codebook* codebook = config.spec.nuq ? &codebooks[h] : nullptr;
    const HeadCalibration* head =
        calibration != nullptr ? &calibration->Head(calibration_layer, h) : nullptr;
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvStream> s,
                         KvStream::Create(config, backend, nullptr, codebook, head));
    streams.push_back(std::move(s));
  }
  return std::unique_ptr<KvLayer>(new KvLayer(config, backend, std::move(streams)));
}

absl::Status KvLayer::Append(const HeadsView& k, const HeadsView& v) {
  const int h = num_kv_heads();
  for (const HeadsView* t : {&k, &v}) {
    if (t->heads != h || t->head_dim != head_dim()) {
      return absl::InvalidArgumentError(absl::StrCat(
          t == &k ? "k" : "v", " is [", t->heads, ", ", t->tokens, ", ", t->head_dim,
          "]; the layer has ", h, " kv heads of head_dim ", head_dim()));
    }
  }
  if (k.tokens != v.tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("k has ", k.tokens, " tokens but v has ", v.tokens));
  }
  for (int i = 0; i < h; ++i) {
    if (absl::Status st = streams_[i]->ValidateAppend(k.Head(i), v.Head(i)); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("kv head ", i, ": ", st.message()));
    }
  }
  for (int i = 0; i < h; ++i) {
    // Only the allocator can fail now (the heap: out of memory).
    KVQ_RETURN_IF_ERROR(streams_[i]->AppendValidated(k.Head(i), v.Head(i)));
  }
  return absl::OkStatus();
}

absl::Status KvLayer::Read(int begin, int end, const MutableHeadsView& k,
                           const MutableHeadsView& v) const {
  const ReadOptions options;  // float32, keys post-RoPE.
  for (int i = 0; i < num_kv_heads(); ++i) {
    KVQ_RETURN_IF_ERROR(streams_[i]->Read(begin, end, options, k.Head(i), v.Head(i)));
  }
  return absl::OkStatus();
}

absl::Status KvLayer::Attend(const float* q, int num_q_heads, int q_len,
                             const std::vector<int32_t>& positions, float scale, float* out,
                             float* lse) const {
  const int h = num_kv_heads(), d = head_dim();
  if (num_q_heads < 1 || num_q_heads % h != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q has ", num_q_heads, " heads: not a positive multiple of num_kv_heads ", h));
  }
  if (q_len < 1) return absl::InvalidArgumentError("q has no queries (q_len 0)");
  if (!positions.empty() && positions.size() != static_cast<size_t>(q_len)) {
    return absl::InvalidArgumentError(absl::StrCat("positions has ", positions.size(),
                                                   " entries for ", q_len, " queries"));
  }
  const int group = num_q_heads / h;
  // The backend wants the group's heads of one query side by side:
  // [kv_head][query][group * head_dim]; q and out are [q_head][query][dim].
  const size_t row = static_cast<size_t>(group) * d;
  std::vector<float> qs(static_cast<size_t>(h) * q_len * row);
  std::vector<float> os(qs.size());
  std::vector<float> ls(static_cast<size_t>(h) * q_len * group);
  for (int qh = 0; qh < num_q_heads; ++qh) {
    for (int r = 0; r < q_len; ++r) {
      std::memcpy(&qs[(static_cast<size_t>(qh / group) * q_len + r) * row + (qh % group) * d],
                  q + (static_cast<size_t>(qh) * q_len + r) * d, d * sizeof(float));
    }
  }
  std::vector<AttentionTask> tasks(h);
  for (int i = 0; i < h; ++i) {
    AttentionTask& t = tasks[i];
    t.stream = streams_[i].get();
    t.num_queries = q_len;
    t.q = &qs[static_cast<size_t>(i) * q_len * row];
    t.q_stride = static_cast<int>(row);
    t.q_positions = positions.empty() ? nullptr : positions.data();
    t.out = &os[static_cast<size_t>(i) * q_len * row];
    t.out_stride = static_cast<int>(row);
    t.lse = &ls[static_cast<size_t>(i) * q_len * group];
    t.lse_stride = group;
  }
  AttentionOptions options;
  options.group_size = group;
  options.softmax_scale = scale;
  KVQ_RETURN_IF_ERROR(ValidateAttention(tasks, options));
  KVQ_RETURN_IF_ERROR(backend_->Attend(tasks, options));
  for (int qh = 0; qh < num_q_heads; ++qh) {
    for (int r = 0; r < q_len; ++r) {
      const size_t at = static_cast<size_t>(qh / group) * q_len + r;
      std::memcpy(out + (static_cast<size_t>(qh) * q_len + r) * d,
                  &os[at * row + (qh % group) * d], d * sizeof(float));
      lse[static_cast<size_t>(qh) * q_len + r] = ls[at * group + qh % group];
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> KvLayer::Pages(int begin, int end) const {
  std::string out;
  const KvStream& first = *streams_[0];
  if (begin < 0 || end < begin || end > first.quantized_tokens()) {
    return absl::OutOfRangeError(absl::StrCat("pages [", begin, ", ", end,
                                              ") are not inside the quantized tokens [0, ",
                                              first.quantized_tokens(), ")"));
  }
  out.reserve(static_cast<size_t>(num_kv_heads()) * first.PagesFor(end - begin) *
              first.layout().page_bytes);
  for (const auto& s : streams_) KVQ_RETURN_IF_ERROR(s->AppendPagesTo(begin, end, &out));
  return out;
}

absl::Status KvLayer::AppendPages(const uint8_t* data, size_t size, int tokens) {
  const KvStream& first = *streams_[0];
  if (tokens < 0) return absl::InvalidArgumentError(absl::StrCat("tokens ", tokens, " < 0"));
  const size_t per_head = static_cast<size_t>(first.PagesFor(tokens)) * first.layout().page_bytes;
  if (size != per_head * num_kv_heads()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data has ", size, " bytes; ", tokens, " tokens of ", num_kv_heads(), " kv heads are ",
        num_kv_heads(), " x ", first.PagesFor(tokens), " pages of ", first.layout().page_bytes,
        " bytes = ", per_head * num_kv_heads()));
  }
  // All or nothing: each head appends to a fork (sharing its full pages),
  // and the forks replace the streams only when every head succeeded.
  std::vector<std::unique_ptr<KvStream>> next;
  for (int i = 0; i < num_kv_heads(); ++i) {
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<KvStream> s, streams_[i]->Fork(num_tokens()));
    if (absl::Status st = s->AppendPages(data + per_head * i, tokens); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("kv head ", i, ": ", st.message()));
    }
    next.push_back(std::move(s));
  }
  streams_ = std::move(next);
  return absl::OkStatus();
}

ByteBreakdown KvLayer::Bytes() const {
  ByteBreakdown total;
  for (const auto& s : streams_) total += s->AllocatedBytes();
  return total;
}

}  // namespace kvq
