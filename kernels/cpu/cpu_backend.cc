// CpuBackend(): the SIMD (Highway) + multi-threaded (OpenMP) backend.
//
// Attend plans the work and leaves the arithmetic to the SIMD kernels
// (simd_attention.cc):
//  1. Each task's queries become "rows" (query i, head g): rotated into the
//     stored basis when the scheme rotates and multiplied by the softmax
//     scale once, with their causal visible end.
//  2. Rows go in blocks of kMaxRows, so the GQA group shares every tile of
//     keys and values the kernel loads.
//  3. A block's key range is split into chunks on page boundaries when there
//     is enough work for the threads (flash-decoding); every (block, chunk)
//     is one unit, run by an OpenMP thread into a partial output and LSE.
//  4. Partials of a block merge in key order by LSE (MergeAttention), the
//     output is rotated back, and written with the task's strides.
// Small problems run on the calling thread: a parallel region costs tens of
// microseconds of wake-up on a loaded host, more than short contexts take.
// All per-call buffers are thread-local and only grow.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/crq_cpu.h"
#include "kernels/cpu/ref_kernels.h"
#include "kernels/cpu/simd_dispatch.h"
#include "kernels/cpu/simd_kernels.h"

namespace kvq {
namespace {

// Below this many (row x key) pairs per call everything runs on one thread.
constexpr int64_t kParallelMinWork = int64_t{1} << 17;
bool Parallel(int64_t work) { return omp_get_max_threads() > 1 && work >= kParallelMinWork; }
// Chunks per thread when splitting key ranges (load balance vs merge cost).
constexpr int kChunksPerThread = 4;
// Smallest key chunk worth a unit of its own.
constexpr int kMinChunkTokens = 1024;

struct Block {
  int task = 0;
  int row0 = 0;   // First row of the block within its task.
  int rows = 0;
  int first_unit = 0;
  int num_units = 0;
};

struct CallScratch {
  std::vector<float> q;          // Prepared rows of every task.
  std::vector<int32_t> visible;  // Visible end per row.
  std::vector<size_t> row_base;  // Per task: index of its first row.
  std::vector<Block> blocks;
  std::vector<cpu::RangeJob> jobs;
  std::vector<float> out;        // Per unit: rows * head_dim.
  std::vector<float> lse;        // Per unit: rows.
  std::vector<size_t> out_base;  // Per unit: offset into out / lse (rows).
  std::vector<float> merged;     // One row.
  std::vector<size_t> q_base;    // Per task: offset of its rows in q.
  std::vector<int> cuts;         // Split points of one block's key range.
};

CallScratch& ThreadCallScratch() {
  static thread_local CallScratch s;
  return s;
}

int TaskEnd(const AttentionTask& t) {
  return t.key_end < 0 ? t.stream->num_tokens() : t.key_end;
}

// Split points of [begin, end) into chunks of about `chunk` tokens, on page
// boundaries of the stream where the chunk lies in its pages.
void SplitRange(const KvStream& s, int begin, int end, int chunk, std::vector<int>& cuts) {
  cuts.clear();
  cuts.push_back(begin);
  const int pt = s.layout().page_tokens;
  const int base = s.page_base();
  int t = begin;
  while (static_cast<int64_t>(end) - t > static_cast<int64_t>(chunk) + chunk / 2) {
    int next = t + chunk;
    if (next > base) next = base + (next - base) / pt * pt;  // Page-aligned.
    if (next <= t) next = t + chunk;
    if (next >= end) break;
    cuts.push_back(next);
    t = next;
  }
  cuts.push_back(end);
}

class CpuBackendImpl final : public KernelBackend {
 public:
  absl::string_view name() const override { return "cpu"; }

  void QuantizeRows(const KvStream& s, Side side, const float* rows, int n, uint8_t* page,
                    int row0) const override {
    if (s.layout().side(side).format == CodeFormat::kCrq) {
      cpu::QuantizeCrqRows(s, side, rows, n, page, row0);
      return;
    }
    if (!cpu::QuantizeRowsSimd(s, side, rows, n, page, row0)) {
      QuantizeRowsRef(s, side, rows, n, page, row0);
    }
  }

  bool QuantizeRowsHalf(const KvStream& s, Side side, const uint16_t* rows, int n,
                        uint8_t* page, int row0) const override {
    if (s.layout().side(side).format == CodeFormat::kCrq) return false;
    return cpu::QuantizeRowsHalfSimd(s, side, rows, n, page, row0);
  }

  void DequantizeRows(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                      float* out) const override {
    if (s.layout().side(side).format == CodeFormat::kCrq) {
      cpu::DequantizeCrqRows(s, side, page, row0, n, out);
      return;
    }
    cpu::DequantizeRowsSimd(s, side, page, row0, n, out);
  }

