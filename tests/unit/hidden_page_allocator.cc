#include "tests/unit/hidden_page_allocator.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/page_layout.h"

namespace kvq {
namespace testutil {
namespace {

size_t Rounded(size_t bytes) {
  return std::max<size_t>(kPageAlign, (bytes + kPageAlign - 1) / kPageAlign * kPageAlign);
}

[[noreturn]] void Die(const char* what) {
  std::perror(what);
  std::abort();
}

}  // namespace

HiddenPageAllocator::HiddenPageAllocator(size_t capacity_bytes) : capacity_(capacity_bytes) {
  fd_ = memfd_create("kvq-hidden-pages", MFD_CLOEXEC);
  if (fd_ < 0) Die("memfd_create");
  if (ftruncate(fd_, static_cast<off_t>(capacity_)) != 0) Die("ftruncate");
  void* hidden = mmap(nullptr, capacity_, PROT_NONE, MAP_SHARED, fd_, 0);
  void* alias = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (hidden == MAP_FAILED || alias == MAP_FAILED) Die("mmap");
  hidden_ = static_cast<uint8_t*>(hidden);
  alias_ = static_cast<uint8_t*>(alias);
}

HiddenPageAllocator::~HiddenPageAllocator() {
  absl::MutexLock lock(&mu_);
  for (auto& [p, bytes] : host_) std::free(p);
  munmap(hidden_, capacity_);
  munmap(alias_, capacity_);
  close(fd_);
}

absl::StatusOr<uint8_t*> HiddenPageAllocator::Allocate(size_t bytes) {
  const size_t rounded = Rounded(bytes);
  absl::MutexLock lock(&mu_);
  size_t at;
  if (auto it = free_.find(rounded); it != free_.end() && !it->second.empty()) {
    at = it->second.back();
    it->second.pop_back();
  } else if (capacity_ - next_ >= rounded) {
    at = next_;
    next_ += rounded;
  } else {
    return absl::ResourceExhaustedError(
        absl::StrCat("hidden page allocator: ", capacity_, " bytes in use (", bytes, " asked)"));
  }
  // Poison, as TestAllocator does: the stream must initialise what it reads.
  std::memset(alias_ + at, 0xa5, rounded);
  live_[at] = Block{bytes, 1};
  live_bytes_ += bytes;
  return hidden_ + at;
}

void HiddenPageAllocator::Retain(uint8_t* block, size_t bytes) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(static_cast<size_t>(block - hidden_));
  if (block < hidden_ || it == live_.end() || it->second.bytes != bytes) {
    ++bad_calls_;
    return;
  }
  ++it->second.refs;
}

void HiddenPageAllocator::Free(uint8_t* block, size_t bytes) {
  absl::MutexLock lock(&mu_);
  const size_t at = static_cast<size_t>(block - hidden_);
  auto it = live_.find(at);
  if (block < hidden_ || it == live_.end() || it->second.bytes != bytes) {
    ++bad_calls_;
    return;
  }
  if (--it->second.refs > 0) return;
  live_.erase(it);
  live_bytes_ -= bytes;
  free_[Rounded(bytes)].push_back(at);
}

uint8_t* HiddenPageAllocator::Checked(const uint8_t* block, size_t offset, size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (block >= hidden_ && block < hidden_ + capacity_) {
    auto it = live_.find(static_cast<size_t>(block - hidden_));
    if (it != live_.end() && offset <= it->second.bytes && bytes <= it->second.bytes - offset) {
      return alias_ + (block - hidden_) + offset;
    }
  }
  ++bad_calls_;
  return nullptr;
}

absl::Status HiddenPageAllocator::ReadBlock(const uint8_t* block, size_t offset, size_t bytes,
                                            uint8_t* out) {
  uint8_t* from = Checked(block, offset, bytes);
  if (from == nullptr) return absl::InvalidArgumentError("ReadBlock outside a live block");
  std::memcpy(out, from, bytes);
  return absl::OkStatus();
}

absl::Status HiddenPageAllocator::WriteBlock(uint8_t* block, size_t offset, const uint8_t* data,
                                             size_t bytes) {
  uint8_t* to = Checked(block, offset, bytes);
  if (to == nullptr) return absl::InvalidArgumentError("WriteBlock outside a live block");
  std::memcpy(to, data, bytes);
  return absl::OkStatus();
}

absl::Status HiddenPageAllocator::ZeroBlock(uint8_t* block, size_t offset, size_t bytes) {
  uint8_t* to = Checked(block, offset, bytes);
  if (to == nullptr) return absl::InvalidArgumentError("ZeroBlock outside a live block");
  std::memset(to, 0, bytes);
  return absl::OkStatus();
}

absl::Status HiddenPageAllocator::CopyBlock(uint8_t* dst, const uint8_t* src, size_t bytes) {
  uint8_t* to = Checked(dst, 0, bytes);
  uint8_t* from = Checked(src, 0, bytes);
  if (to == nullptr || from == nullptr) {
    return absl::InvalidArgumentError("CopyBlock outside a live block");
  }
  std::memcpy(to, from, bytes);
  return absl::OkStatus();
}

uint8_t* HiddenPageAllocator::HostAlias(const uint8_t* block) {
  if (block >= hidden_ && block < hidden_ + capacity_) return alias_ + (block - hidden_);
  return const_cast<uint8_t*>(block);
}

void HiddenPageAllocator::SetChecksums(absl::Span<const uint8_t* const> blocks,
                                       absl::Span<const uint64_t> sums) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < blocks.size() && i < sums.size(); ++i) {
    auto it = live_.find(static_cast<size_t>(blocks[i] - hidden_));
    if (it == live_.end()) {
      ++bad_calls_;
      continue;
    }
    it->second.checksum = sums[i];
  }
}

void HiddenPageAllocator::GetChecksums(absl::Span<const uint8_t* const> blocks,
                                       absl::Span<uint64_t> sums) const {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < blocks.size() && i < sums.size(); ++i) {
    auto it = live_.find(static_cast<size_t>(blocks[i] - hidden_));
    sums[i] = it == live_.end() ? 0 : it->second.checksum;
  }
}

absl::StatusOr<uint8_t*> HiddenPageAllocator::AllocateHost(size_t bytes) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kPageAlign, Rounded(bytes)));
  if (p == nullptr) return absl::ResourceExhaustedError("hidden page allocator: host block");
  std::memset(p, 0xa5, Rounded(bytes));
  absl::MutexLock lock(&mu_);
  host_[p] = bytes;
  live_bytes_ += bytes;
  return p;
}

void HiddenPageAllocator::FreeHost(uint8_t* block, size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    auto it = host_.find(block);
    if (it == host_.end() || it->second != bytes) {
      ++bad_calls_;
      return;
    }
    host_.erase(it);
    live_bytes_ -= bytes;
  }
  std::free(block);
}

size_t HiddenPageAllocator::live_bytes() const {
  absl::MutexLock lock(&mu_);
  return live_bytes_;
}

int HiddenPageAllocator::live_blocks() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(live_.size() + host_.size());
}

int HiddenPageAllocator::bad_calls() const {
  absl::MutexLock lock(&mu_);
  return bad_calls_;
}

HiddenPageAllocator* SharedHiddenPages() {
  static HiddenPageAllocator* allocator = new HiddenPageAllocator();
  return allocator;
}

}  // namespace testutil
}  // namespace kvq
