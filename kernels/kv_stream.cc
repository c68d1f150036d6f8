#include "kernels/kv_stream.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/crq_transform.h"
#include "kernels/cpu/simd_kernels.h"
#include "kernels/group_params.h"
#include "kernels/line_streamer.h"
#include "kernels/numeric.h"
#include "kernels/status_macros.h"

namespace kvq {

namespace {

// Magnitude bits (sign cleared) of the largest finite `dtype` value <= limit
// (limit > 0): |x| <= limit and x finite exactly when x's magnitude bits are
// at most this (cpu::MaxAbsBits16/32).
uint32_t LargestMagnitudeBits(DType dtype, float limit) {
  switch (dtype) {
    case DType::kFloat32:
      return FloatBits(limit);
    case DType::kFloat16: {
      if (limit >= kFp16Max) return 0x7bffu;
      uint16_t h = FloatToHalf(limit) & 0x7fffu;
      if (HalfToFloat(h) > limit) --h;
      return h;
    }
    case DType::kBFloat16: {
      uint16_t b = FloatToBf16(limit) & 0x7fffu;
      if (b >= 0x7f80u || Bf16ToFloat(b) > limit) --b;
      return b;
    }
  }
  return 0;
}

// Upper bound on tokens per stream: keeps every offset inside 32 bits.
constexpr int kMaxTokens = 1 << 24;
// fp8 per-head scale: the first append's |max| maps to 448 / kFp8Headroom, so
// later tokens up to kFp8Headroom times larger still fit before saturating.
constexpr float kFp8Headroom = 2.0f;

size_t AlignUp(size_t n) { return (n + kPageAlign - 1) / kPageAlign * kPageAlign; }

}  // namespace

KvStream::KvStream(const StreamConfig& config, const PageLayout& layout,
                   const KernelBackend* backend, PageAllocator* allocator)
    : config_(config), layout_(layout), backend_(backend), allocator_(allocator) {}

absl::StatusOr<std::unique_ptr<KvStream>> KvStream::Create(const StreamConfig& config,
                                                           const KernelBackend* backend,
                                                           PageAllocator* allocator,
                                                           const Codebook* codebook,
                                                           const HeadCalibration* calibration) {
  KVQ_RETURN_IF_ERROR(config.Validate());
  if (calibration != nullptr) KVQ_RETURN_IF_ERROR(calibration->Validate(config.head_dim));
  if (backend == nullptr) return absl::InvalidArgumentError("backend is null");
  KVQ_ASSIGN_OR_RETURN(PageLayout layout,
                       PageLayout::Make(config.spec, config.head_dim, config.page_tokens));
  std::shared_ptr<const CrqTransform> crq;
  if (config.spec.is_crq()) {
    if (calibration == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "scheme ", config.spec.ToString(),
          " needs a calibration (the HeadCalibration of this stream's layer and KV head)"));
    }
    KVQ_ASSIGN_OR_RETURN(CrqTransform t, CrqTransform::Make(config, *calibration));
    crq = std::make_shared<const CrqTransform>(std::move(t));
  }
  if (config.spec.nuq) {
    if (codebook == nullptr) {
      return absl::InvalidArgumentError(
          "scheme has nuq but no codebook was given: learn one with LearnCodebook()");
    }
    KVQ_RETURN_IF_ERROR(codebook->Validate(config));
  }
  std::unique_ptr<KvStream> s(
      new KvStream(config, layout, backend, allocator ? allocator : HeapPageAllocator()));
  if (config.spec.pre_rope) s->rope_.emplace(config.rope, config.head_dim);
  if (config.spec.rotate) s->rotation_.emplace(config.head_dim, config.rotation_seed);
  s->crq_ = std::move(crq);
  s->tail_capacity_ = config.spec.has_tail() ? config.spec.flush_tokens() : 0;

  const size_t levels =
      config.spec.nuq ? static_cast<size_t>(2) * config.head_dim * (1 << config.spec.bits) : 0;
  if (AuxBytes(config) > 0) {
    s->levels_offset_ = kStreamHeaderBytes;
    s->rows_offset_ = AlignUp(s->levels_offset_ + levels * 2);
    s->aux_bytes_ = AuxBytes(config);
    KVQ_ASSIGN_OR_RETURN(s->aux_, s->allocator_->AllocateHost(s->aux_bytes_));
    std::memset(s->aux_, 0, s->aux_bytes_);
    if (levels > 0) {
      auto* out = reinterpret_cast<uint16_t*>(s->aux_ + s->levels_offset_);
      for (float l : codebook->key_levels) *out++ = FloatToHalf(l);
      for (float l : codebook->value_levels) *out++ = FloatToHalf(l);
    }
  }
  return s;
}

KvStream::~KvStream() {
  for (uint8_t* p : pages_) allocator_->Free(p, layout_.page_bytes);
  if (aux_ != nullptr) allocator_->FreeHost(aux_, aux_bytes_);
}

const uint16_t* KvStream::levels(Side side, int channel) const {
  if (!config_.spec.nuq) return nullptr;
  const int n = 1 << config_.spec.bits;
  return reinterpret_cast<const uint16_t*>(aux_ + levels_offset_) +
         (static_cast<size_t>(side) * head_dim() + channel) * n;
}

uint16_t* KvStream::fp16_row(Side side, int slot) {
  const int slots = config_.spec.sink + tail_capacity_;
  return reinterpret_cast<uint16_t*>(aux_ + rows_offset_) +
         (static_cast<size_t>(side) * slots + slot) * head_dim();
}

const uint16_t* KvStream::sink_row(Side side, int t) const {
  return const_cast<KvStream*>(this)->fp16_row(side, t);
}

const uint16_t* KvStream::tail_row(Side side, int i) const {
  return const_cast<KvStream*>(this)->fp16_row(side, config_.spec.sink + i);
}

float KvStream::InputLimit() const {
  // bf16 pages hold values beyond the fp16 range, but not past the largest
  // finite bf16 (larger floats would round to infinity).
  return config_.spec.kind == SchemeKind::kBf16 ? kBf16Max : kFp16Max;
}

uint32_t KvStream::MaxInputBits(DType dtype) const {
  return LargestMagnitudeBits(dtype, InputLimit());
}

