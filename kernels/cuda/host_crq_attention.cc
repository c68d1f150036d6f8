// "cuda_host" attention of crq streams: the coded-space algorithm
// (docs/KERNELS.md, "crq") composed from crq_hd.h's per-element math, key
// ranges cut into hd::kAttentionSplitTokens chunks whose partials merge by
// log-sum-exp, as a device kernel would split them. Page bytes come only
// through HostPagePointer.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/crq_transform.h"
#include "kernels/cuda/host_program_backend.h"
#include "kernels/hd/attention_hd.h"
#include "kernels/hd/crq_hd.h"
#include "kernels/kv_stream.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

// One chunk [begin, end) of one query row: normalized output in the
// original basis and its lse.
void AttendChunk(const KvStream& s, const float* q, const float* qr, const float* a,
                 const float* b, float fixed, int begin, int end, float* out, float* lse) {
  const CrqTransform& T = *s.crq();
  const HeadCalibration& cal = T.calibration();
  const Rope& rope = T.rope();
  const PageLayout& L = s.layout();
  const hd::CrqCodebooks& cb = CrqCodebooks();
  const int d = s.head_dim();
  const int pt = L.page_tokens;
  const int pairs = rope.rotary_dim() / 2;
  const int n = end - begin;
  std::vector<float> scores(n), x(d), acc(d, 0.0f), acc_coded(d, 0.0f);
  auto coded = [&](int t) { return t >= s.sink_tokens() && t - s.page_base() < s.quantized_tokens(); };
  auto gain = [&](const uint8_t* page, const SideLayout& S, int row) {
    return hd::HalfToFloat(hd::LoadHalfBits(reinterpret_cast<const uint8_t*>(PageLayout::Gain(page, S, row))));
  };
  auto fp16_row = [&](Side side, int t) {
    const uint16_t* h = t < s.sink_tokens() ? s.sink_row(side, t)
                                            : s.tail_row(side, t - s.page_base() - s.quantized_tokens());
    for (int c = 0; c < d; ++c) x[c] = hd::HalfToFloat(h[c]);
  };
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) {
    const int t = begin + i;
    float score = 0.0f;
    if (coded(t)) {
      const int u = t - s.page_base();
      const uint8_t* page = HostPagePointer(s, u / pt);
      const uint8_t* row = PageLayout::CodeRow(page, L.key, u % pt);
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot += qr[c] * hd::CrqDequant(row, d, L.key.half_bits, 1.0f, cb, c);
      float mean = fixed;
      for (int j = 0; j < pairs; ++j) {
        const double angle = rope.Angle(j, t);
        mean += a[j] * static_cast<float>(std::cos(angle)) + b[j] * static_cast<float>(std::sin(angle));
      }
      score = mean + gain(page, L.key, u % pt) * dot;
    } else {
      fp16_row(Side::kKey, t);
      rope.Apply(x.data(), t);
      for (int c = 0; c < d; ++c) score += q[c] * x[c];
    }
    scores[i] = score;
    mx = std::max(mx, score);
  }
  float sum = 0.0f, sum_coded = 0.0f;
  for (int i = 0; i < n; ++i) {
    const int t = begin + i;
    const float p = std::exp(scores[i] - mx);
    sum += p;
    if (coded(t)) {
      const int u = t - s.page_base();
      const uint8_t* page = HostPagePointer(s, u / pt);
      const uint8_t* row = PageLayout::CodeRow(page, L.value, u % pt);
      const float w = p * gain(page, L.value, u % pt);
      for (int c = 0; c < d; ++c) acc_coded[c] += hd::CrqDequant(row, d, L.value.half_bits, w, cb, c);
      sum_coded += p;
    } else {
      fp16_row(Side::kValue, t);
      for (int c = 0; c < d; ++c) acc[c] += p * x[c];
    }
  }
  for (int c = 0; c < d; ++c) acc_coded[c] /= sum;
  T.rotation().Inverse(acc_coded.data());
  for (int c = 0; c < d; ++c) {
    out[c] = acc[c] / sum + cal.value_mean[c] * (sum_coded / sum) + cal.value_scale[c] * acc_coded[c];
  }
  *lse = mx + std::log(sum);
}

}  // namespace

void HostAttendCrq(const AttentionTask& task, const AttentionOptions& options) {
  const KvStream& s = *task.stream;
  const CrqTransform& T = *s.crq();
  const HeadCalibration& cal = T.calibration();
  const Rope& rope = T.rope();
  const int d = s.head_dim();
  const int pairs = rope.rotary_dim() / 2;
  const float scale = SoftmaxScale(options, d);
  const int end = task.key_end == -1 ? s.num_tokens() : task.key_end;
  std::vector<float> q(d), qr(d), a(pairs), b(pairs), part(d);
  std::vector<char> rotates(d, 0);
  for (int j = 0; j < pairs; ++j) rotates[rope.First(j)] = rotates[rope.Second(j)] = 1;
  for (int i = 0; i < task.num_queries; ++i) {
    const int visible = task.q_positions ? std::min(end, task.q_positions[i] + 1) : end;
    for (int g = 0; g < options.group_size; ++g) {
      const float* src = task.q + static_cast<size_t>(i) * task.q_stride + static_cast<size_t>(g) * d;
      for (int c = 0; c < d; ++c) q[c] = src[c] * scale;
      for (int c = 0; c < d; ++c) qr[c] = q[c] * cal.key_scale[c];
      T.rotation().Forward(qr.data());
      float fixed = 0.0f;
      for (int c = 0; c < d; ++c) {
        if (!rotates[c]) fixed += q[c] * cal.key_mean[c];
      }
      for (int j = 0; j < pairs; ++j) {
        const int f = rope.First(j), sc = rope.Second(j);
        hd::CrqMeanPair(q[f], q[sc], cal.key_mean[f], cal.key_mean[sc], &a[j], &b[j]);
      }
      float* out = task.out + static_cast<size_t>(i) * task.out_stride + static_cast<size_t>(g) * d;
      float* lse = task.lse + static_cast<size_t>(i) * task.lse_stride + g;
      std::fill(out, out + d, 0.0f);
      *lse = -std::numeric_limits<float>::infinity();
      for (int c0 = task.key_begin; c0 < visible; c0 += hd::kAttentionSplitTokens) {
        float l;
        AttendChunk(s, q.data(), qr.data(), a.data(), b.data(), fixed, c0,
                    std::min(visible, c0 + hd::kAttentionSplitTokens), part.data(), &l);
        MergeAttention(out, *lse, part.data(), l, d, out, lse);
      }
    }
  }
}

}  // namespace kvq
