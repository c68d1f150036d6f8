// PageLayout: where every byte of a quantized KV page lives.
//
// A page holds `page_tokens` consecutive tokens of one (layer, KV head)
// stream: key codes, value codes, their scales/zero points and the sparse
// outlier tables (code sections aligned to kPageAlign bytes, tables to
// kTableAlign, the page size a multiple of kPageAlign). The reference
// kernels, the SIMD kernels and the CUDA kernels all address pages only
// through this struct, so the offset math exists exactly once.
//
// Codes are token-major: row t holds the codes of token t. Sub-byte codes use
// bit planes: a b-bit plane (b in {1, 2, 4, 8}) of a row has P = head_dim*b/8
// bytes and byte j holds channels j + P*m at bit offset m*b (m < 8/b). 4-bit
// codes are one 4-bit plane, 2-bit one 2-bit plane, 3-bit a 2-bit plane (low
// bits) followed by a 1-bit plane (high bit). Unpacking a plane is then a shift
// and a mask per m, with channels in natural order within each P-byte run.
#ifndef KVQ_KERNELS_PAGE_LAYOUT_H_
#define KVQ_KERNELS_PAGE_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/hd/hd.h"
#include "kernels/quant_spec.h"

namespace kvq {

// The largest head_dim a layout takes (PageLayout::Make checks it).
inline constexpr int kMaxHeadDim = 256;

// Pages and their code sections start on a cache line; parameter and
// outlier tables only on kTableAlign.
inline constexpr size_t kPageAlign = 64;
inline constexpr size_t kTableAlign = 8;
// The widest load the device kernels issue on a page (16-byte cp.async /
// LDG.128): a page whose start is kPageAlign-aligned is read whole in such
// loads without touching a byte outside it.
inline constexpr size_t kVectorLoadBytes = 16;
static_assert(kPageAlign % kVectorLoadBytes == 0);

enum class Side { kKey = 0, kValue = 1 };

// How one side's codes are parameterised.
enum class ParamAxis {
  kNone,           // fp16 / bf16 / fp8: no per-page parameters.
  kChannelGroups,  // Per channel, per G-token block: scale[D], zero[D].
  kTokenGroups,    // Per token, per group of group_channels: scale[n], zero[n].
  kTokenGain,      // crq: one fp16 gain per token.
};

// Size of one p8 parameter block's header: fp16 scale step, zero base and
// zero step, and two bytes of padding (see kernels/group_params.h).
inline constexpr size_t kParams8HeaderBytes = 8;

// kCrq: Lloyd-Max codes of the calibrated, rotated coordinates, split into
// two halves of d/2 codes (kernels/hd/crq_hd.h), with a kTokenGain gain.
enum class CodeFormat { kFp16, kBf16, kInt8, kFp8E4m3, kPacked, kCrq };

struct SideLayout {
  CodeFormat format = CodeFormat::kFp16;
  int bits = 16;           // Bits per code (kivi keys and values may differ: vN).
  ParamAxis axis = ParamAxis::kNone;
  int group_channels = 0;  // kTokenGroups: channels per group.
  int param_bits = 16;     // 16: fp16 scale/zero; 8: p8 blocks (group_params.h).
  int half_bits = 0;       // kCrq: the side's width x 2 (bits is its ceiling).
  size_t codes_offset = 0;
  size_t code_row_bytes = 0;
  size_t params_offset = 0;
  size_t params_bytes = 0;   // Whole page.
  size_t outliers_offset = 0;
  size_t outliers_bytes = 0;  // Whole page.

  KVQ_HD int groups_per_token(int head_dim) const {
    return axis == ParamAxis::kTokenGroups ? head_dim / group_channels : 0;
  }
};

struct PageLayout {
  int head_dim = 0;
  int page_tokens = 0;
  int block_tokens = 1;        // G for kivi (quantization block), else 1.
  int outliers_per_block = 0;  // Per side, per G-token block.
  SideLayout key;
  SideLayout value;
  size_t page_bytes = 0;
  size_t padding_bytes = 0;  // Alignment bytes inside a page.

  // Builds the layout; page_tokens == 0 picks the default (max(32, G)).
  static absl::StatusOr<PageLayout> Make(const QuantSpec& spec, int head_dim,
                                         int page_tokens = 0);

  // OK when every page of this layout can be read in kVectorLoadBytes
  // loads: page_bytes and both code sections' offsets are multiples of it.
  // INTERNAL (a layout Make never builds) naming the field otherwise.
  absl::Status CheckVectorLoads() const;

