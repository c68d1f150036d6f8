// SCAFFOLD: replaced by the quantize/dequantize per-element programs.
#include "kernels/cpu/ref_kernels.h"
#include "kernels/cuda/host_program_backend.h"

namespace kvq {

void HostQuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                      int row0) {
  QuantizeRowsRef(s, side, rows, n, page, row0);
}

void HostDequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                        float* out) {
  DequantizeRowsRef(s, side, page, row0, n, out);
}

}  // namespace kvq
