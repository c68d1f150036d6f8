#include "kernels/cuda/device_page_pool.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_info.h"
#include "kernels/page_layout.h"

namespace kvq {
namespace {

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

absl::StatusOr<std::unique_ptr<DevicePagePool>> DevicePagePool::Create(
    const DevicePagePoolOptions& options, PageAllocator* host) {
  if (options.page_bytes == 0) {
    return absl::InvalidArgumentError("device page pool: page_bytes must be > 0");
  }
  if (options.capacity_bytes == 0 &&
      !(options.capacity_fraction > 0.0 && options.capacity_fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device page pool: capacity_fraction must be in (0, 1] when capacity_bytes is 0, got ",
        options.capacity_fraction));
  }
  if (options.staging_buffers < 1 || options.staging_bytes < kPageAlign) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device page pool: staging_buffers must be >= 1 and staging_bytes >= ", kPageAlign));
  }
  absl::StatusOr<DeviceInfo> info = QueryCudaDevice(options.device);  // Also cudaSetDevice.
  if (!info.ok()) return info.status();
  const size_t slot = RoundUp(options.page_bytes, kPageAlign);
  const size_t wanted =
      options.capacity_bytes > 0
          ? options.capacity_bytes
          : static_cast<size_t>(static_cast<double>(info->free_bytes) * options.capacity_fraction);
  const size_t slots = wanted / slot;
  if (slots == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device page pool: capacity of ", wanted, " bytes is below one page of ",
                     slot, " bytes"));
  }
  if (slots > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("device page pool: ", slots,
                                                   " pages is more than ", UINT32_MAX));
  }
  void* base = nullptr;
  KVQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&base, slots * slot),
                           absl::StrCat("cudaMalloc of the ", slots * slot,
                                        "-byte device page pool on device ", options.device));
  std::unique_ptr<DevicePagePool> pool(new DevicePagePool(
      options.device, static_cast<uint8_t*>(base), slots, slot,
      host != nullptr ? host : HeapPageAllocator()));
  pool->staging_bytes_ = RoundUp(options.staging_bytes, kPageAlign);
  for (int i = 0; i < options.staging_buffers; ++i) {
    void* p = nullptr;
    KVQ_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, pool->staging_bytes_, cudaHostAllocDefault),
                             "cudaHostAlloc of a staging buffer");
    pool->staging_all_.push_back(static_cast<uint8_t*>(p));
  }
  {
    absl::MutexLock lock(&pool->staging_mu_);
    pool->staging_free_ = pool->staging_all_;
  }
  return pool;
}

DevicePagePool::DevicePagePool(int device, uint8_t* base, size_t slots, size_t slot_bytes,
                               PageAllocator* host)
    : device_(device), base_(base), slots_(slots), slot_bytes_(slot_bytes), host_(host) {
  absl::MutexLock lock(&mu_);
  refs_.assign(slots_, 0);
  sums_.assign(slots_, 0);
  free_.reserve(slots_);
  // Handed out from the lowest address up (popped from the back).
  for (size_t i = slots_; i > 0; --i) free_.push_back(static_cast<uint32_t>(i - 1));
}

DevicePagePool::~DevicePagePool() {
  cudaSetDevice(device_);
  for (uint8_t* p : staging_all_) cudaFreeHost(p);
  cudaFree(base_);
}

absl::StatusOr<uint8_t*> DevicePagePool::Allocate(size_t bytes) {
  if (bytes > slot_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("device page pool: a block of ", bytes,
                                                   " bytes is larger than its page_bytes, ",
                                                   slot_bytes_));
  }
  absl::MutexLock lock(&mu_);
  if (free_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("device page pool on device ", device_, " is full: ", slots_, " pages of ",
                     slot_bytes_, " bytes in use"));
  }
  const uint32_t slot = free_.back();
  free_.pop_back();
  refs_[slot] = 1;
  return base_ + static_cast<size_t>(slot) * slot_bytes_;
}

size_t DevicePagePool::SlotOf(const uint8_t* block) const {
  if (block < base_ || block >= base_ + slots_ * slot_bytes_) return slots_;
  const size_t offset = static_cast<size_t>(block - base_);
  return offset % slot_bytes_ == 0 ? offset / slot_bytes_ : slots_;
}

void DevicePagePool::Retain(uint8_t* block, size_t) {
  const size_t slot = SlotOf(block);
  absl::MutexLock lock(&mu_);
  if (slot == slots_ || refs_[slot] == 0) return;  // Not a live block: nothing to count.
  if (refs_[slot]++ == 1) ++shared_;
}

void DevicePagePool::Free(uint8_t* block, size_t) {
  const size_t slot = SlotOf(block);
  absl::MutexLock lock(&mu_);
  if (slot == slots_ || refs_[slot] == 0) return;
  if (--refs_[slot] == 1) --shared_;
  if (refs_[slot] == 0) {
    sums_[slot] = 0;  // A reused slot starts unsealed.
    free_.push_back(static_cast<uint32_t>(slot));
  }
}

void DevicePagePool::SetChecksums(absl::Span<const uint8_t* const> blocks,
                                  absl::Span<const uint64_t> sums) {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < blocks.size() && i < sums.size(); ++i) {
    const size_t slot = SlotOf(blocks[i]);
    if (slot != slots_ && refs_[slot] > 0) sums_[slot] = sums[i];
  }
}

