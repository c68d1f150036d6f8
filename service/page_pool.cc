#include "service/page_pool.h"

#include <sys/mman.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/page_layout.h"

namespace kvq {
namespace {

constexpr size_t kRunContinuation = ~size_t{0};  // slot_bytes of a run's later slabs.

}  // namespace

absl::StatusOr<std::unique_ptr<PagePool>> PagePool::Create(const PagePoolOptions& options) {
  if (options.slab_bytes < kPageAlign || options.slab_bytes % kPageAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slab_bytes must be a positive multiple of ", kPageAlign, ", got ", options.slab_bytes));
  }
  const size_t slabs = options.capacity_bytes / options.slab_bytes;
  if (slabs == 0) {
    return absl::InvalidArgumentError(absl::StrCat("capacity_bytes ", options.capacity_bytes,
                                                   " is below one slab of ", options.slab_bytes,
                                                   " bytes"));
  }
  void* arena = mmap(nullptr, slabs * options.slab_bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (arena == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot reserve a page pool of ", slabs * options.slab_bytes, " bytes"));
  }
  // A hint: a kernel without transparent huge pages refuses it, and the
  // pool works the same on 4 KiB pages.
  if (options.huge_pages) madvise(arena, slabs * options.slab_bytes, MADV_HUGEPAGE);
  return std::unique_ptr<PagePool>(
      new PagePool(static_cast<uint8_t*>(arena), slabs, options.slab_bytes));
}

PagePool::PagePool(uint8_t* arena, size_t slabs, size_t slab_bytes)
    : arena_(arena),
      slab_bytes_(slab_bytes),
      slabs_(slabs),
      free_slabs_(slabs) {}

PagePool::~PagePool() { munmap(arena_, slabs_.size() * slab_bytes_); }

size_t PagePool::SlotBytes(size_t bytes) {
  return std::max(kPageAlign, (bytes + kPageAlign - 1) / kPageAlign * kPageAlign);
}

size_t PagePool::SlabOf(const uint8_t* block) const {
  return static_cast<size_t>(block - arena_) / slab_bytes_;
}

size_t PagePool::TakeSlabs(size_t n) {
  if (free_slabs_ < n) return slabs_.size();
  size_t run = 0;
  for (size_t i = 0; i < slabs_.size(); ++i) {
    run = slabs_[i].slot_bytes == 0 ? run + 1 : 0;
    if (run == n) {
      free_slabs_ -= n;
      return i + 1 - n;
    }
  }
  return slabs_.size();
}

absl::StatusOr<uint8_t*> PagePool::Allocate(size_t bytes) {
  const size_t slot = SlotBytes(bytes);
  absl::MutexLock lock(&mu_);
  auto exhausted = [&] {
    return absl::ResourceExhaustedError(absl::StrCat(
        "page pool exhausted: a block of ", slot, " bytes does not fit; ",
        slabs_.size() * slab_bytes_ - used_bytes_, " of ", slabs_.size() * slab_bytes_,
        " bytes free (", free_slabs_, " whole slabs of ", slab_bytes_, ")"));
  };
  uint8_t* block;
  if (slot > slab_bytes_) {
    const size_t n = (slot + slab_bytes_ - 1) / slab_bytes_;
    const size_t first = TakeSlabs(n);
    if (first == slabs_.size()) return exhausted();
    slabs_[first].slot_bytes = slot;
    slabs_[first].run_slabs = static_cast<uint32_t>(n);
    slabs_[first].live = 1;
    SizeChecksums(slabs_[first], 1);
    for (size_t i = 1; i < n; ++i) slabs_[first + i].slot_bytes = kRunContinuation;
    block = SlabBase(first);
  } else {
    std::vector<size_t>& open = open_slabs_[slot];
    if (open.empty()) {
      const size_t s = TakeSlabs(1);
      if (s == slabs_.size()) return exhausted();
      Slab& slab = slabs_[s];
      slab.slot_bytes = slot;
      const uint32_t slots = static_cast<uint32_t>(slab_bytes_ / slot);
      slab.free.resize(slots);
      for (uint32_t i = 0; i < slots; ++i) slab.free[i] = slots - 1 - i;
      SizeChecksums(slab, slots);
      open.push_back(s);
    }
    const size_t s = open.back();
    Slab& slab = slabs_[s];
    const uint32_t index = slab.free.back();
    slab.free.pop_back();
    ++slab.live;
    if (slab.free.empty()) open.pop_back();
    block = SlabBase(s) + static_cast<size_t>(index) * slot;
  }
  used_bytes_ += slot;
  ++blocks_used_;
  return block;
}

void PagePool::Retain(uint8_t* block, size_t) {
  absl::MutexLock lock(&mu_);
  ++extra_refs_[block];
}

void PagePool::Free(uint8_t* block, size_t bytes) { FreeLast(block, bytes); }

bool PagePool::FreeLast(uint8_t* block, size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (auto it = extra_refs_.find(block); it != extra_refs_.end()) {
    if (--it->second == 0) extra_refs_.erase(it);
    return false;
  }
  ReleaseBlock(block, SlotBytes(bytes));
  return true;
}

void PagePool::ReleaseBlock(uint8_t* block, size_t slot) {
  const size_t s = SlabOf(block);
  Slab& slab = slabs_[s];
  used_bytes_ -= slot;
  --blocks_used_;
  SetChecksum(block, 0);  // A reused slot starts unsealed.
  if (slab.run_slabs > 0) {
    SizeChecksums(slab, 0);
    for (size_t i = 0; i < slab.run_slabs; ++i) slabs_[s + i].slot_bytes = 0;
    free_slabs_ += slab.run_slabs;
    slab.run_slabs = 0;
    slab.live = 0;
    return;
  }
  const uint32_t index = static_cast<uint32_t>((block - SlabBase(s)) / slot);
  slab.free.push_back(index);
  --slab.live;
  std::vector<size_t>& open = open_slabs_[slot];
  if (slab.live == 0) {
    // Whole slab free again: give it back to every class.
    open.erase(std::remove(open.begin(), open.end(), s), open.end());
    slab.free.clear();
    slab.free.shrink_to_fit();
    SizeChecksums(slab, 0);
    slab.slot_bytes = 0;
    ++free_slabs_;
  } else if (slab.free.size() == 1) {
    open.push_back(s);
  }
}

bool PagePool::CanAllocate(size_t bytes, size_t count) const {
  const size_t slot = SlotBytes(bytes);
  absl::MutexLock lock(&mu_);
  if (slot > slab_bytes_) {
    return free_slabs_ >= count * ((slot + slab_bytes_ - 1) / slab_bytes_);
  }
  size_t available = free_slabs_ * (slab_bytes_ / slot);
  if (auto it = open_slabs_.find(slot); it != open_slabs_.end()) {
    for (size_t s : it->second) available += slabs_[s].free.size();
  }
  return available >= count;
}

PagePoolStats PagePool::Stats() const {
  absl::MutexLock lock(&mu_);
  PagePoolStats st;
  st.capacity_bytes = slabs_.size() * slab_bytes_;
  st.used_bytes = used_bytes_;
  st.slab_bytes = slab_bytes_;
  st.slabs_total = slabs_.size();
  st.slabs_used = slabs_.size() - free_slabs_;
  st.blocks_used = blocks_used_;
  st.shared_blocks = extra_refs_.size();
  st.checksum_bytes = checksum_words_ * sizeof(uint64_t);
  st.sealed_blocks = sealed_blocks_;
  return st;
}

void PagePool::SizeChecksums(Slab& slab, size_t slots) {
  checksum_words_ -= slab.checksums.size();
  if (slots == 0) {
    slab.checksums.clear();
    slab.checksums.shrink_to_fit();
  } else {
    slab.checksums.assign(slots, 0);
  }
  checksum_words_ += slots;
}

std::pair<size_t, size_t> PagePool::ChecksumSlot(const uint8_t* block) const {
  const size_t s = SlabOf(block);
  const Slab& slab = slabs_[s];
  if (slab.run_slabs > 0) return {s, 0};
  return {s, static_cast<size_t>(block - SlabBase(s)) / slab.slot_bytes};
}

void PagePool::SetChecksum(const uint8_t* block, uint64_t sum) {
  const auto [s, i] = ChecksumSlot(block);
  uint64_t& word = slabs_[s].checksums[i];
  sealed_blocks_ += static_cast<size_t>(sum != 0) - static_cast<size_t>(word != 0);
  word = sum;
}

void PagePool::SetChecksums(absl::Span<const uint8_t* const> blocks,
                            absl::Span<const uint64_t> sums) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < blocks.size(); ++i) SetChecksum(blocks[i], sums[i]);
}

void PagePool::GetChecksums(absl::Span<const uint8_t* const> blocks,
                            absl::Span<uint64_t> sums) const {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const auto [s, slot] = ChecksumSlot(blocks[i]);
    sums[i] = slabs_[s].checksums[slot];
  }
}

}  // namespace kvq