absl::Status KvStream::ValidateInput(ConstTensorView t, const char* name, int rows,
                                     bool values) const {
  if (t.cols != head_dim()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", t.cols,
                                                   " columns, head_dim is ", head_dim()));
  }
  if (t.rows != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has ", t.rows, " rows, k has ", rows));
  }
  if (rows > 0 && t.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " data is null"));
  if (t.row_stride != 0 && t.row_stride < t.cols) {
    return absl::InvalidArgumentError(absl::StrCat(name, " row_stride < cols"));
  }
  if (!values) return absl::OkStatus();
  const float limit = InputLimit();
  // Fast path: one SIMD max over the magnitude bits per row (or per tensor
  // when rows are contiguous); only a tensor that fails is walked again to
  // name the first bad element.
  const uint32_t max_bits = MaxInputBits(t.dtype);
  const bool contiguous = t.stride() == t.cols;
  bool ok = true;
  for (int r = 0; r < rows && ok; r = contiguous ? rows : r + 1) {
    const size_t n = static_cast<size_t>(contiguous ? rows : 1) * t.cols;
    const uint32_t m = t.dtype == DType::kFloat32
                           ? cpu::MaxAbsBits32(reinterpret_cast<const uint32_t*>(t.row(r)), n)
                           : cpu::MaxAbsBits16(reinterpret_cast<const uint16_t*>(t.row(r)), n);
    ok = m <= max_bits;
  }
  if (ok) return absl::OkStatus();
  const char* range = config_.spec.kind == SchemeKind::kBf16 ? " is outside the bf16 range +-"
                                                              : " is outside the fp16 range +-";
  std::vector<float> row(head_dim());
  for (int r = 0; r < rows; ++r) {
    RowToFloat(t.row(r), t.dtype, head_dim(), row.data());
    for (int c = 0; c < head_dim(); ++c) {
      if (!std::isfinite(row[c])) {
        return absl::InvalidArgumentError(absl::StrCat(name, "[", r, "][", c, "] is not finite"));
      }
      if (std::fabs(row[c]) > limit) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, "[", r, "][", c, "] = ", row[c], range, limit));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status KvStream::ValidateAppend(ConstTensorView k, ConstTensorView v) const {
  const int n = k.rows;
  if (n < 0) return absl::InvalidArgumentError("k.rows is negative");
  KVQ_RETURN_IF_ERROR(ValidateInput(k, "k", n));
  KVQ_RETURN_IF_ERROR(ValidateInput(v, "v", n));
  if (num_tokens_ + static_cast<int64_t>(n) > kMaxTokens) {
    return absl::OutOfRangeError(absl::StrCat("stream would hold ", num_tokens_ + int64_t{n},
                                              " tokens; the limit is ", kMaxTokens));
  }
  return absl::OkStatus();
}

int KvStream::NewQuantizedTokens(int n) const {
  const int to_sink = std::clamp(config_.spec.sink - num_tokens_, 0, n);
  const int rest = n - to_sink;
  if (tail_capacity_ == 0) return rest;
  return (tail_tokens() + rest) / tail_capacity_ * tail_capacity_;
}

int KvStream::PagesNeeded(int n) const {
  const int pt = layout_.page_tokens;
  return (quantized_tokens_ + NewQuantizedTokens(n) + pt - 1) / pt - num_pages();
}

absl::Status KvStream::Append(ConstTensorView k, ConstTensorView v) {
  const int n = k.rows;
  if (n > 0 && TakesBlocksChecked(k, v)) {
    // The shapes first, as ValidateAppend checks them; the values block by
    // block. A block that fails, or pages the allocator cannot give, leave
    // the stream as it was, and the path below then reports them as it
    // always has (the first bad element named, or RESOURCE_EXHAUSTED).
    KVQ_RETURN_IF_ERROR(ValidateInput(k, "k", n, /*values=*/false));
    KVQ_RETURN_IF_ERROR(ValidateInput(v, "v", n, /*values=*/false));
    if (num_tokens_ + static_cast<int64_t>(n) <= kMaxTokens) {
      AppendCheckpoint before = Checkpoint(n);
      if (AppendBlocksChecked(k, v)) return FinishAppend(before, absl::OkStatus());
    }
  }
  KVQ_RETURN_IF_ERROR(ValidateAppend(k, v));
  return AppendValidated(k, v);
}

KvStream::AppendCheckpoint KvStream::Checkpoint(int n, bool keep_tail) const {
  AppendCheckpoint c;
  c.pages = pages_.size();
  c.num_tokens = num_tokens_;
  c.quantized_tokens = quantized_tokens_;
  if (aux_ != nullptr) {
    c.fp8_scale[0] = header()->fp8_scale[0];
    c.fp8_scale[1] = header()->fp8_scale[1];
  }
  // A flush overwrites the tail slots; everything else an append writes
  // lies past what the stream holds. Host backends and host memory cannot
  // fail once the pages are allocated: no copy for them.
  const bool may_fail = backend_->enqueues() || !allocator_->host_accessible();
  const int tail = tail_tokens();
  if ((may_fail || keep_tail) && tail > 0 && NewQuantizedTokens(n) > 0) {
    const size_t row = static_cast<size_t>(head_dim());
    c.tail.resize(2 * tail * row);
    std::memcpy(c.tail.data(), tail_row(Side::kKey, 0), tail * row * 2);
    std::memcpy(c.tail.data() + tail * row, tail_row(Side::kValue, 0), tail * row * 2);
  }
  return c;
}

void KvStream::Rollback(const AppendCheckpoint& before) {
  for (size_t i = before.pages; i < pages_.size(); ++i) {
    allocator_->Free(pages_[i], layout_.page_bytes);
  }
  pages_.resize(before.pages);
  num_tokens_ = before.num_tokens;
  quantized_tokens_ = before.quantized_tokens;
  if (aux_ != nullptr) {
    header()->fp8_scale[0] = before.fp8_scale[0];
    header()->fp8_scale[1] = before.fp8_scale[1];
  }
  if (!before.tail.empty()) {
    const size_t half = before.tail.size() / 2;
    std::memcpy(fp16_row(Side::kKey, config_.spec.sink), before.tail.data(), half * 2);
    std::memcpy(fp16_row(Side::kValue, config_.spec.sink), before.tail.data() + half, half * 2);
  }
}