  bool DequantizeRowsHalf(const KvStream& s, Side side, const uint8_t* page, int row0, int n,
                          uint16_t* out, size_t stride) const override {
    if (s.layout().side(side).format == CodeFormat::kCrq) return false;
    return cpu::DequantizeRowsHalfSimd(s, side, page, row0, n, out, stride);
  }

  bool AttendUsesThreads(absl::Span<const AttentionTask> tasks,
                         const AttentionOptions& options) const override {
    int64_t work = 0;  // (row x key) pairs, as the plan below counts them.
    for (const AttentionTask& t : tasks) {
      if (t.stream == nullptr) return false;
      work += static_cast<int64_t>(TaskEnd(t) - t.key_begin) * t.num_queries * options.group_size;
    }
    return Parallel(work);
  }

  // Every page a unit reads is checked by the thread that reads it, just
  // before (RowPass::Run).
  bool ChecksPages() const override { return true; }

  absl::Status Attend(absl::Span<const AttentionTask> tasks,
                      const AttentionOptions& options) const override {
    if (absl::Status st = ValidateAttention(tasks, options); !st.ok()) return st;
    if (std::any_of(tasks.begin(), tasks.end(),
                    [](const AttentionTask& t) { return t.stream->crq() != nullptr; })) {
      // crq attends in its coded space (crq_cpu.h); the other tasks as below.
      std::vector<AttentionTask> crq, other;
      for (const AttentionTask& t : tasks) (t.stream->crq() ? crq : other).push_back(t);
      cpu::AttendCrq(crq, options, AttendUsesThreads(crq, options));
      if (!other.empty()) {
        if (absl::Status st = Attend(other, options); !st.ok()) return st;
      }
      return CheckAttentionResults(tasks, options);
    }
    CallScratch& cs = ThreadCallScratch();
    const int group = options.group_size;

    // 1. Prepared rows.
    size_t total_rows = 0;
    cs.row_base.resize(tasks.size());
    for (size_t i = 0; i < tasks.size(); ++i) {
      cs.row_base[i] = total_rows;
      total_rows += static_cast<size_t>(tasks[i].num_queries) * group;
    }
    size_t q_floats = 0;
    for (const AttentionTask& t : tasks) {
      q_floats += static_cast<size_t>(t.num_queries) * group * t.stream->head_dim();
    }
    if (cs.q.size() < q_floats) cs.q.resize(q_floats);
    if (cs.visible.size() < total_rows) cs.visible.resize(total_rows);
    std::vector<size_t>& q_base = cs.q_base;
    q_base.resize(tasks.size());
    {
      size_t off = 0;
      for (size_t i = 0; i < tasks.size(); ++i) {
        const AttentionTask& t = tasks[i];
        const KvStream& s = *t.stream;
        const int d = s.head_dim();
        const float scale = SoftmaxScale(options, d);
        const int end = TaskEnd(t);
        q_base[i] = off;
        for (int qi = 0; qi < t.num_queries; ++qi) {
          const int vis = t.q_positions ? std::min(end, t.q_positions[qi] + 1) : end;
          for (int g = 0; g < group; ++g) {
            const size_t row = static_cast<size_t>(qi) * group + g;
            float* dst = cs.q.data() + off + row * d;
            const float* src = t.q + static_cast<size_t>(qi) * t.q_stride + static_cast<size_t>(g) * d;
            std::copy(src, src + d, dst);
            if (s.rotation()) s.rotation()->Forward(dst);
            for (int c = 0; c < d; ++c) dst[c] *= scale;
            cs.visible[cs.row_base[i] + row] = vis;
          }
        }
        off += static_cast<size_t>(t.num_queries) * group * d;
      }
    }

    // 2-3. Blocks of rows and their key chunks.
    int64_t work = 0;
    cs.blocks.clear();
    for (size_t i = 0; i < tasks.size(); ++i) {
      const int rows = tasks[i].num_queries * group;
      const int span = TaskEnd(tasks[i]) - tasks[i].key_begin;
      for (int r0 = 0; r0 < rows; r0 += cpu::kMaxRows) {
        Block b;
        b.task = static_cast<int>(i);
        b.row0 = r0;
        b.rows = std::min(cpu::kMaxRows, rows - r0);
        cs.blocks.push_back(b);
        work += static_cast<int64_t>(span) * b.rows;
      }
    }
    const int max_threads = std::max(1, omp_get_max_threads());
    const bool parallel = Parallel(work);
    int64_t total_tokens = 0;
    for (const Block& b : cs.blocks) {
      total_tokens += TaskEnd(tasks[b.task]) - tasks[b.task].key_begin;
    }
    const int64_t target_units = static_cast<int64_t>(max_threads) * kChunksPerThread;
    const int chunk = parallel ? static_cast<int>(std::max<int64_t>(
                                     kMinChunkTokens, (total_tokens + target_units - 1) / target_units))
                               : std::numeric_limits<int>::max();
    cs.jobs.clear();
    cs.out_base.clear();
    size_t partial_rows = 0;
    std::vector<int>& cuts = cs.cuts;
    for (Block& b : cs.blocks) {
      const AttentionTask& t = tasks[b.task];
      const KvStream& s = *t.stream;
      const int d = s.head_dim();
      // Keys no row of the block can see are not worth a chunk.
      int vis_max = t.key_begin;
      for (int r = 0; r < b.rows; ++r) {
        vis_max = std::max(vis_max, cs.visible[cs.row_base[b.task] + b.row0 + r]);
      }
      const int end = std::max(t.key_begin, std::min(TaskEnd(t), vis_max));
      SplitRange(s, t.key_begin, end, chunk, cuts);
      b.first_unit = static_cast<int>(cs.jobs.size());
      b.num_units = static_cast<int>(cuts.size()) - 1;
      for (int u = 0; u < b.num_units; ++u) {
        cpu::RangeJob job;
        job.stream = &s;
        job.begin = cuts[u];
        job.end = cuts[u + 1];
        job.rows = b.rows;
        job.q = cs.q.data() + q_base[b.task] + static_cast<size_t>(b.row0) * d;
        job.visible_end = cs.visible.data() + cs.row_base[b.task] + b.row0;
        job.page_check = options.page_check;
        cs.jobs.push_back(job);
        cs.out_base.push_back(partial_rows);
        partial_rows += b.rows;
      }
    }
    // Partial buffers (head_dim may differ per task: size by the largest).
    int max_d = 0;
    for (const AttentionTask& t : tasks) max_d = std::max(max_d, t.stream->head_dim());
    if (cs.out.size() < partial_rows * max_d) cs.out.resize(partial_rows * max_d);
    if (cs.lse.size() < partial_rows) cs.lse.resize(partial_rows);
    for (size_t u = 0; u < cs.jobs.size(); ++u) {
      cs.jobs[u].out = cs.out.data() + cs.out_base[u] * max_d;
      cs.jobs[u].lse = cs.lse.data() + cs.out_base[u];
    }
    // Jobs write rows of their own head_dim contiguously from `out`; with
    // mixed head dims the stride max_d per row still separates units.

    const int units = static_cast<int>(cs.jobs.size());
    if (parallel && units > 1) {
      const int nt = std::min(max_threads, units);
      const cpu::RangeJob* jobs = cs.jobs.data();
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
      for (int u = 0; u < units; ++u) cpu::AttendRange(jobs[u]);
    } else {
      for (int u = 0; u < units; ++u) cpu::AttendRange(cs.jobs[u]);
    }

    // 4. Merge, rotate back, write out.
    for (const Block& b : cs.blocks) {
      const AttentionTask& t = tasks[b.task];
      const KvStream& s = *t.stream;
      const int d = s.head_dim();
      if (cs.merged.size() < static_cast<size_t>(d)) cs.merged.resize(d);
      for (int r = 0; r < b.rows; ++r) {
        const int row = b.row0 + r;
        const int qi = row / group;
        const int g = row % group;
        float* out = t.out + static_cast<size_t>(qi) * t.out_stride + static_cast<size_t>(g) * d;
        float* lse = t.lse + static_cast<size_t>(qi) * t.lse_stride + g;
        const cpu::RangeJob& first = cs.jobs[b.first_unit];
        const float* o0 = first.out + static_cast<size_t>(r) * d;
        float l = first.lse[r];
        std::copy(o0, o0 + d, cs.merged.begin());
        for (int u = 1; u < b.num_units; ++u) {
          const cpu::RangeJob& job = cs.jobs[b.first_unit + u];
          MergeAttention(cs.merged.data(), l, job.out + static_cast<size_t>(r) * d, job.lse[r], d,
                         cs.merged.data(), &l);
        }
        if (s.rotation() && l != -std::numeric_limits<float>::infinity()) {
          s.rotation()->Inverse(cs.merged.data());
        }
        std::copy(cs.merged.begin(), cs.merged.begin() + d, out);
        *lse = l;
      }
    }
    return CheckAttentionResults(tasks, options);
  }
};

}  // namespace

const KernelBackend& CpuBackend() {
  static const CpuBackendImpl* backend = [] {
    if (absl::Status s = cpu::PinSimdTargetFromEnv(); !s.ok()) {
      std::fprintf(stderr, "kvq: %s\n", std::string(s.message()).c_str());
    }
    return new CpuBackendImpl();
  }();
  return *backend;
}

}  // namespace kvq
