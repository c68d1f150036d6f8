#include "kernels/cuda/host_program_backend.h"

#include "kernels/kv_stream.h"

namespace kvq {

// The allocator knows where the host may address its blocks: the block
// itself for host memory, a second mapping where the pages are hidden from
// the host (the test allocator that stands in for device memory). The real
// device pool has no host alias and is never used with cuda_host.
const uint8_t* HostPagePointer(const KvStream& s, int p) {
  return s.allocator()->HostAlias(s.page(p));
}
uint8_t* HostPagePointer(const KvStream& s, uint8_t* page) {
  return s.allocator()->HostAlias(page);
}

namespace {

class CudaHostBackendImpl final : public KernelBackend {
 public:
  absl::string_view name() const override { return "cuda_host"; }

  void QuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                    int row0) const override {
    HostQuantizeRows(s, side, rows, n, HostPagePointer(s, page), row0);
  }

  void DequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                      float* out) const override {
    HostDequantizeRows(s, side, HostPagePointer(s, const_cast<uint8_t*>(page)), row0, n, out);
  }

  absl::Status Attend(absl::Span<const AttentionTask> tasks,
                      const AttentionOptions& options) const override {
    if (absl::Status st = ValidateAttention(tasks, options); !st.ok()) return st;
    if (absl::Status st = HostAttend(tasks, options); !st.ok()) return st;
    return CheckAttentionResults(tasks, options);
  }
};

}  // namespace

const KernelBackend& CudaHostBackend() {
  static const CudaHostBackendImpl* backend = new CudaHostBackendImpl();
  return *backend;
}

}  // namespace kvq
