#include "kernels/group_params.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/quant_math.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

bool FiniteHalf(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }
bool NonNegativeHalf(uint16_t h) { return (h & 0x8000u) == 0 || (h & 0x7fffu) == 0; }

struct Header8 {
  uint16_t scale_step;
  uint16_t zero_base;
  uint16_t zero_step;
  uint16_t unused;
};
static_assert(sizeof(Header8) == kParams8HeaderBytes);

Header8 ReadHeader(const uint8_t* block) {
  Header8 h;
  std::memcpy(&h, block, sizeof(h));
  return h;
}

// One p8 block: `groups` ranges in, codes and header out, decoded params back.
void Encode8(const float* lo, const float* hi, int groups, float top, uint8_t* block,
             float* scale, float* zero) {
  float zmin = INFINITY, zmax = -INFINITY;
  for (int i = 0; i < groups; ++i) {
    const float l = lo[i] > hi[i] ? 0.0f : lo[i];
    zmin = std::min(zmin, l);
    zmax = std::max(zmax, l);
  }
  Header8 h{};
  h.zero_base = FloatToHalfDown(zmin);
  const float base = HalfToFloat(h.zero_base);
  h.zero_step = FloatToHalfUp((zmax - base) / 255.0f);
  const float zstep = HalfToFloat(h.zero_step);
  uint8_t* scodes = block + kParams8HeaderBytes;
  uint8_t* zcodes = scodes + groups;
  float smax = 0.0f;
  for (int i = 0; i < groups; ++i) {
    const bool empty = lo[i] > hi[i];
    const float l = empty ? 0.0f : lo[i];
    const float u = empty ? 0.0f : hi[i];
    int z = zstep > 0.0f ? static_cast<int>(std::floor((l - base) / zstep)) : 0;
    z = std::clamp(z, 0, 255);
    // The division may round up across an integer: step back until the
    // decoded zero is at or below the group's minimum.
    while (z > 0 && base + static_cast<float>(z) * zstep > l) --z;
    zcodes[i] = static_cast<uint8_t>(z);
    zero[i] = base + static_cast<float>(z) * zstep;
    scale[i] = std::max(0.0f, (u - zero[i]) / top);  // The step this group needs.
    smax = std::max(smax, scale[i]);
  }
  h.scale_step = FloatToHalfUp(smax / 255.0f);
  const float sstep = HalfToFloat(h.scale_step);
  for (int i = 0; i < groups; ++i) {
    const bool empty = lo[i] > hi[i];
    const float u = empty ? 0.0f : hi[i];
    int s = sstep > 0.0f ? static_cast<int>(std::ceil(scale[i] / sstep)) : 0;
    s = std::clamp(s, 0, 255);
    while (s < 255 && zero[i] + static_cast<float>(s) * sstep * top < u) ++s;
    scodes[i] = static_cast<uint8_t>(s);
    scale[i] = static_cast<float>(s) * sstep;
  }
  std::memcpy(block, &h, sizeof(h));
}

// Four fp16 parameters per 64-bit word, checked in their 16-bit lanes at
// once: the sums below stay inside each lane (at most 0x8000 and 0xfffe), so
// no carry crosses into the next parameter. Bit 15 of a lane ends up set
// where the exponent is all ones (Inf / NaN) or, in the lanes of
// `scale_lanes`, where a nonzero scale carries a sign.
constexpr uint64_t Lanes(uint16_t x) { return 0x0001000100010001ull * x; }

uint64_t BadLanes(uint64_t w, uint64_t scale_lanes) {
  const uint64_t not_finite = (w & Lanes(0x7c00)) + Lanes(0x0400);
  const uint64_t negative = w & ((w & Lanes(0x7fff)) + Lanes(0x7fff)) & scale_lanes;
  return (not_finite | negative) & Lanes(0x8000);
}

uint64_t LoadWord(const uint16_t* p) {
  uint64_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// Whether any of `entries` fp16 entries (scale[n] then zero[n] each, from p
// on) has a scale that is not finite or negative, or a zero point that is
// not finite.
bool AnyBadParams(const uint16_t* p, int entries, int n) {
  const size_t halves = static_cast<size_t>(entries) * 2 * n;
  uint64_t bad = 0;
  if (n % 4 == 0) {  // Whole words of scales, then of zero points.
    for (size_t e = 0; e < halves; e += 2 * n) {
      for (int i = 0; i < n; i += 4) bad |= BadLanes(LoadWord(p + e + i), ~0ull);
      for (int i = n; i < 2 * n; i += 4) bad |= BadLanes(LoadWord(p + e + i), 0);
    }
  } else if (n == 1 || n == 2) {  // Whole entries per word: {s, z, s, z} or {s, s, z, z}.
    const uint64_t scale_lanes = n == 1 ? 0x0000ffff0000ffffull : 0x00000000ffffffffull;
    size_t i = 0;
    for (; i + 4 <= halves; i += 4) bad |= BadLanes(LoadWord(p + i), scale_lanes);
    if (i < halves) bad |= BadLanes(uint64_t{Load16(p, i)} | uint64_t{Load16(p, i + 1)} << 16, 0xffff);
  } else {  // Other n: a parameter at a time.
    for (size_t e = 0; e < halves; e += 2 * n) {
      for (int i = 0; i < n; ++i) {
        bad |= BadLanes(Load16(p, e + i), 0xffff) | BadLanes(Load16(p, e + n + i), 0);
      }
    }
  }
  return bad != 0;
}

}  // namespace

Params8Steps ReadParams8Steps(const uint8_t* block) {
  const Header8 h = ReadHeader(block);
  return {HalfToFloat(h.scale_step), HalfToFloat(h.zero_base), HalfToFloat(h.zero_step)};
}