absl::Status KvStream::FinishAppend(const AppendCheckpoint& before, absl::Status status) {
  if (status.ok()) status = backend_->Synchronize();
  if (!status.ok()) Rollback(before);
  return status;
}

bool KvStream::TakesBlocksChecked(ConstTensorView k, ConstTensorView v) const {
  const int d = head_dim();
  return tail_capacity_ > 0 && !rotation_ && !crq_ && k.dtype == DType::kFloat16 &&
         v.dtype == DType::kFloat16 && k.cols == d && v.cols == d && k.rows == v.rows &&
         k.data != nullptr && v.data != nullptr && k.stride() == d && v.stride() == d &&
         tail_tokens() == 0 && num_tokens_ >= config_.spec.sink && k.rows % tail_capacity_ == 0;
}

bool KvStream::AppendBlocksChecked(ConstTensorView k, ConstTensorView v) {
  const int n = k.rows;
  const int d = head_dim();
  const int g = layout_.block_tokens;
  std::vector<uint8_t*> fresh;
  // A failure is reported by Append's checked path, after the input's checks.
  // Pages the blocks fill need no zeroing (a 28 MiB memset for a kivi4
  // prompt, BENCHMARKS.md section 7); a page they fill only in part is zeroed, so
  // that its bytes do not depend on what the allocator hands out.
  const bool whole = BlocksWriteWholePages();
  if (!AllocatePages(PagesNeeded(n), /*zero=*/!whole, &fresh).ok()) return false;
  if (whole && !fresh.empty() && (quantized_tokens_ + n) % layout_.page_tokens != 0 &&
      !allocator_->ZeroBlock(fresh.back(), 0, layout_.page_bytes).ok()) {
    for (uint8_t* q : fresh) allocator_->Free(q, layout_.page_bytes);
    return false;
  }
  const size_t first_fresh = pages_.size();
  const int quantized_before = quantized_tokens_;
  pages_.insert(pages_.end(), fresh.begin(), fresh.end());
  const uint32_t max_bits = MaxInputBits(DType::kFloat16);
  const size_t block = static_cast<size_t>(g) * d;  // fp16 elements of one block of rows.
  const auto* kb = static_cast<const uint16_t*>(k.data);
  const auto* vb = static_cast<const uint16_t*>(v.data);
  for (int r = 0; r < n; r += g) {
    const size_t at = static_cast<size_t>(r) * d;
    if (cpu::MaxAbsBits16(kb + at, block) > max_bits ||
        cpu::MaxAbsBits16(vb + at, block) > max_bits) {
      pages_.resize(first_fresh);
      for (uint8_t* q : fresh) allocator_->Free(q, layout_.page_bytes);
      quantized_tokens_ = quantized_before;
      return false;
    }
    // The next block's lines requested now, to arrive while this one is
    // quantized: a block is 4 KiB or more of K and of V, and the hardware
    // prefetcher starts over at every 4 KiB page (kvq-bench convert: 0.2-1.3
    // ms less for a 90 MiB prompt, BENCHMARKS.md section 7).
    if (r + g < n) {
      const char* next_k = reinterpret_cast<const char*>(kb + at + block);
      const char* next_v = reinterpret_cast<const char*>(vb + at + block);
      for (size_t i = 0; i < 2 * block; i += 64) {
        __builtin_prefetch(next_k + i, 0, 3);
        __builtin_prefetch(next_v + i, 0, 3);
      }
    }
    QuantizeBlocks(kb + at, vb + at, g);
  }
  num_tokens_ += n;
  return true;
}

bool KvStream::BlocksWriteWholePages() const {
  return layout_.padding_bytes == 0 && layout_.outliers_per_block == 0 &&
         layout_.key.param_bits == 16 && layout_.value.param_bits == 16;
}