  KVQ_HD const SideLayout& side(Side s) const { return s == Side::kKey ? key : value; }
  KVQ_HD int blocks_per_page() const { return page_tokens / block_tokens; }

  // --- Offset math shared by every backend. ---
  KVQ_HD static uint8_t* CodeRow(uint8_t* page, const SideLayout& s, int row) {
    return page + s.codes_offset + static_cast<size_t>(row) * s.code_row_bytes;
  }
  KVQ_HD static const uint8_t* CodeRow(const uint8_t* page, const SideLayout& s, int row) {
    return page + s.codes_offset + static_cast<size_t>(row) * s.code_row_bytes;
  }
  // fp16 parameters (param_bits 16) only:
  // kChannelGroups: scale[head_dim] then zero[head_dim] of block `block`.
  // kTokenGroups:   scale[n] then zero[n] of token `row`.
  KVQ_HD uint16_t* Params(uint8_t* page, const SideLayout& s, int block_or_row) const {
    return reinterpret_cast<uint16_t*>(page + s.params_offset) +
           static_cast<size_t>(block_or_row) * 2 * ParamsPerEntry(s);
  }
  KVQ_HD const uint16_t* Params(const uint8_t* page, const SideLayout& s, int block_or_row) const {
    return reinterpret_cast<const uint16_t*>(page + s.params_offset) +
           static_cast<size_t>(block_or_row) * 2 * ParamsPerEntry(s);
  }
  KVQ_HD int ParamsPerEntry(const SideLayout& s) const {
    return s.axis == ParamAxis::kChannelGroups ? head_dim : s.groups_per_token(head_dim);
  }
  // Parameter entries of one block: the block itself for channel groups,
  // its block_tokens rows for token groups.
  KVQ_HD int EntriesPerBlock(const SideLayout& s) const {
    return s.axis == ParamAxis::kChannelGroups ? 1 : block_tokens;
  }
  // Bytes of one block's parameters, in either format.
  KVQ_HD size_t ParamBlockBytes(const SideLayout& s) const {
    if (s.axis == ParamAxis::kTokenGain) return 2;
    const size_t groups = static_cast<size_t>(EntriesPerBlock(s)) * ParamsPerEntry(s);
    return s.param_bits == 8 ? kParams8HeaderBytes + 2 * groups : 4 * groups;
  }
  // Parameters of block `block` (either format: for fp16 this is
  // Params(page, s, first entry of the block)).
  KVQ_HD uint8_t* ParamBlock(uint8_t* page, const SideLayout& s, int block) const {
    return page + s.params_offset + static_cast<size_t>(block) * ParamBlockBytes(s);
  }
  KVQ_HD const uint8_t* ParamBlock(const uint8_t* page, const SideLayout& s, int block) const {
    return page + s.params_offset + static_cast<size_t>(block) * ParamBlockBytes(s);
  }
  // kTokenGain: the fp16 gain of row `row`.
  KVQ_HD static uint16_t* Gain(uint8_t* page, const SideLayout& s, int row) {
    return reinterpret_cast<uint16_t*>(page + s.params_offset) + row;
  }
  KVQ_HD static const uint16_t* Gain(const uint8_t* page, const SideLayout& s, int row) {
    return reinterpret_cast<const uint16_t*>(page + s.params_offset) + row;
  }
  // Outlier table of block `block`: index[k] (t_in_block * head_dim + channel)
  // then value[k] (fp16).
  KVQ_HD uint16_t* Outliers(uint8_t* page, const SideLayout& s, int block) const {
    return reinterpret_cast<uint16_t*>(page + s.outliers_offset) +
           static_cast<size_t>(block) * 2 * outliers_per_block;
  }
  KVQ_HD const uint16_t* Outliers(const uint8_t* page, const SideLayout& s, int block) const {
    return reinterpret_cast<const uint16_t*>(page + s.outliers_offset) +
           static_cast<size_t>(block) * 2 * outliers_per_block;
  }
};

// Bit-plane packing of one row of `n` codes (n a multiple of 8).
void PackCodes(const uint8_t* codes, int n, int bits, uint8_t* row);
void UnpackCodes(const uint8_t* row, int n, int bits, uint8_t* codes);

}  // namespace kvq

#endif  // KVQ_KERNELS_PAGE_LAYOUT_H_