uint16_t FloatToHalfDown(float f) {
  uint16_t h = FloatToHalf(f);
  if (!(HalfToFloat(h) > f)) return h;
  if ((h & 0x7fffu) == 0) return 0x8001u;  // Down from +-0: the smallest negative.
  return (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}

uint16_t FloatToHalfUp(float f) {
  return static_cast<uint16_t>(FloatToHalfDown(-f) ^ 0x8000u);
}

void StoreGroupParams(const PageLayout& L, const SideLayout& S, uint8_t* page, int first_entry,
                      int entries, const float* lo, const float* hi, bool nuq, float* scale,
                      float* zero) {
  const int n = L.ParamsPerEntry(S);
  if (S.param_bits == 16) {
    for (int e = 0; e < entries; ++e) {
      uint16_t* p = L.Params(page, S, first_entry + e);
      for (int i = 0; i < n; ++i) {
        const size_t k = static_cast<size_t>(e) * n + i;
        float mn = lo[k], mx = hi[k];
        if (mn > mx) mn = mx = 0.0f;
        const GroupParams g = MakeGroupParams(mn, mx, S.bits, nuq);
        p[i] = FloatToHalf(g.scale);
        p[n + i] = FloatToHalf(g.zero);
        scale[k] = g.scale;
        zero[k] = g.zero;
      }
    }
    return;
  }
  // The span of the levels: 2^bits - 1 codes, or nuq's normalised [0, 1].
  const float top = nuq ? 1.0f : static_cast<float>((1 << S.bits) - 1);
  const int per_block = L.EntriesPerBlock(S);
  const int groups = per_block * n;
  for (int e = 0; e < entries; e += per_block) {
    const size_t k = static_cast<size_t>(e) * n;
    Encode8(lo + k, hi + k, groups, top, L.ParamBlock(page, S, (first_entry + e) / per_block),
            scale + k, zero + k);
  }
}

void LoadGroupParams(const PageLayout& L, const SideLayout& S, const uint8_t* page,
                     int first_entry, int entries, float* out) {
  const int n = L.ParamsPerEntry(S);
  if (S.param_bits == 16) {
    const uint16_t* p = L.Params(page, S, first_entry);
    for (int i = 0; i < 2 * n * entries; ++i) out[i] = HalfToFloat(p[i]);
    return;
  }
  const int per_block = L.EntriesPerBlock(S);
  const int groups = per_block * n;
  // A run of entries in one block shares its header: decode it once.
  for (int e = 0; e < entries;) {
    const int entry = first_entry + e;
    const int run = std::min(entries - e, per_block - entry % per_block);
    const uint8_t* block = L.ParamBlock(page, S, entry / per_block);
    const Params8Steps h = ReadParams8Steps(block);
    const float sstep = h.scale_step;
    const float base = h.zero_base;
    const float zstep = h.zero_step;
    const uint8_t* scodes = block + kParams8HeaderBytes + (entry % per_block) * n;
    const uint8_t* zcodes = scodes + groups;
    for (int r = 0; r < run; ++r, scodes += n, zcodes += n) {
      float* o = out + static_cast<size_t>(e + r) * 2 * n;
      for (int i = 0; i < n; ++i) {
        o[i] = static_cast<float>(scodes[i]) * sstep;
        o[n + i] = base + static_cast<float>(zcodes[i]) * zstep;
      }
    }
    e += run;
  }
}

absl::Status CheckGroupParams(const PageLayout& L, const SideLayout& S, const uint8_t* page,
                              int rows) {
  if (S.axis == ParamAxis::kNone) return absl::OkStatus();
  if (S.axis == ParamAxis::kTokenGain) {
    for (int r = 0; r < rows; ++r) {
      const uint16_t g = Load16(PageLayout::Gain(page, S, r), 0);
      if (!FiniteHalf(g) || !NonNegativeHalf(g)) {
        return absl::InvalidArgumentError(
            absl::StrCat("row ", r, ": gain must be finite and >= 0"));
      }
    }
    return absl::OkStatus();
  }
  const int n = L.ParamsPerEntry(S);
  if (S.param_bits == 8) {
    for (int b = 0; b < rows / L.block_tokens; ++b) {
      const Header8 h = ReadHeader(L.ParamBlock(page, S, b));
      const char* what = nullptr;
      if (!FiniteHalf(h.scale_step) || !NonNegativeHalf(h.scale_step)) {
        what = "scale step must be finite and >= 0";
      } else if (!FiniteHalf(h.zero_base)) {
        what = "zero base is not finite";
      } else if (!FiniteHalf(h.zero_step) || !NonNegativeHalf(h.zero_step)) {
        what = "zero step must be finite and >= 0";
      }
      if (what != nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("block ", b, ": ", what));
      }
    }
    return absl::OkStatus();
  }
  const int entries = S.axis == ParamAxis::kChannelGroups ? rows / L.block_tokens : rows;
  // One branch-free pass first (a check per parameter cost a fifth of a
  // client's raw-page dequantization); the loop below names what is wrong.
  if (!AnyBadParams(L.Params(page, S, 0), entries, n)) return absl::OkStatus();
  for (int e = 0; e < entries; ++e) {
    const uint16_t* p = L.Params(page, S, e);
    for (int i = 0; i < n; ++i) {
      if (!FiniteHalf(Load16(p, i)) || !NonNegativeHalf(Load16(p, i))) {
        return absl::InvalidArgumentError(
            absl::StrCat("row ", e, ": scale ", i, " must be finite and >= 0"));
      }
      if (!FiniteHalf(Load16(p, n + i))) {
        return absl::InvalidArgumentError(
            absl::StrCat("row ", e, ": zero point ", i, " is not finite"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvq
