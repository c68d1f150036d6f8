// "cuda_host" attention: the fused decode kernel's algorithm
// (cuda_attention.cu) run serially on the CPU with the same attention_hd.h
// math. Each task's key range is cut into hd::kAttentionSplitTokens chunks
// (flash-decoding's splits); a chunk's keys and values are read once for
// every query row of the task (the GQA group shares them), each row folds
// the chunk's scores with the online softmax into a partial (out, lse), and
// each row's partials merge in one step with hd::MergeSplits. Page bytes come only through
// HostPagePointer, as the device reads them only through its view.
#include <algorithm>
#include <vector>

#include "kernels/hd/attention_hd.h"
#include "kernels/hd/device_stream_view.h"
#include "kernels/cuda/host_program_backend.h"
#include "kernels/cuda/stream_view_host.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

// A DeviceStreamView over host memory and the arrays it points into.
struct HostStreamView {
  DeviceStreamView view;
  std::vector<const uint8_t*> pages;
  std::vector<float> key_levels;
  std::vector<float> value_levels;
};

void FillView(const KvStream& s, HostStreamView* h) {
  DeviceStreamView& v = h->view;
  v = ViewWithoutPointers(s);
  h->pages.clear();
  for (int p = 0; p < s.PagesFor(s.quantized_tokens()); ++p) {
    h->pages.push_back(HostPagePointer(s, p));
  }
  v.pages = h->pages.data();
  v.sink_k = s.sink_row(Side::kKey, 0);
  v.sink_v = s.sink_row(Side::kValue, 0);
  v.tail_k = s.tail_row(Side::kKey, 0);
  v.tail_v = s.tail_row(Side::kValue, 0);
  h->key_levels = LevelsAsFloats(s, Side::kKey);
  h->value_levels = LevelsAsFloats(s, Side::kValue);
  if (!h->key_levels.empty()) v.key_extras.levels = h->key_levels.data();
  if (!h->value_levels.empty()) v.value_extras.levels = h->value_levels.data();
  v.rotation_signs = s.rotation() ? s.rotation()->signs().data() : nullptr;
}

void AttendTask(const AttentionTask& task, const AttentionOptions& options,
                const DeviceStreamView& v) {
  const int d = v.layout.head_dim;
  const int group = options.group_size;
  const int rows = task.num_queries * group;
  const float scale = SoftmaxScale(options, d);
  const int begin = task.key_begin;
  const int end = task.key_end == -1 ? v.num_tokens() : task.key_end;

  // Row r = query i, head g: its query in the stored basis and the keys it sees.
  std::vector<float> q(static_cast<size_t>(rows) * d);
  std::vector<int> visible_end(rows);
  int last_visible = begin;
  for (int i = 0; i < task.num_queries; ++i) {
    const int ve = task.q_positions ? std::min(end, task.q_positions[i] + 1) : end;
    for (int g = 0; g < group; ++g) {
      const int r = i * group + g;
      visible_end[r] = ve;
      const float* src = task.q + static_cast<size_t>(i) * task.q_stride + static_cast<size_t>(g) * d;
      float* dst = &q[static_cast<size_t>(r) * d];
      std::copy(src, src + d, dst);
      if (v.rotation_signs) hd::HadamardForward(v.rotation_signs, d, dst);
    }
    last_visible = std::max(last_visible, ve);
  }

  // Splits as the device cuts them (hd::SplitOrigin), at the host's fixed
  // size; each row's partials merge in one step (hd::MergeSplits), as the
  // merge kernel does.
  const int split_tokens = hd::SplitTokensAtLeast(hd::kAttentionSplitTokens, v.layout.page_tokens);
  const int origin = hd::SplitOrigin(begin, v.page_base, v.layout.page_tokens);
  const int splits = hd::SplitCount(origin, begin, last_visible, split_tokens);
  std::vector<float> out(static_cast<size_t>(rows) * d, 0.0f);
  std::vector<float> lse(rows, hd::NegInf());
  std::vector<float> partial_out(static_cast<size_t>(rows) * splits * d);
  std::vector<float> partial_lse(static_cast<size_t>(rows) * splits);
  std::vector<float> keys(static_cast<size_t>(split_tokens) * d);
  std::vector<float> values(keys.size());
  std::vector<float> acc(d);
  for (int split = 0; split < splits; ++split) {
    const int c0 = hd::SplitBegin(origin, begin, split, split_tokens);
    const int c1 = hd::SplitEnd(origin, last_visible, split, split_tokens);
    for (int t = c0; t < c1; ++t) {
      hd::LoadKeyForScore(v, t, &keys[static_cast<size_t>(t - c0) * d]);
      hd::LoadStoredRow(v, Side::kValue, t, &values[static_cast<size_t>(t - c0) * d]);
    }
    for (int r = 0; r < rows; ++r) {
      hd::SoftmaxState state;
      std::fill(acc.begin(), acc.end(), 0.0f);
      const float* qr = &q[static_cast<size_t>(r) * d];
      for (int t = c0; t < std::min(c1, visible_end[r]); ++t) {
        const float score = hd::Dot(qr, &keys[static_cast<size_t>(t - c0) * d], d) * scale;
        const hd::SoftmaxStep step = hd::SoftmaxPush(&state, score);
        const float* vt = &values[static_cast<size_t>(t - c0) * d];
        for (int c = 0; c < d; ++c) acc[c] = acc[c] * step.rescale + step.weight * vt[c];
      }
      const float inv = hd::SoftmaxOutScale(state);
      const size_t at = static_cast<size_t>(r) * splits + split;
      for (int c = 0; c < d; ++c) partial_out[at * d + c] = acc[c] * inv;
      partial_lse[at] = hd::SoftmaxLse(state);
    }
  }
  for (int r = 0; r < rows && splits > 0; ++r) {
    const size_t at = static_cast<size_t>(r) * splits;
    hd::MergeSplits(&partial_out[at * d], &partial_lse[at], splits, d,
                    &out[static_cast<size_t>(r) * d], &lse[r]);
  }

  for (int i = 0; i < task.num_queries; ++i) {
    for (int g = 0; g < group; ++g) {
      const int r = i * group + g;
      float* o = &out[static_cast<size_t>(r) * d];
      if (v.rotation_signs) hd::HadamardInverse(v.rotation_signs, d, o);
      std::copy(o, o + d, task.out + static_cast<size_t>(i) * task.out_stride + static_cast<size_t>(g) * d);
      task.lse[static_cast<size_t>(i) * task.lse_stride + g] = lse[r];
    }
  }
}

}  // namespace

absl::Status HostAttend(absl::Span<const AttentionTask> tasks, const AttentionOptions& options) {
  HostStreamView view;
  const KvStream* filled = nullptr;
  for (const AttentionTask& task : tasks) {
    if (task.stream->crq() != nullptr) {
      HostAttendCrq(task, options);
      continue;
    }
    if (task.stream != filled) {
      FillView(*task.stream, &view);
      filled = task.stream;
    }
    AttendTask(task, options, view.view);
  }
  return absl::OkStatus();
}

}  // namespace kvq
