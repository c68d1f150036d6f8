// Device memory for the GPU tests: a buffer freed at scope exit, host data
// copied into a new one, and an assertion on CUDA calls.
#ifndef KVQ_TESTS_GPU_DEVICE_BUFFER_H_
#define KVQ_TESTS_GPU_DEVICE_BUFFER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <vector>

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

namespace kvq::testutil {

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&ptr, bytes == 0 ? 1 : bytes) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(ptr); }
};

// Host bytes copied into a new device buffer (null on failure).
inline std::unique_ptr<DeviceBuffer> Upload(const void* data, size_t bytes) {
  auto b = std::make_unique<DeviceBuffer>(bytes);
  if (b->ptr == nullptr) return nullptr;
  if (bytes > 0 && cudaMemcpy(b->ptr, data, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
    return nullptr;
  }
  return b;
}
template <class T>
std::unique_ptr<DeviceBuffer> Upload(const std::vector<T>& v) {
  return Upload(v.data(), v.size() * sizeof(T));
}

}  // namespace kvq::testutil

#endif  // KVQ_TESTS_GPU_DEVICE_BUFFER_H_