absl::Status KvStream::AllocatePages(int count, bool zero, std::vector<uint8_t*>* out) {
  out->reserve(out->size() + static_cast<size_t>(std::max(count, 0)));
  const size_t had = out->size();
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<uint8_t*> p = allocator_->Allocate(layout_.page_bytes);
    if (!p.ok()) {
      for (size_t j = had; j < out->size(); ++j) allocator_->Free((*out)[j], layout_.page_bytes);
      out->resize(had);
      return p.status();
    }
    out->push_back(*p);
    if (zero) {
      if (absl::Status st = allocator_->ZeroBlock(*p, 0, layout_.page_bytes); !st.ok()) {
        for (size_t j = had; j < out->size(); ++j) allocator_->Free((*out)[j], layout_.page_bytes);
        out->resize(had);
        return st;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status KvStream::AppendValidated(ConstTensorView k, ConstTensorView v) {
  if (k.rows == 0) return absl::OkStatus();
  AppendCheckpoint before = Checkpoint(k.rows);
  return FinishAppend(before, AppendUnsynced(k, v));
}

absl::Status KvStream::AppendUnsynced(ConstTensorView k, ConstTensorView v) {
  const int n = k.rows;
  const int d = head_dim();
  const SchemeKind kind = config_.spec.kind;
  const int to_sink = std::clamp(config_.spec.sink - num_tokens_, 0, n);

  // 16-bit input that lands unchanged in 16-bit storage is copied, not
  // converted: fp16 input into the fp16 sink and tail rows, and fp16 / bf16
  // input into fp16 / bf16 pages. (x -> float -> same 16-bit type is the
  // identity on finite values, which validation guaranteed.) Everything else
  // goes through floats.
  const bool same16 = !rotation_ && k.dtype == v.dtype && k.dtype != DType::kFloat32;
  const bool copy_rows16 = same16 && k.dtype == DType::kFloat16;
  const bool copy_pages =
      same16 && tail_capacity_ == 0 &&
      ((kind == SchemeKind::kFp16 && k.dtype == DType::kFloat16) ||
       (kind == SchemeKind::kBf16 && k.dtype == DType::kBFloat16));
  const bool rest_copied = tail_capacity_ == 0 ? copy_pages : copy_rows16;
  const bool need_float =
      kind == SchemeKind::kFp8E4m3 || !rest_copied || (to_sink > 0 && !copy_rows16);
  std::vector<float> kf, vf;
  if (need_float) {
    kf.resize(static_cast<size_t>(n) * d);
    vf.resize(kf.size());
    for (int r = 0; r < n; ++r) {
      RowToFloat(k.row(r), k.dtype, d, &kf[static_cast<size_t>(r) * d]);
      RowToFloat(v.row(r), v.dtype, d, &vf[static_cast<size_t>(r) * d]);
      if (rotation_) {
        rotation_->Forward(&kf[static_cast<size_t>(r) * d]);
        rotation_->Forward(&vf[static_cast<size_t>(r) * d]);
      }
    }
  }
  // Input row r into a 16-bit fp16 row (sink or tail).
  auto put_fp16 = [&](int r, int slot) {
    if (copy_rows16) {
      std::memcpy(fp16_row(Side::kKey, slot), k.row(r), 2 * static_cast<size_t>(d));
      std::memcpy(fp16_row(Side::kValue, slot), v.row(r), 2 * static_cast<size_t>(d));
      return;
    }
    FloatToRow(&kf[static_cast<size_t>(r) * d], d, DType::kFloat16, fp16_row(Side::kKey, slot));
    FloatToRow(&vf[static_cast<size_t>(r) * d], d, DType::kFloat16, fp16_row(Side::kValue, slot));
  };

  // Plan where the n tokens go, then allocate every page before touching state.
  const int pt = layout_.page_tokens;
  const int pages_needed = PagesNeeded(n);
  std::vector<uint8_t*> fresh;
  // Copied pages are zeroed below, around the rows the copy writes.
  KVQ_RETURN_IF_ERROR(AllocatePages(pages_needed, /*zero=*/!copy_pages, &fresh));
  const size_t first_fresh = pages_.size();
  pages_.insert(pages_.end(), fresh.begin(), fresh.end());

  if (kind == SchemeKind::kFp8E4m3 && fp8_scale(Side::kKey) == 0.0f) {
    for (int side = 0; side < 2; ++side) {
      const std::vector<float>& x = side == 0 ? kf : vf;
      float amax = 0.0f;
      for (float e : x) amax = std::max(amax, std::fabs(e));
      header()->fp8_scale[side] = std::max(amax, 1e-6f) * kFp8Headroom / kFp8E4m3Max;
    }
  }

  // Sink rows.
  for (int r = 0; r < to_sink; ++r) put_fp16(r, num_tokens_ + r);
  num_tokens_ += to_sink;

  if (tail_capacity_ == 0) {
    // Per-token schemes: quantize straight into pages, one page segment at a time.
    int r = to_sink;
    while (r < n) {
      const int page = quantized_tokens_ / pt;
      const int row = quantized_tokens_ % pt;
      const int count = std::min(n - r, pt - row);
      if (copy_pages) {
        // A fresh page starts at row 0; every byte the copy does not write
        // (later rows, alignment padding) is zeroed, so no byte of a page
        // ever shows what the pool held before.
        if (static_cast<size_t>(page) >= first_fresh) {
          KVQ_RETURN_IF_ERROR(ZeroAroundRows(pages_[page], count));
        }
        if (allocator_->host_accessible()) {
          for (int i = 0; i < count; ++i) {
            std::memcpy(PageLayout::CodeRow(pages_[page], layout_.key, row + i), k.row(r + i),
                        layout_.key.code_row_bytes);
            std::memcpy(PageLayout::CodeRow(pages_[page], layout_.value, row + i), v.row(r + i),
                        layout_.value.code_row_bytes);
          }
        } else {
          // A side's code rows are contiguous in the page: one copy each.
          for (Side side : {Side::kKey, Side::kValue}) {
            const SideLayout& S = layout_.side(side);
            const ConstTensorView& in = side == Side::kKey ? k : v;
            std::vector<uint8_t> rows(static_cast<size_t>(count) * S.code_row_bytes);
            for (int i = 0; i < count; ++i) {
              std::memcpy(rows.data() + static_cast<size_t>(i) * S.code_row_bytes, in.row(r + i),
                          S.code_row_bytes);
            }
            const size_t at = PageLayout::CodeRow(pages_[page], S, row) - pages_[page];
            KVQ_RETURN_IF_ERROR(allocator_->WriteBlock(pages_[page], at, rows.data(), rows.size()));
          }
        }
      } else if (crq_) {
        QuantizeCrqRows(Side::kKey, &kf[static_cast<size_t>(r) * d], count, 0);
        QuantizeCrqRows(Side::kValue, &vf[static_cast<size_t>(r) * d], count, 0);
      } else {
        backend_->QuantizeRows(*this, Side::kKey, &kf[static_cast<size_t>(r) * d], count,
                               pages_[page], row);
        backend_->QuantizeRows(*this, Side::kValue, &vf[static_cast<size_t>(r) * d], count,
                               pages_[page], row);
      }
      quantized_tokens_ += count;
      num_tokens_ += count;
      r += count;
    }
    return absl::OkStatus();
  }

  // Block schemes: fill the fp16 tail; quantize it whenever it is full.
  // Dense fp16 input fills it a run of rows at a time (one copy per side:
  // tail rows are contiguous).
  const bool dense_rows16 = copy_rows16 && k.stride() == d && v.stride() == d;
  for (int r = to_sink; r < n;) {
    if (dense_rows16 && tail_tokens() == 0 && n - r >= tail_capacity_) {
      // Whole flush blocks straight from the input, which is what the tail
      // would hold: the copy into it is skipped.
      const int count = (n - r) / tail_capacity_ * tail_capacity_;
      QuantizeBlocks(k.row(r), v.row(r), count);
      num_tokens_ += count;
      r += count;
      continue;
    }
    const int slot = config_.spec.sink + tail_tokens();
    const int count = std::min(n - r, tail_capacity_ - tail_tokens());
    if (dense_rows16) {
      const size_t bytes = 2 * static_cast<size_t>(count) * d;
      std::memcpy(fp16_row(Side::kKey, slot), k.row(r), bytes);
      std::memcpy(fp16_row(Side::kValue, slot), v.row(r), bytes);
    } else {
      for (int i = 0; i < count; ++i) put_fp16(r + i, slot + i);
    }
    num_tokens_ += count;
    r += count;
    if (tail_tokens() == tail_capacity_) FlushTail();
  }
  return absl::OkStatus();
}

absl::Status KvStream::ZeroAroundRows(uint8_t* page, int rows) const {
  const SideLayout* sides[2] = {&layout_.key, &layout_.value};
  if (sides[1]->codes_offset < sides[0]->codes_offset) std::swap(sides[0], sides[1]);
  size_t at = 0;
  for (const SideLayout* side : sides) {
    KVQ_RETURN_IF_ERROR(allocator_->ZeroBlock(page, at, side->codes_offset - at));
    at = side->codes_offset + static_cast<size_t>(rows) * side->code_row_bytes;
  }
  return allocator_->ZeroBlock(page, at, layout_.page_bytes - at);
}

void KvStream::FlushTail() {
  QuantizeBlocks(tail_row(Side::kKey, 0), tail_row(Side::kValue, 0), tail_capacity_);
  // The tail is now empty (n == capacity); nothing to move.
}

void KvStream::QuantizeCrqRows(Side side, float* rows, int n, int done) {
  const int d = head_dim();
  const int pt = layout_.page_tokens;
  for (int r = 0; r < n;) {
    const int u = quantized_tokens_ + done + r;
    const int count = std::min(n - r, pt - u % pt);
    float* x = rows + static_cast<size_t>(r) * d;
    crq_->Forward(side, x, count, page_base() + u);
    backend_->QuantizeRows(*this, side, x, count, pages_[u / pt], u % pt);
    r += count;
  }
}

void KvStream::QuantizeBlocks(const void* k_rows, const void* v_rows, int n) {
  const int d = head_dim();
  if (crq_) {
    std::vector<float> x(static_cast<size_t>(n) * d);
    for (Side side : {Side::kKey, Side::kValue}) {
      RowToFloat(side == Side::kKey ? k_rows : v_rows, DType::kFloat16, n * d, x.data());
      QuantizeCrqRows(side, x.data(), n, 0);
    }
    quantized_tokens_ += n;
    return;
  }
  const int g = layout_.block_tokens;
  const int pt = layout_.page_tokens;
  std::vector<float> block;  // Only where the backend takes floats.
  const size_t block_bytes = 2 * static_cast<size_t>(g) * d;
  for (int b = 0; b < n; b += g) {
    const int page = quantized_tokens_ / pt;
    const int row = quantized_tokens_ % pt;
    for (Side side : {Side::kKey, Side::kValue}) {
      const auto* rows = static_cast<const uint8_t*>(side == Side::kKey ? k_rows : v_rows);
      const uint8_t* x = rows + (b / g) * block_bytes;
      if (backend_->QuantizeRowsHalf(*this, side, reinterpret_cast<const uint16_t*>(x), g,
                                     pages_[page], row)) {
        continue;
      }
      // The block's rows are contiguous: one conversion.
      block.resize(static_cast<size_t>(g) * d);
      RowToFloat(x, DType::kFloat16, g * d, block.data());
      backend_->QuantizeRows(*this, side, block.data(), g, pages_[page], row);
    }
    quantized_tokens_ += g;
  }
}

absl::Status KvStream::CheckReadOutputs(int n, const ReadOptions& options, const TensorView& k_out,
                                        const TensorView& v_out) const {
  const int d = head_dim();
  for (const TensorView* t : {&k_out, &v_out}) {
    if (t->data == nullptr) continue;
    if (t->rows != n || t->cols != d || t->dtype != options.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "output must be [", n, ", ", d, "] of ", DTypeName(options.dtype), ", got [", t->rows,
          ", ", t->cols, "] of ", DTypeName(t->dtype)));
    }
  }
  return absl::OkStatus();
}

bool KvStream::StoredAsRead(Side side, const ReadOptions& options) const {
  return !rotation_ && !crq_ && !(side == Side::kKey && rope_ && options.apply_rope);
}

void KvStream::FinishRows(Side side, float* rows, int count, int t, const ReadOptions& options,
                          const TensorView& out, int out_row) const {
  const int d = head_dim();
  for (int i = 0; i < count; ++i) {
    float* x = rows + static_cast<size_t>(i) * d;
    if (side == Side::kKey && rope_ && options.apply_rope) rope_->Apply(x, t + i);
    if (rotation_) rotation_->Inverse(x);
    FloatToRow(x, d, options.dtype, out.row(out_row + i));
  }
}

absl::Status KvStream::ReadPageRows(Side side, const uint8_t* page, bool stored, int row,
                                    int count, int t, const ReadOptions& options,
                                    const TensorView& out, int out_row, float* scratch) const {
  const SideLayout& S = layout_.side(side);
  // Rows stored in the requested 16-bit type, with nothing to apply, are
  // copied as they are (the float round trip would be the identity).
  const bool copy_rows =
      StoredAsRead(side, options) &&
      ((S.format == CodeFormat::kFp16 && options.dtype == DType::kFloat16) ||
       (S.format == CodeFormat::kBf16 && options.dtype == DType::kBFloat16));
  if (copy_rows) {
    if (!stored || allocator_->host_accessible()) {
      for (int i = 0; i < count; ++i) {
        std::memcpy(out.row(out_row + i), PageLayout::CodeRow(page, S, row + i),
                    S.code_row_bytes);
      }
      return absl::OkStatus();
    }
    // The side's rows are contiguous in the page: one copy off the device,
    // straight into the output when its rows are packed too.
    const size_t at = PageLayout::CodeRow(page, S, row) - page;
    const size_t bytes = static_cast<size_t>(count) * S.code_row_bytes;
    if (static_cast<size_t>(out.stride()) * 2 == S.code_row_bytes) {
      return allocator_->ReadBlock(page, at, bytes, static_cast<uint8_t*>(out.row(out_row)));
    }
    thread_local std::vector<uint8_t> staged;
    staged.resize(bytes);
    KVQ_RETURN_IF_ERROR(allocator_->ReadBlock(page, at, bytes, staged.data()));
    for (int i = 0; i < count; ++i) {
      std::memcpy(out.row(out_row + i), staged.data() + static_cast<size_t>(i) * S.code_row_bytes,
                  S.code_row_bytes);
    }
    return absl::OkStatus();
  }
  if (StoredAsRead(side, options) && options.dtype == DType::kFloat16 &&
      backend_->DequantizeRowsHalf(*this, side, page, row, count,
                                   reinterpret_cast<uint16_t*>(out.row(out_row)),
                                   static_cast<size_t>(out.stride()))) {
    return absl::OkStatus();
  }
  backend_->DequantizeRows(*this, side, page, row, count, scratch);
  // The floats are read here: a device backend's copy must have landed.
  KVQ_RETURN_IF_ERROR(backend_->Synchronize());
  if (crq_) crq_->Inverse(side, scratch, count, t);
  FinishRows(side, scratch, count, t, options, out, out_row);
  return absl::OkStatus();
}

absl::Status KvStream::Read(int begin, int end, const ReadOptions& options, TensorView k_out,
                            TensorView v_out) const {
  if (begin < 0 || end < begin || end > num_tokens_) {
    return absl::OutOfRangeError(absl::StrCat("token range [", begin, ", ", end,
                                              ") is not inside [0, ", num_tokens_, "]"));
  }
  KVQ_RETURN_IF_ERROR(CheckReadOutputs(end - begin, options, k_out, v_out));
  const int d = head_dim();
  const int pt = layout_.page_tokens;
  std::vector<float> rows(static_cast<size_t>(pt) * d);
  for (Side side : {Side::kKey, Side::kValue}) {
    const TensorView& out = side == Side::kKey ? k_out : v_out;
    if (out.data == nullptr) continue;
    const bool copy_fp16 = StoredAsRead(side, options) && options.dtype == DType::kFloat16;
    const size_t row16 = 2 * static_cast<size_t>(d);
    int t = begin;
    while (t < end) {
      if (t >= sink_tokens() && t - page_base() < quantized_tokens_) {
        const int u = t - page_base();
        const int row = u % pt;
        // A page may be quantized only partly (a flush smaller than a page):
        // the rest of the range is in the tail.
        const int count = std::min({end - t, pt - row, quantized_tokens_ - u});
        KVQ_RETURN_IF_ERROR(ReadPageRows(side, pages_[u / pt], /*stored=*/true, row, count, t,
                                         options, out, t - begin, rows.data()));
        t += count;
        continue;
      }
      const uint16_t* stored = t < sink_tokens()
                                   ? sink_row(side, t)
                                   : tail_row(side, t - page_base() - quantized_tokens_);
      if (copy_fp16) {
        std::memcpy(out.row(t - begin), stored, row16);
      } else {
        RowToFloat(stored, DType::kFloat16, d, rows.data());
        FinishRows(side, rows.data(), 1, t, options, out, t - begin);
      }
      ++t;
    }
  }
  return backend_->Synchronize();
}

bool KvStream::AcceptsPages() const {
  return num_tokens_ >= config_.spec.sink && tail_tokens() == 0 &&
         quantized_tokens_ % layout_.page_tokens == 0;
}

namespace {

bool FiniteHalf(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

// Checks the sides of a page named in `sides` (both by default). The page
// may lie at any address (inside a received message): every 16-bit field
// is loaded through memcpy.
absl::Status CheckPage(const PageLayout& L, const uint8_t* page, int rows, int index,
                       std::initializer_list<Side> sides = {Side::kKey, Side::kValue}) {
  auto bad = [&](absl::string_view side, absl::string_view what, int row) {
    return absl::InvalidArgumentError(absl::StrCat("page ", index, " ", side, " row ", row, ": ",
                                                   what));
  };
  for (Side side : sides) {
    const SideLayout& S = L.side(side);
    const char* name = side == Side::kKey ? "key" : "value";
    for (int r = 0; r < rows; ++r) {
      const uint8_t* code = PageLayout::CodeRow(page, S, r);
      if (S.format == CodeFormat::kFp16) {
        for (int c = 0; c < L.head_dim; ++c) {
          uint16_t h;
          std::memcpy(&h, code + 2 * c, 2);
          if (!FiniteHalf(h)) return bad(name, absl::StrCat("code ", c, " is not finite"), r);
        }
      } else if (S.format == CodeFormat::kBf16) {
        for (int c = 0; c < L.head_dim; ++c) {
          uint16_t b;
          std::memcpy(&b, code + 2 * c, 2);
          if ((b & 0x7f80u) == 0x7f80u) return bad(name, absl::StrCat("code ", c, " is not finite"), r);
        }
      }
    }
    if (absl::Status st = CheckGroupParams(L, S, page, rows); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("page ", index, " ", name, " ", st.message()));
    }
    for (int b = 0; b < rows / L.block_tokens && L.outliers_per_block > 0; ++b) {
      const uint16_t* t = L.Outliers(page, S, b);
      for (int e = 0; e < L.outliers_per_block; ++e) {
        const uint16_t at = Load16(t, e);
        if (at >= L.block_tokens * L.head_dim) {
          return bad(name, absl::StrCat("outlier ", e, " index ", at, " is outside the block of ",
                                        L.block_tokens * L.head_dim),
                     b * L.block_tokens);
        }
        if (!FiniteHalf(Load16(t, L.outliers_per_block + e))) {
          return bad(name, absl::StrCat("outlier ", e, " value is not finite"), b * L.block_tokens);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status KvStream::AppendPages(const uint8_t* data, int tokens) {
  const ByteReader::Run run(
      data, static_cast<size_t>(PagesFor(std::max(tokens, 0))) * layout_.page_bytes);
  return AppendPages(ByteReader({&run, 1}), tokens);
}

absl::Status KvStream::AppendPages(ByteReader data, int tokens) {
  if (config_.spec.kind == SchemeKind::kFp8E4m3) {
    return absl::FailedPreconditionError("fp8_e4m3 streams do not take raw pages: the scale is per stream");
  }
  if (!AcceptsPages()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "raw pages append at a page boundary with the sink complete and the fp16 tail empty; "
        "the stream has ", num_tokens_, " tokens, ", tail_tokens(), " of them in the tail"));
  }
  const int flush = config_.spec.flush_tokens();
  if (tokens < 0 || tokens % flush != 0) {
    return absl::InvalidArgumentError(absl::StrCat("raw pages must hold a multiple of ", flush,
                                                   " tokens, got ", tokens));
  }
  if (num_tokens_ + static_cast<int64_t>(tokens) > kMaxTokens) {
    return absl::OutOfRangeError(absl::StrCat("stream would hold ", num_tokens_ + int64_t{tokens},
                                              " tokens; the limit is ", kMaxTokens));
  }
  const int pt = layout_.page_tokens;
  const int pages = PagesFor(tokens);
  const size_t bytes = static_cast<size_t>(pages) * layout_.page_bytes;
  if (data.remaining() < bytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw pages: ", tokens, " tokens take ", bytes,
                                                   " bytes, only ", data.remaining(), " given"));
  }
  // Every page is checked before any is stored; a page cut between two
  // runs is checked in a copy.
  thread_local std::vector<uint8_t> straddling;
  straddling.resize(layout_.page_bytes);
  ByteReader check = data;
  for (int i = 0; i < pages; ++i) {
    KVQ_RETURN_IF_ERROR(CheckPage(layout_, check.Next(layout_.page_bytes, straddling.data()),
                                  std::min(pt, tokens - i * pt), i));
  }
  std::vector<uint8_t*> fresh;
  KVQ_RETURN_IF_ERROR(AllocatePages(pages, /*zero=*/false, &fresh));
  // Stored pages are written once here and read much later (a fetch, an
  // attention step, often never by this core): whole lines go past the
  // caches, which saves reading each destination line before writing it
  // (BENCHMARKS.md section 7).
  if (!allocator_->host_accessible()) {
    for (uint8_t* page : fresh) {
      absl::Status st =
          allocator_->WriteBlock(page, 0, data.Next(layout_.page_bytes, straddling.data()),
                                 layout_.page_bytes);
      if (!st.ok()) {
        for (uint8_t* q : fresh) allocator_->Free(q, layout_.page_bytes);
        return st;
      }
    }
  } else if (layout_.page_bytes % cpu::kStreamLine == 0) {
    for (uint8_t* page : fresh) {
      cpu::StreamLines(page, data.Next(layout_.page_bytes, straddling.data()),
                       layout_.page_bytes / cpu::kStreamLine);
    }
    cpu::FenceStreams();
  } else {
    for (uint8_t* page : fresh) data.Read(layout_.page_bytes, page);
  }
  if (absl::Status st = backend_->Synchronize(); !st.ok()) {
    for (uint8_t* q : fresh) allocator_->Free(q, layout_.page_bytes);
    return st;
  }
  pages_.insert(pages_.end(), fresh.begin(), fresh.end());
  quantized_tokens_ += tokens;
  num_tokens_ += tokens;
  return absl::OkStatus();
}

absl::Status KvStream::ReadPages(const uint8_t* data, int tokens, int first, int begin, int end,
                                 const ReadOptions& options, TensorView k_out,
                                 TensorView v_out) const {
  if (config_.spec.kind == SchemeKind::kFp8E4m3) {
    return absl::FailedPreconditionError("fp8_e4m3 streams have no raw pages: the scale is per stream");
  }
  if (tokens < 0 || first < 0 || begin < first || end < begin ||
      int64_t{end} > int64_t{first} + tokens) {
    return absl::OutOfRangeError(absl::StrCat("token range [", begin, ", ", end,
                                              ") is not inside the pages' [", first, ", ",
                                              int64_t{first} + tokens, ")"));
  }
  KVQ_RETURN_IF_ERROR(CheckReadOutputs(end - begin, options, k_out, v_out));
  const int pt = layout_.page_tokens;
  if (begin == end) return absl::OkStatus();
  const int first_page = (begin - first) / pt;
  const int last_page = (end - 1 - first) / pt;
  // Only the sides read are checked: a caller may read K and V apart.
  const bool keys = k_out.data != nullptr, values = v_out.data != nullptr;
  for (int i = first_page; i <= last_page && (keys || values); ++i) {
    const uint8_t* page = data + static_cast<size_t>(i) * layout_.page_bytes;
    const int rows = std::min(pt, tokens - i * pt);
    KVQ_RETURN_IF_ERROR(keys && values ? CheckPage(layout_, page, rows, i)
                                       : CheckPage(layout_, page, rows, i,
                                                   {keys ? Side::kKey : Side::kValue}));
  }
  std::vector<float> rows(static_cast<size_t>(pt) * head_dim());
  for (Side side : {Side::kKey, Side::kValue}) {
    const TensorView& out = side == Side::kKey ? k_out : v_out;
    if (out.data == nullptr) continue;
    if (options.streaming_output && StreamPageRows(side, data, first, begin, end, options, out)) {
      continue;
    }
    for (int t = begin; t < end;) {
      const int u = t - first;
      const int row = u % pt;
      const int count = std::min(end - t, pt - row);
      KVQ_RETURN_IF_ERROR(ReadPageRows(side, data + static_cast<size_t>(u / pt) * layout_.page_bytes,
                                       /*stored=*/false, row, count, t, options, out, t - begin,
                                       rows.data()));
      t += count;
    }
  }
  return backend_->Synchronize();
}

bool KvStream::StreamPageRows(Side side, const uint8_t* data, int first, int begin, int end,
                              const ReadOptions& options, const TensorView& out) const {
  const SideLayout& S = layout_.side(side);
  const int d = head_dim();
  if (options.dtype != DType::kFloat16 || !StoredAsRead(side, options) || out.stride() != d) {
    return false;
  }
  const bool fp16_rows = S.format == CodeFormat::kFp16;
  const size_t row_bytes = static_cast<size_t>(d) * 2;
  const int pt = layout_.page_tokens;
  // Rows are dequantized a page at a time into a tile that stays in L1.
  static thread_local std::vector<uint16_t> tile;
  tile.resize(static_cast<size_t>(pt) * d);
  LineStreamer streamer(out.row(0));
  for (int t = begin; t < end;) {
    const int u = t - first;
    const int row = u % pt;
    const int count = std::min(end - t, pt - row);
    const uint8_t* page = data + static_cast<size_t>(u / pt) * layout_.page_bytes;
    if (fp16_rows) {
      streamer.Write(PageLayout::CodeRow(page, S, row), count * row_bytes);
    } else if (backend_->DequantizeRowsHalf(*this, side, page, row, count, tile.data(), d)) {
      streamer.Write(reinterpret_cast<const uint8_t*>(tile.data()), count * row_bytes);
    } else {
      // The backend has no fp16 path for this side. Its answer is the same
      // for every page of a side (backend.h), so this is the first page and
      // nothing has been written yet.
      if (t != begin) std::abort();
      return false;
    }
    t += count;
  }
  streamer.Finish();
  return true;
}

absl::Status KvStream::CheckPageRange(int begin, int end) const {
  const int pt = layout_.page_tokens;
  if (begin < 0 || end < begin || end > quantized_tokens_ || begin % pt != 0) {
    return absl::OutOfRangeError(absl::StrCat(
        "raw page range [", begin, ", ", end, ") must start on a multiple of ", pt,
        " inside the quantized tokens [0, ", quantized_tokens_, ")"));
  }
  return absl::OkStatus();
}

absl::Status KvStream::VisitPages(
    int begin, int end, absl::FunctionRef<void(const uint8_t* page, bool full)> visit) const {
  KVQ_RETURN_IF_ERROR(CheckPageRange(begin, end));
  const int first = begin / layout_.page_tokens;
  const int full_pages = quantized_tokens_ / layout_.page_tokens;
  const int last = first + PagesFor(end - begin);
  if (allocator_->host_accessible()) {
    for (int i = first; i < last; ++i) visit(pages_[i], i < full_pages);
    return absl::OkStatus();
  }
  thread_local std::vector<uint8_t> staged;
  staged.resize(layout_.page_bytes);
  for (int i = first; i < last; ++i) {
    KVQ_RETURN_IF_ERROR(allocator_->ReadBlock(pages_[i], 0, layout_.page_bytes, staged.data()));
    visit(staged.data(), false);
  }
  return absl::OkStatus();
}

absl::Status KvStream::CopyPages(int begin, int end, uint8_t* out) const {
  KVQ_RETURN_IF_ERROR(CheckPageRange(begin, end));
  const int first = begin / layout_.page_tokens;
  for (int i = first; i < first + PagesFor(end - begin); ++i) {
    KVQ_RETURN_IF_ERROR(allocator_->ReadBlock(pages_[i], 0, layout_.page_bytes, out));
    out += layout_.page_bytes;
  }
  return absl::OkStatus();
}

absl::Status KvStream::AppendPagesTo(int begin, int end, std::string* out) const {
  KVQ_RETURN_IF_ERROR(CheckPageRange(begin, end));
  const int first = begin / layout_.page_tokens;
  const int count = PagesFor(end - begin);
  const size_t had = out->size();
  // Grown once, uninitialised bytes overwritten below (resize would zero them).
  out->reserve(had + static_cast<size_t>(count) * layout_.page_bytes);
  for (int i = first; i < first + count; ++i) {
    if (allocator_->host_accessible()) {
      out->append(reinterpret_cast<const char*>(pages_[i]), layout_.page_bytes);
      continue;
    }
    const size_t at = out->size();
    out->resize(at + layout_.page_bytes);
    if (absl::Status st = allocator_->ReadBlock(pages_[i], 0, layout_.page_bytes,
                                                reinterpret_cast<uint8_t*>(out->data() + at));
        !st.ok()) {
      out->resize(had);
      return st;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvStream>> KvStream::Fork(int tokens) const {
  if (tokens < 0 || tokens > num_tokens_) {
    return absl::OutOfRangeError(absl::StrCat("fork length ", tokens, " is not in [0, ",
                                              num_tokens_, "]"));
  }
  const int flush = config_.spec.flush_tokens();
  const int sink = config_.spec.sink;
  const bool whole = tokens == num_tokens_;
  const bool on_boundary = tokens <= sink || ((tokens - sink) % flush == 0 &&
                                              tokens - sink <= quantized_tokens_);
  if (!whole && !on_boundary) {
    const int below = tokens < sink ? tokens : sink + (tokens - sink) / flush * flush;
    return absl::FailedPreconditionError(absl::StrCat(
        "fork length ", tokens, " splits a quantization block; valid lengths near it are ",
        below, " and ", std::min(below + flush, num_tokens_), " (or ", num_tokens_, ")"));
  }
  std::unique_ptr<KvStream> f(new KvStream(config_, layout_, backend_, allocator_));
  f->rope_ = rope_;
  f->rotation_ = rotation_;
  f->crq_ = crq_;
  f->tail_capacity_ = tail_capacity_;
  f->levels_offset_ = levels_offset_;
  f->rows_offset_ = rows_offset_;
  f->aux_bytes_ = aux_bytes_;
  if (aux_ != nullptr) {
    KVQ_ASSIGN_OR_RETURN(f->aux_, allocator_->AllocateHost(aux_bytes_));
    std::memcpy(f->aux_, aux_, aux_bytes_);
  }
  const int pt = layout_.page_tokens;
  const int quantized = whole ? quantized_tokens_ : std::max(0, tokens - sink);
  const int full_pages = quantized / pt;
  const int partial_rows = quantized % pt;
  for (int i = 0; i < full_pages; ++i) {
    allocator_->Retain(pages_[i], layout_.page_bytes);
    f->pages_.push_back(pages_[i]);
  }
  if (partial_rows > 0) {
    absl::StatusOr<uint8_t*> copy = allocator_->Allocate(layout_.page_bytes);
    if (!copy.ok()) return copy.status();  // f's destructor drops what it holds.
    f->pages_.push_back(*copy);
    KVQ_RETURN_IF_ERROR(allocator_->CopyBlock(*copy, pages_[full_pages], layout_.page_bytes));
  }
  KVQ_RETURN_IF_ERROR(backend_->Synchronize());
  f->num_tokens_ = tokens;
  f->quantized_tokens_ = quantized;
  // The tail (if kept) was copied with the aux block; a shorter fork ends on
  // a flush boundary, so its tail is empty.
  return f;
}

void KvStream::ReadStoredRow(Side side, int t, float* out) const {
  if (t < sink_tokens()) {
    RowToFloat(sink_row(side, t), DType::kFloat16, head_dim(), out);
  } else if (t - page_base() < quantized_tokens_) {
    const int u = t - page_base();
    const int pt = layout_.page_tokens;
    backend_->DequantizeRows(*this, side, pages_[u / pt], u % pt, 1, out);
    // A reference helper with no status to return: a device error leaves
    // NaNs, which no comparison against it accepts.
    if (!backend_->Synchronize().ok()) {
      std::fill(out, out + head_dim(), std::numeric_limits<float>::quiet_NaN());
    } else if (crq_) {
      crq_->Inverse(side, out, 1, t);
    }
  } else {
    RowToFloat(tail_row(side, t - page_base() - quantized_tokens_), DType::kFloat16, head_dim(),
               out);
  }
}

ByteBreakdown KvStream::AllocatedBytes() const {
  return StreamBytes(config_, layout_, quantized_tokens_, num_pages(), aux_bytes_);
}

}  // namespace kvq
