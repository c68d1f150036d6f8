// kvq_attention_timing: a small developer tool that times decode attention of
// one backend over a few schemes (the official tool is kvq-bench).
//
// It builds `kv_heads` streams of `context` tokens of random N(0, 1) keys and
// values per scheme, then times Attend() over all of them (one task per KV
// head, `group` query heads each; one decode query, or with --queries=N the
// last N positions' queries under the causal mask, as a prefill chunk
// attends): the median of `reps` calls after `warmup` calls, the schemes
// taking turns call by call. crq schemes get the identity calibration (its
// values do not change the work). Threads come from OpenMP
// (OMP_NUM_THREADS).
//
//   kvq_attention_timing [--context=32768] [--kv_heads=8] [--group=4]
//       [--head_dim=128] [--queries=1] [--reps=15] [--warmup=3] [--backend=cpu]
//       [--schemes=fp16,int8,fp8_e4m3,kivi4,kivi3,kivi2,kivi2:pre_rope,...]
//
// Prints one line per scheme: ms per call, KV bytes and the rate they are
// read at, and the speedup over the first scheme listed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/kv_stream.h"
#include "kernels/stream_config.h"

namespace kvq {
namespace {

struct Options {
  int context = 32768;
  int kv_heads = 8;
  int group = 4;
  int head_dim = 128;
  int queries = 1;
  int reps = 15;
  int warmup = 3;
  std::string backend = "cpu";
  std::vector<std::string> schemes = {"fp16",  "int8",  "fp8_e4m3",       "kivi4",
                                      "kivi3", "kivi2", "kivi2:pre_rope", "kivi2:nuq",
                                      "kivi2:outliers=1"};
};

bool ParseFlag(absl::string_view arg, absl::string_view name, std::string* value) {
  const std::string prefix = "--" + std::string(name) + "=";
  if (arg.substr(0, prefix.size()) != prefix) return false;
  *value = std::string(arg.substr(prefix.size()));
  return true;
}

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    std::string v;
    int* ints[] = {&o->context, &o->kv_heads, &o->group, &o->head_dim,
                   &o->queries, &o->reps,     &o->warmup};
    const char* names[] = {"context", "kv_heads", "group", "head_dim", "queries", "reps", "warmup"};
    bool done = false;
    for (int k = 0; k < 7 && !done; ++k) {
      if (ParseFlag(arg, names[k], &v)) {
        if (!absl::SimpleAtoi(v, ints[k])) return false;
        done = true;
      }
    }
    if (done) continue;
    if (ParseFlag(arg, "backend", &o->backend)) continue;
    if (ParseFlag(arg, "schemes", &v)) {
      o->schemes = absl::StrSplit(v, ',', absl::SkipEmpty());
      continue;
    }
    std::fprintf(stderr, "unknown argument %s\n", argv[i]);
    return false;
  }
  return o->context > 0 && o->kv_heads > 0 && o->group > 0 && o->reps > 0 && o->queries > 0 &&
         o->queries <= o->context;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int Run(const Options& o) {
  absl::StatusOr<const KernelBackend*> backend = BackendByName(o.backend);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  const int d = o.head_dim;
  std::mt19937_64 rng(42);
  std::normal_distribution<float> normal;
  const int chunk = 1024;
  std::vector<float> k(static_cast<size_t>(chunk) * d), v(k.size());
  // Queries [query][kv head][group][d], as a model's projection lays them out.
  const int q_row = o.kv_heads * o.group * d;
  std::vector<float> q(static_cast<size_t>(o.queries) * q_row);
  for (float& x : q) x = normal(rng);
  std::vector<int32_t> positions(o.queries);
  for (int i = 0; i < o.queries; ++i) positions[i] = o.context - o.queries + i;
  std::vector<float> out(q.size()), lse(static_cast<size_t>(o.queries) * o.kv_heads * o.group);
  std::printf("context %d, head_dim %d, %d KV heads x group %d, %d quer%s, backend %s\n",
              o.context, d, o.kv_heads, o.group, o.queries, o.queries == 1 ? "y" : "ies",
              o.backend.c_str());
  // Build every scheme's streams first, then time the schemes round-robin,
  // one call each per round, so that a noisy neighbour hits all of them alike
  // and the ratios of one run are comparable.
  struct Scheme {
    std::string name;
    std::vector<std::unique_ptr<KvStream>> streams;
    std::vector<AttentionTask> tasks;
    size_t bytes = 0;
    std::vector<double> ms;
  };
  std::vector<Scheme> schemes;
  for (const std::string& name : o.schemes) {
    absl::StatusOr<QuantSpec> spec = QuantSpec::Parse(name);
    if (!spec.ok()) {
      std::fprintf(stderr, "%s\n", std::string(spec.status().message()).c_str());
      return 1;
    }
    StreamConfig config;
    config.spec = *spec;
    config.head_dim = d;
    const Codebook codebook = Codebook::Uniform(spec->bits, d);
    const HeadCalibration identity = HeadCalibration::Identity(d);
    Scheme sc;
    sc.name = name;
    for (int h = 0; h < o.kv_heads; ++h) {
      absl::StatusOr<std::unique_ptr<KvStream>> s =
          KvStream::Create(config, &CpuBackend(), nullptr, spec->nuq ? &codebook : nullptr,
                           spec->is_crq() ? &identity : nullptr);
      if (!s.ok()) {
        std::fprintf(stderr, "%s\n", std::string(s.status().message()).c_str());
        return 1;
      }
      for (int t = 0; t < o.context; t += chunk) {
        const int n = std::min(chunk, o.context - t);
        for (size_t i = 0; i < static_cast<size_t>(n) * d; ++i) {
          k[i] = normal(rng);
          v[i] = normal(rng);
        }
        absl::Status st = (*s)->Append(Floats(k.data(), n, d), Floats(v.data(), n, d));
        if (!st.ok()) {
          std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
          return 1;
        }
      }
      sc.bytes += (*s)->AllocatedBytes().total();
      sc.streams.push_back(*std::move(s));
    }
    sc.tasks.resize(o.kv_heads);
    for (int h = 0; h < o.kv_heads; ++h) {
      AttentionTask& t = sc.tasks[h];
      t.stream = sc.streams[h].get();
      t.num_queries = o.queries;
      t.q = q.data() + static_cast<size_t>(h) * o.group * d;
      t.q_stride = q_row;
      t.q_positions = positions.data();
      t.out = out.data() + static_cast<size_t>(h) * o.group * d;
      t.out_stride = q_row;
      t.lse = lse.data() + static_cast<size_t>(h) * o.group;
      t.lse_stride = o.kv_heads * o.group;
    }
    schemes.push_back(std::move(sc));
  }
  AttentionOptions options;
  options.group_size = o.group;
  for (int i = 0; i < o.warmup + o.reps; ++i) {
    for (Scheme& sc : schemes) {
      const double t0 = Now();
      absl::Status st = (*backend)->Attend(sc.tasks, options);
      const double t1 = Now();
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
        return 1;
      }
      if (i >= o.warmup) sc.ms.push_back((t1 - t0) * 1e3);
    }
  }
  double first_ms = 0.0;
  for (Scheme& sc : schemes) {
    std::sort(sc.ms.begin(), sc.ms.end());
    const double med = sc.ms[sc.ms.size() / 2];
    if (first_ms == 0.0) first_ms = med;
    std::printf("%-28s %8.3f ms  (min %7.3f)  %7.1f MiB  %6.1f GB/s  x%.2f vs %s\n",
                sc.name.c_str(), med, sc.ms.front(), sc.bytes / 1048576.0,
                sc.bytes / (med * 1e-3) / 1e9, first_ms / med, o.schemes.front().c_str());
  }
  return 0;
}

}  // namespace
}  // namespace kvq

int main(int argc, char** argv) {
  kvq::Options o;
  if (!kvq::ParseArgs(argc, argv, &o)) {
    std::fprintf(stderr, "usage: see the comment at the top of bench/attention_timing.cc\n");
    return 2;
  }
  return kvq::Run(o);
}
