// "cuda_host" attention of crq streams: the device's coded-space algorithm
// (kernels/cuda/cuda_crq.cu, CrqSplitKernel) as a serial program on the CPU,
// from the same crq_hd.h / attention_hd.h functions. Per chunk of
// hd::kAttentionSplitTokens keys (partials merged by log-sum-exp, as the
// device merges its splits): a coded key scores q . R_t mu_k + g_t (qr .
// level[code]), an fp16 key q . R_t k; coded values accumulate in the
// rotated basis and are rotated back once per chunk. Page bytes come only
// through HostPagePointer.
#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/crq_transform.h"
#include "kernels/cuda/host_program_backend.h"
#include "kernels/cuda/stream_view_host.h"
#include "kernels/hd/attention_hd.h"
#include "kernels/hd/crq_hd.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

// One chunk [begin, end) of one query row: normalized output in the
// original basis and its lse.
void AttendChunk(const KvStream& s, const hd::RopeParams& rope, const float* q, const float* qr,
                 int begin, int end, float* out, float* lse) {
  const CrqTransform& T = *s.crq();
  const HeadCalibration& cal = T.calibration();
  const PageLayout& L = s.layout();
  const hd::CrqCodebooks& cb = CrqCodebooks();
  const int d = s.head_dim();
  const int pt = L.page_tokens;
  std::vector<float> key(d), levels(d), value(d), acc(d, 0.0f), acc_coded(d, 0.0f);
  auto gain = [&](const uint8_t* page, const SideLayout& S, int row) {
    return hd::HalfToFloat(*PageLayout::Gain(page, S, row));
  };
  hd::SoftmaxState state;
  float coded_sum = 0.0f;
  for (int t = begin; t < end; ++t) {
    const bool coded = t >= s.sink_tokens() && t - s.page_base() < s.quantized_tokens();
    float score;
    if (coded) {
      const int u = t - s.page_base();
      const uint8_t* page = HostPagePointer(s, u / pt);
      const uint8_t* krow = PageLayout::CodeRow(page, L.key, u % pt);
      const uint8_t* vrow = PageLayout::CodeRow(page, L.value, u % pt);
      const float vg = gain(page, L.value, u % pt);
      std::copy(cal.key_mean.begin(), cal.key_mean.end(), key.begin());
      for (int c = 0; c < d; ++c) {
        levels[c] = hd::CrqDequant(krow, d, L.key.half_bits, 1.0f, cb, c);
        value[c] = hd::CrqDequant(vrow, d, L.value.half_bits, vg, cb, c);
      }
      hd::ApplyRope(rope, key.data(), t);
      score = hd::Dot(q, key.data(), d) + gain(page, L.key, u % pt) * hd::Dot(qr, levels.data(), d);
    } else {
      const bool sink = t < s.sink_tokens();
      const int i = t - s.page_base() - s.quantized_tokens();
      const uint16_t* k = sink ? s.sink_row(Side::kKey, t) : s.tail_row(Side::kKey, i);
      const uint16_t* v = sink ? s.sink_row(Side::kValue, t) : s.tail_row(Side::kValue, i);
      for (int c = 0; c < d; ++c) {
        key[c] = hd::HalfToFloat(k[c]);
        value[c] = hd::HalfToFloat(v[c]);
      }
      hd::ApplyRope(rope, key.data(), t);
      score = hd::Dot(q, key.data(), d);
    }
    const hd::SoftmaxStep step = hd::SoftmaxPush(&state, score);
    for (int c = 0; c < d; ++c) {
      acc[c] *= step.rescale;
      acc_coded[c] *= step.rescale;
    }
    float* to = coded ? acc_coded.data() : acc.data();
    for (int c = 0; c < d; ++c) to[c] += step.weight * value[c];
    coded_sum = coded_sum * step.rescale + (coded ? step.weight : 0.0f);
  }
  const float inv = hd::SoftmaxOutScale(state);
  for (int c = 0; c < d; ++c) acc_coded[c] *= inv;
  hd::HadamardInverse(T.rotation().signs().data(), d, acc_coded.data());
  for (int c = 0; c < d; ++c) {
    out[c] = acc[c] * inv + cal.value_mean[c] * (coded_sum * inv) +
             cal.value_scale[c] * acc_coded[c];
  }
  *lse = hd::SoftmaxLse(state);
}

}  // namespace

void HostAttendCrq(const AttentionTask& task, const AttentionOptions& options) {
  const KvStream& s = *task.stream;
  const CrqTransform& T = *s.crq();
  const hd::RopeParams rope = ViewWithoutPointers(s).rope;
  const int d = s.head_dim();
  const float scale = SoftmaxScale(options, d);
  const int end = task.key_end == -1 ? s.num_tokens() : task.key_end;
  std::vector<float> q(d), qr(d), part(d);
  for (int i = 0; i < task.num_queries; ++i) {
    const int visible = task.q_positions ? std::min(end, task.q_positions[i] + 1) : end;
    for (int g = 0; g < options.group_size; ++g) {
      const float* src =
          task.q + static_cast<size_t>(i) * task.q_stride + static_cast<size_t>(g) * d;
      T.AttentionQuery(src, scale, q.data(), qr.data());
      float* out = task.out + static_cast<size_t>(i) * task.out_stride + static_cast<size_t>(g) * d;
      float* lse = task.lse + static_cast<size_t>(i) * task.lse_stride + g;
      std::fill(out, out + d, 0.0f);
      *lse = -std::numeric_limits<float>::infinity();
      for (int c0 = task.key_begin; c0 < visible; c0 += hd::kAttentionSplitTokens) {
        float l;
        AttendChunk(s, rope, q.data(), qr.data(), c0,
                    std::min(visible, c0 + hd::kAttentionSplitTokens), part.data(), &l);
        MergeAttention(out, *lse, part.data(), l, d, out, lse);
      }
    }
  }
}

}  // namespace kvq