void DevicePagePool::GetChecksums(absl::Span<const uint8_t* const> blocks,
                                  absl::Span<uint64_t> sums) const {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < blocks.size() && i < sums.size(); ++i) {
    const size_t slot = SlotOf(blocks[i]);
    sums[i] = slot == slots_ ? 0 : sums_[slot];
  }
}

uint8_t* DevicePagePool::TakeStaging() {
  absl::MutexLock lock(&staging_mu_);
  staging_mu_.Await(absl::Condition(
      +[](std::vector<uint8_t*>* free) { return !free->empty(); }, &staging_free_));
  uint8_t* b = staging_free_.back();
  staging_free_.pop_back();
  return b;
}

void DevicePagePool::ReturnStaging(uint8_t* buffer) {
  absl::MutexLock lock(&staging_mu_);
  staging_free_.push_back(buffer);
}

absl::Status DevicePagePool::StagedCopy(uint8_t* device_ptr, const uint8_t* host_in,
                                        uint8_t* host_out, size_t bytes) {
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  uint8_t* staging = TakeStaging();
  absl::Status st;
  for (size_t done = 0; done < bytes && st.ok();) {
    const size_t n = std::min(staging_bytes_, bytes - done);
    cudaError_t e;
    if (host_in != nullptr) {
      std::memcpy(staging, host_in + done, n);
      e = cudaMemcpyAsync(device_ptr + done, staging, n, cudaMemcpyHostToDevice,
                          cudaStreamPerThread);
    } else {
      e = cudaMemcpyAsync(staging, device_ptr + done, n, cudaMemcpyDeviceToHost,
                          cudaStreamPerThread);
    }
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamPerThread);
    st = CudaStatus(e, host_in != nullptr ? "copy of page bytes to the device"
                                          : "copy of page bytes from the device");
    if (st.ok() && host_out != nullptr) std::memcpy(host_out + done, staging, n);
    done += n;
  }
  ReturnStaging(staging);
  return st;
}

absl::Status DevicePagePool::ReadBlock(const uint8_t* block, size_t offset, size_t bytes,
                                       uint8_t* out) {
  return StagedCopy(const_cast<uint8_t*>(block) + offset, nullptr, out, bytes);
}

absl::Status DevicePagePool::WriteBlock(uint8_t* block, size_t offset, const uint8_t* data,
                                        size_t bytes) {
  return StagedCopy(block + offset, data, nullptr, bytes);
}

absl::Status DevicePagePool::ZeroBlock(uint8_t* block, size_t offset, size_t bytes) {
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  KVQ_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(block + offset, 0, bytes, cudaStreamPerThread),
                           "cudaMemsetAsync of a page");
  KVQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamPerThread), "zeroing a page");
  return absl::OkStatus();
}

absl::Status DevicePagePool::CopyBlock(uint8_t* dst, const uint8_t* src, size_t bytes) {
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  KVQ_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cudaStreamPerThread),
      "cudaMemcpyAsync of a page on the device");
  KVQ_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamPerThread), "copying a page");
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> DevicePagePool::AllocateHost(size_t bytes) {
  return host_->Allocate(bytes);
}

void DevicePagePool::FreeHost(uint8_t* block, size_t bytes) { host_->Free(block, bytes); }

DevicePagePoolStats DevicePagePool::Stats() const {
  absl::MutexLock lock(&mu_);
  DevicePagePoolStats s;
  s.capacity_bytes = slots_ * slot_bytes_;
  s.page_bytes = slot_bytes_;
  s.pages_total = slots_;
  s.pages_used = slots_ - free_.size();
  s.shared_pages = shared_;
  return s;
}

absl::StatusOr<double> MeasureDeviceCopyBandwidth(int device, size_t bytes, int repeats) {
  if (repeats < 1) return absl::InvalidArgumentError("repeats must be >= 1");
  KVQ_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  void* a = nullptr;
  void* b = nullptr;
  KVQ_CUDA_RETURN_IF_ERROR(cudaMalloc(&a, bytes), "cudaMalloc of the copy source");
  if (cudaError_t e = cudaMalloc(&b, bytes); e != cudaSuccess) {
    cudaFree(a);
    return CudaStatus(e, "cudaMalloc of the copy destination");
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> seconds;
  cudaError_t e = cudaMemset(a, 1, bytes);
  for (int i = -1; i < repeats && e == cudaSuccess; ++i) {  // i = -1: warm-up.
    e = cudaEventRecord(start, cudaStreamPerThread);
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, cudaStreamPerThread);
    }
    if (e == cudaSuccess) e = cudaEventRecord(stop, cudaStreamPerThread);
    if (e == cudaSuccess) e = cudaEventSynchronize(stop);
    float ms = 0.0f;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, stop);
    if (e == cudaSuccess && i >= 0) seconds.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  if (e != cudaSuccess) return CudaStatus(e, "device-to-device copy");
  std::sort(seconds.begin(), seconds.end());
  return static_cast<double>(bytes) / seconds[seconds.size() / 2] / 1e9;
}

}  // namespace kvq
