// The per-element math of decode attention, as KVQ_HD functions: RoPE of a
// pre-RoPE key, the Hadamard rotation of a query and its inverse on the
// output, the online-softmax update for one score, and the exact merge of
// two partial results (out, lse). The CUDA kernels (cuda_attention.cu) and
// the "cuda_host" backend (host_attention.cc) both compose these, so the
// host build tests the device's arithmetic against the reference
// (tests/unit/attention_hd_test.cc, attention_test.cc).
#ifndef KVQ_KERNELS_HD_ATTENTION_HD_H_
#define KVQ_KERNELS_HD_ATTENTION_HD_H_

#include <cmath>
#include <cstdint>

#include "kernels/hd/dequant_hd.h"
#include "kernels/hd/device_stream_view.h"
#include "kernels/hd/hd.h"
#include "kernels/hd/numeric_hd.h"

namespace kvq::hd {

// cuda_host's keys per flash-decoding split (rounded up to whole pages by
// SplitTokensAtLeast): the device sizes its splits from the batch and the
// SM count (DecodeAttentionSplitTokens), at least this many keys each.
inline constexpr int kAttentionSplitTokens = 256;

KVQ_HD float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
KVQ_HD float Log(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  return std::log(x);
#endif
}
KVQ_HD float Max(float a, float b) { return a < b ? b : a; }  // std::max's NaN rule.
// INFINITY rather than numeric_limits: the latter is a host constexpr
// function that device code may not call without relaxed constexpr.
KVQ_HD float NegInf() { return -INFINITY; }

// ---------------------------------------------------------------------------
// RoPE (kernels/rope.h): the same base, inverse frequencies and position
// scaling, computed in double as Rope does; only cos and sin differ on the
// device (the angle is reduced to [-pi, pi] in double, then sincosf), which
// keeps a key within a few float ulps of Rope::Apply at any position.
// ---------------------------------------------------------------------------
KVQ_HD RopeParams MakeRopeParams(float theta, int rotary_dim, bool adjacent, bool ntk,
                                 float linear_factor, float ntk_factor) {
  RopeParams p;
  p.rotary_dim = rotary_dim;
  p.adjacent = adjacent;
  double base = theta;
  if (ntk) {
    base *= pow(static_cast<double>(ntk_factor),
                static_cast<double>(rotary_dim) / (rotary_dim - 2));
  }
  p.base = base;
  p.linear_factor = linear_factor;
  return p;
}

// Inverse frequency of pair i: base^(-2i / rotary_dim), Rope's exact double.
KVQ_HD double RopeInvFreq(const RopeParams& p, int pair) {
  return pow(p.base, -2.0 * pair / p.rotary_dim);
}
KVQ_HD int RopeFirst(const RopeParams& p, int pair) { return p.adjacent ? 2 * pair : pair; }
KVQ_HD int RopeSecond(const RopeParams& p, int pair) {
  return p.adjacent ? 2 * pair + 1 : pair + p.rotary_dim / 2;
}

// cos and sin of pair `inv_freq`'s angle at `position`, as floats.
KVQ_HD void RopeCosSin(const RopeParams& p, double inv_freq, int position, float* c, float* s) {
  double pos = position;
  if (p.linear_factor != 1.0f) pos /= p.linear_factor;
  const double a = pos * inv_freq;
#if defined(__CUDA_ARCH__)
  // Reduce in double so float sincos sees a small angle: at position 32k a
  // float angle alone would be off by ~2e-3 rad.
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  const double r = a - rint(a * (1.0 / kTwoPi)) * kTwoPi;
  sincosf(static_cast<float>(r), s, c);
#else
  *c = static_cast<float>(std::cos(a));
  *s = static_cast<float>(std::sin(a));
#endif
}

// (x0, x1) rotated by (c, s), each product rounded on its own as Rope::Apply
// does (no contraction).
KVQ_HD void RotatePair(float x0, float x1, float c, float s, float* r0, float* r1) {
#if defined(__CUDA_ARCH__)
  *r0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  *r1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
#else
  volatile float a = x0 * c, b = x1 * s, e = x0 * s, f = x1 * c;
  *r0 = a - b;
  *r1 = e + f;
#endif
}

// x[head_dim] rotated to `position` in place (a serial program: the host's
// form; the device kernel gives each thread its own pairs).
KVQ_HD void ApplyRope(const RopeParams& p, float* x, int position) {
  for (int i = 0; i < p.rotary_dim / 2; ++i) {
    float c, s;
    RopeCosSin(p, RopeInvFreq(p, i), position, &c, &s);
    float& x0 = x[RopeFirst(p, i)];
    float& x1 = x[RopeSecond(p, i)];
    RotatePair(x0, x1, c, s, &x0, &x1);
  }
}

// ---------------------------------------------------------------------------
// Hadamard rotation (kernels/hadamard.h): H = W diag(signs) / sqrt(d). The
// butterflies are the same adds in any order of stages' pairs, so a device
// version that runs one stage's pairs in parallel gives these bits.
// ---------------------------------------------------------------------------
KVQ_HD void WalshHadamardStage(float* x, int n, int len) {
  for (int i = 0; i < n; i += len << 1) {
    for (int j = i; j < i + len; ++j) {
      const float a = x[j];
      const float b = x[j + len];
      x[j] = a + b;
      x[j + len] = a - b;
    }
  }
}
KVQ_HD float HadamardNorm(int d) { return 1.0f / sqrtf(static_cast<float>(d)); }

// x <- H x.
KVQ_HD void HadamardForward(const float* signs, int d, float* x) {
  for (int i = 0; i < d; ++i) x[i] *= signs[i];
  for (int len = 1; len < d; len <<= 1) WalshHadamardStage(x, d, len);
  const float norm = HadamardNorm(d);
  for (int i = 0; i < d; ++i) x[i] *= norm;
}
// x <- H^T x.
KVQ_HD void HadamardInverse(const float* signs, int d, float* x) {
  for (int len = 1; len < d; len <<= 1) WalshHadamardStage(x, d, len);
  const float norm = HadamardNorm(d);
  for (int i = 0; i < d; ++i) x[i] *= norm * signs[i];
}

// ---------------------------------------------------------------------------
// Online softmax: one row's running max and sum of exp(score - max); its
// output accumulator (sum of weight * value) lives with the caller.
// ---------------------------------------------------------------------------
struct SoftmaxState {
  float max = -INFINITY;
  float sum = 0.0f;
};

// What folding one score asks of the accumulator: acc = acc * rescale +
// weight * value.
struct SoftmaxStep {
  float rescale = 1.0f;
  float weight = 0.0f;
};

// Folds `score` into `state`. A -inf score (a key whose score underflowed,
// or a masked one) changes nothing; +inf or NaN make the sum NaN, so the
// row's result is not finite and CheckAttentionResults fails the call, as
// it does for the reference.
KVQ_HD SoftmaxStep SoftmaxPush(SoftmaxState* state, float score) {
  const float new_max = Max(state->max, score);
  SoftmaxStep step;
  if (new_max == NegInf()) return step;  // Nothing visible yet, and not now.
  step.rescale = Exp(state->max - new_max);  // 0 for the first finite score.
  step.weight = Exp(score - new_max);
  state->sum = state->sum * step.rescale + step.weight;
  state->max = new_max;
  return step;
}

// Folds a whole tile's scores at once (the device's form): the new max is
// the max over the tile, then each weight is exp(score - max). Returns the
// rescale for the accumulator; weights[] receive exp(score - max).
KVQ_HD float SoftmaxPushTile(SoftmaxState* state, const float* scores, int n, float* weights) {
  float new_max = state->max;
  for (int i = 0; i < n; ++i) new_max = Max(new_max, scores[i]);
  if (new_max == NegInf()) {
    for (int i = 0; i < n; ++i) weights[i] = 0.0f;
    return 1.0f;
  }
  const float rescale = Exp(state->max - new_max);
  float sum = state->sum * rescale;
  for (int i = 0; i < n; ++i) {
    weights[i] = Exp(scores[i] - new_max);
    sum += weights[i];
  }
  state->sum = sum;
  state->max = new_max;
  return rescale;
}

// The row's partial result: out = acc / sum and lse = max + log(sum), or
// zeros and -inf when it saw nothing.
KVQ_HD float SoftmaxLse(const SoftmaxState& state) {
  if (state.sum == 0.0f) return NegInf();
  return state.max + Log(state.sum);
}
KVQ_HD float SoftmaxOutScale(const SoftmaxState& state) {
  return state.sum == 0.0f ? 0.0f : 1.0f / state.sum;
}

// ---------------------------------------------------------------------------
// The exact merge of two partials over disjoint keys: kvq::MergeAttention's
// arithmetic step for step (the same bits on the host). `out` may alias
// out_a or out_b.
// ---------------------------------------------------------------------------
struct MergeWeights {
  float a = 0.0f;    // Weight of partial a (already divided by the total).
  float b = 0.0f;
  float lse = 0.0f;  // The merged log-sum-exp.
  bool empty = true;  // Both partials were empty: zeros and -inf.
};

KVQ_HD MergeWeights MergeWeightsOf(float lse_a, float lse_b) {
  MergeWeights w;
  const float m = Max(lse_a, lse_b);
  if (m == NegInf()) {
    w.lse = m;
    return w;
  }
  w.empty = false;
  w.a = Exp(lse_a - m);
  w.b = Exp(lse_b - m);
  w.lse = m + Log(w.a + w.b);
  return w;
}

// Channel c of the merge: (wa * a + wb * b) / (wa + wb), as MergeAttention.
KVQ_HD float MergeChannel(const MergeWeights& w, float a, float b) {
  if (w.empty) return 0.0f;
  const float inv = 1.0f / (w.a + w.b);
  return (w.a * a + w.b * b) * inv;
}

// The merge of n partials in one step (the merge kernel's form, each
// thread a channel): with m the largest lse, partial s weighs
// exp(lse_s - m); out = sum_s w_s out_s / sum_s w_s and lse = m + log(sum_s
// w_s); zeros and -inf when every partial is empty. The same sums as n - 1
// pairwise MergePartials up to rounding.
KVQ_HD float MergeWeight(float lse, float max_lse) {
  return max_lse == NegInf() ? 0.0f : Exp(lse - max_lse);
}
KVQ_HD float MergedLse(float max_lse, float weight_sum) {
  return max_lse == NegInf() ? NegInf() : max_lse + Log(weight_sum);
}
// weight_sum lies in [1, splits] (the largest weight is 1), where the
// device's fast division (2 ulp, no slow-path call) is safe.
KVQ_HD float MergedChannel(float weighted_sum, float weight_sum) {
  if (weight_sum == 0.0f) return 0.0f;
#if defined(__CUDA_ARCH__)
  return __fdividef(weighted_sum, weight_sum);
#else
  return weighted_sum / weight_sum;
#endif
}
// The serial form: outs[s * head_dim + c], lses[s].
KVQ_HD void MergeSplits(const float* outs, const float* lses, int n, int head_dim, float* out,
                        float* lse) {
  float m = NegInf();
  for (int s = 0; s < n; ++s) m = Max(m, lses[s]);
  float sum = 0.0f;
  for (int s = 0; s < n; ++s) sum += MergeWeight(lses[s], m);
  for (int c = 0; c < head_dim; ++c) {
    float acc = 0.0f;
    for (int s = 0; s < n; ++s) acc += MergeWeight(lses[s], m) * outs[static_cast<size_t>(s) * head_dim + c];
    out[c] = MergedChannel(acc, sum);
  }
  *lse = MergedLse(m, sum);
}

// ---------------------------------------------------------------------------
// Flash-decoding splits: a task's keys [key_begin, key_end) are cut at
// origin + s * split_tokens, origin the first token of the page holding
// key_begin (extended below page_base in whole pages), so with
// split_tokens a multiple of page_tokens no page is read by two splits.
// split_tokens >= page_tokens keeps every split non-empty.
// ---------------------------------------------------------------------------
KVQ_HD int SplitOrigin(int key_begin, int page_base, int page_tokens) {
  if (page_tokens <= 0) return key_begin;
  const int rel = key_begin - page_base;
  const int pages = rel >= 0 ? rel / page_tokens : -((page_tokens - 1 - rel) / page_tokens);
  return page_base + pages * page_tokens;
}
KVQ_HD int SplitCount(int origin, int key_begin, int key_end, int split_tokens) {
  if (key_end <= key_begin) return 0;
  return (key_end - origin + split_tokens - 1) / split_tokens;
}
KVQ_HD int SplitBegin(int origin, int key_begin, int split, int split_tokens) {
  const int b = origin + split * split_tokens;
  return b > key_begin ? b : key_begin;
}
KVQ_HD int SplitEnd(int origin, int key_end, int split, int split_tokens) {
  const int e = origin + (split + 1) * split_tokens;
  return e < key_end ? e : key_end;
}
// The smallest multiple of page_tokens that is >= tokens.
KVQ_HD int SplitTokensAtLeast(int tokens, int page_tokens) {
  const int pt = page_tokens > 0 ? page_tokens : 1;
  return (tokens + pt - 1) / pt * pt;
}

KVQ_HD void MergePartials(const float* out_a, float lse_a, const float* out_b, float lse_b,
                          int head_dim, float* out, float* lse) {
  const MergeWeights w = MergeWeightsOf(lse_a, lse_b);
  for (int c = 0; c < head_dim; ++c) out[c] = MergeChannel(w, out_a[c], out_b[c]);
  *lse = w.lse;
}

// ---------------------------------------------------------------------------
// Rows of a stream: sink, page or tail, in the stored basis (pre-RoPE,
// rotated), as floats.
// ---------------------------------------------------------------------------
KVQ_HD const SideExtras& ExtrasOf(const DeviceStreamView& v, Side side) {
  return side == Side::kKey ? v.key_extras : v.value_extras;
}

KVQ_HD void LoadStoredRow(const DeviceStreamView& v, Side side, int t, float* out) {
  const int d = v.layout.head_dim;
  const uint16_t* fp16 = nullptr;
  if (t < v.sink_tokens) {
    fp16 = (side == Side::kKey ? v.sink_k : v.sink_v) + static_cast<size_t>(t) * d;
  } else if (t < v.sink_tokens + v.quantized_tokens) {
    const int q = t - v.page_base;
    const uint8_t* page = v.pages[q / v.layout.page_tokens];
    const int row = q % v.layout.page_tokens;
    const SideLayout& S = v.layout.side(side);
    for (int c = 0; c < d; ++c) out[c] = DequantElement(v.layout, S, page, row, c, ExtrasOf(v, side));
    ApplyOutliers(v.layout, S, page, row, 1, out);
    return;
  } else {
    const int i = t - v.sink_tokens - v.quantized_tokens;
    fp16 = (side == Side::kKey ? v.tail_k : v.tail_v) + static_cast<size_t>(i) * d;
  }
  for (int c = 0; c < d; ++c) out[c] = HalfToFloat(fp16[c]);
}

// Key t as attention sees it in the stored basis: RoPE applied to pre-RoPE
// keys (still rotated when the stream rotates; the query is rotated too).
KVQ_HD void LoadKeyForScore(const DeviceStreamView& v, int t, float* out) {
  LoadStoredRow(v, Side::kKey, t, out);
  if (v.rope.rotary_dim > 0) ApplyRope(v.rope, out, t);
}

// ---------------------------------------------------------------------------
// The tensor-core kernel's dequantization of 2- and 4-bit codes, four
// channels per 32-bit word of a bit plane (page_layout.h: byte j of plane
// m holds channel j + m * P at bit m * bits, P = head_dim * bits / 8).
// ---------------------------------------------------------------------------
// Quads per row: head_dim / 4. Quad qi covers plane m = qi / (P / 4),
// bytes 4 * quad .. 4 * quad + 3 of it, channels QuadChannel(..) + 0..3.
KVQ_HD void QuadOf(int head_dim, int bits, int qi, int* m, int* quad) {
  const int plane_quads = head_dim * bits / 32;
  *m = qi / plane_quads;
  *quad = qi % plane_quads;
}
KVQ_HD int QuadChannel(int head_dim, int bits, int m, int quad) {
  return m * (head_dim * bits / 8) + 4 * quad;
}
// The four codes of a quad, one per byte (channel QuadChannel + k in byte k).
// The row must be 4-byte aligned (QuadDequantTakes).
KVQ_HD uint32_t QuadCodes(const uint8_t* code_row, int bits, int m, int quad) {
  const uint8_t* w = code_row + 4 * quad;
#if defined(__CUDA_ARCH__)
  const uint32_t word = *reinterpret_cast<const uint32_t*>(w);
#else
  const uint32_t word = static_cast<uint32_t>(w[0]) | (static_cast<uint32_t>(w[1]) << 8) |
                        (static_cast<uint32_t>(w[2]) << 16) | (static_cast<uint32_t>(w[3]) << 24);
#endif
  return (word >> (m * bits)) & (bits == 4 ? 0x0f0f0f0fu : 0x03030303u);
}

// Whether a side's page rows take the quad dequantization: one plane of 2-
// or 4-bit codes, uniform levels (no nuq table), fp16 parameters, plane
// words of 4 whole bytes, and token groups that a quad does not straddle.
KVQ_HD bool QuadDequantTakes(const PageLayout& L, const SideLayout& S, const SideExtras& extras) {
  return S.format == CodeFormat::kPacked && (S.bits == 2 || S.bits == 4) &&
         extras.levels == nullptr && S.param_bits == 16 && (L.head_dim * S.bits / 8) % 4 == 0 &&
         S.code_row_bytes % 4 == 0 && S.codes_offset % 4 == 0 && S.params_offset % 4 == 0 &&
         (S.axis != ParamAxis::kTokenGroups || S.group_channels % 4 == 0);
}

// Byte offsets in the page of the fp16 scale and zero of channel `c` (a
// multiple of 4) of page row `row`, fp16 parameters only. Per-channel
// parameters (keys) differ per channel, so a quad reads two half2 of each
// from there; per-token groups hold one value for the whole quad.
struct QuadParams {
  size_t scale = 0;
  size_t zero = 0;
  bool per_channel = false;
};
// From the row's RowParams and channel c's group (the device's lookups).
KVQ_HD QuadParams QuadParamsFrom(const SideLayout& S, const RowParams& rp, int c, int group,
                                 int n) {
  QuadParams q;
  if (S.axis == ParamAxis::kChannelGroups) {
    q.scale = rp.entry + 2 * static_cast<size_t>(c);
    q.zero = rp.entry + 2 * static_cast<size_t>(n + c);
    q.per_channel = true;
  } else {
    q.scale = rp.entry + 2 * static_cast<size_t>(group);
    q.zero = rp.entry + 2 * static_cast<size_t>(n + group);
  }
  return q;
}
KVQ_HD QuadParams QuadParamsAt(const PageLayout& L, const SideLayout& S, int row, int c) {
  return QuadParamsFrom(S, RowParamsOf(L, S, row), c, GroupOfChannel(S, c), L.ParamsPerEntry(S));
}

// fp16 operands of the tensor-core kernel. fp16's largest finite value is
// 65504: a larger query component or a dequantized key or value that
// rounds past it would become inf and the row's scores NaN. A query row
// whose largest magnitude passes kHalfQueryLimit is scaled by a power of
// two (exact: only the exponent changes) before the conversion and its
// scores by the inverse in fp32; keys and values are clamped to the finite
// range (a value the codes put past 65504 is the range's end anyway).
inline constexpr float kHalfMax = 65504.0f;
inline constexpr float kHalfQueryLimit = 32768.0f;
// 1, or the power of two 2^-k (smallest k) that brings max_abs to at most
// kHalfQueryLimit. max_abs is finite (queries are checked); a non-finite
// one ends at 0 rather than looping.
KVQ_HD float HalfQueryScale(float max_abs) {
  float s = 1.0f;
  while (s > 0.0f && max_abs * s > kHalfQueryLimit) s *= 0.5f;
  return s;
}
// 1 / HalfQueryScale(max_abs), exactly (a power of two, no division).
KVQ_HD float HalfQueryUnscale(float scale) {
  float u = 1.0f;
  for (float t = scale; t > 0.0f && t < 1.0f; t *= 2.0f) u *= 2.0f;
  return u;
}
KVQ_HD float ClampToHalfRange(float x) {
  return x > kHalfMax ? kHalfMax : (x < -kHalfMax ? -kHalfMax : x);
}

// fp16 bits of 1024 + code: a code of up to 10 bits in the mantissa of
// 1024.0, whose ulp is 1, so subtracting 1024 gives the code exactly.
inline constexpr uint16_t kHalfMagic1024 = 0x6400;

KVQ_HD float Dot(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; ++c) s += a[c] * b[c];
  return s;
}

}  // namespace kvq::hd

#endif  // KVQ_KERNELS_HD_ATTENTION_HD_H_
