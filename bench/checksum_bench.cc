#include "bench/checksum_bench.h"

#include <time.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "kernels/backend.h"
#include "kernels/status_macros.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "service/kvq_service.h"
#include "service/page_checksum.h"

ABSL_DECLARE_FLAG(int, tokens);
ABSL_DECLARE_FLAG(int, reps);
ABSL_DECLARE_FLAG(std::vector<std::string>, schemes);

namespace kvq {
namespace {

constexpr int kKvHeads = 8, kQHeads = 32, kDim = 128;
constexpr int kFetchTokens = 8192;  // FetchDequant reads this many tokens (or all, if fewer).

// CPU seconds of the whole process (every thread: the handler, the
// kernels', gRPC's): on a busy machine, where a call's wall time mostly
// measures the wait for a core, this still measures the work.
double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// The first line of /proc/loadavg: how busy the machine was.
std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string line;
  std::getline(in, line);
  return line;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One verify_fraction's service on a loopback port.
struct Endpoint {
  Endpoint(SequenceStore* store, Metrics* metrics, double fraction) {
    ServiceOptions o;
    o.verify_fraction = fraction;
    service = std::make_unique<KvqService>(store, metrics, o);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxSendMessageSize(256 << 20);
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    stub = v1::KvCache::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), args));
  }
  ~Endpoint() { server->Shutdown(); }

  std::unique_ptr<KvqService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<v1::KvCache::Stub> stub;
};

absl::Status Fetch(v1::KvCache::Stub& stub, bool raw, int token_end) {
  v1::FetchRequest req;
  req.mutable_sequence()->set_sequence_id("s");
  req.set_raw(raw);
  req.set_token_end(token_end);
  req.set_max_chunk_bytes(4 << 20);
  grpc::ClientContext ctx;
  auto reader = stub.FetchDequant(&ctx, req);
  v1::FetchResponse msg;
  while (reader->Read(&msg)) {
  }
  const grpc::Status st = reader->Finish();
  return st.ok() ? absl::OkStatus() : absl::InternalError(st.error_message());
}

struct Row {
  std::string what;
  size_t verified_bytes = 0;  // Sealed page bytes one call verifies.
  double off_s = 0, on_s = 0;          // Wall time, medians.
  double off_cpu_s = 0, on_cpu_s = 0;  // Process CPU time, medians.
};

// What one scheme's run measured besides the rows.
struct SchemeFacts {
  double hash_bytes_per_s = 0;  // XXH3 over the sequence's pages, median.
  size_t page_bytes = 0;
  PagePoolStats pool;           // With the sequence stored.
};

absl::StatusOr<std::vector<Row>> RunScheme(const std::string& scheme, int tokens, int reps,
                                           SchemeFacts* facts) {
  StoreOptions so;
  so.pool.capacity_bytes = size_t{1} << 30;
  KVQ_ASSIGN_OR_RETURN(std::unique_ptr<SequenceStore> store, SequenceStore::Create(so, &CpuBackend()));
  KVQ_ASSIGN_OR_RETURN(std::unique_ptr<Metrics> metrics, Metrics::Create("", store.get(), "host"));
  CreateSequenceArgs args;
  args.id = "s";
  args.shape.num_layers = 1;
  args.shape.num_kv_heads = kKvHeads;
  args.shape.num_q_heads = kQHeads;
  args.shape.head_dim = kDim;
  args.scheme = scheme;
  KVQ_ASSIGN_OR_RETURN(SequenceStore::Handle seq, store->Create(args));
  {
    // The prompt, 1024 tokens a call: N(0, 1) keys and values.
    std::mt19937 rng(1);
    std::normal_distribution<float> dist;
    const int chunk = 1024;
    std::vector<float> k(static_cast<size_t>(kKvHeads) * chunk * kDim), v(k.size());
    absl::MutexLock lock(&seq->mu());
    for (int done = 0; done < tokens; done += chunk) {
      const int n = std::min(chunk, tokens - done);
      for (float& x : k) x = dist(rng);
      for (float& x : v) x = dist(rng);
      // [layers=1, kv_heads, n, dim]: rows of one head contiguous.
      std::vector<float> kk(static_cast<size_t>(kKvHeads) * n * kDim), vv(kk.size());
      std::copy(k.begin(), k.begin() + kk.size(), kk.begin());
      std::copy(v.begin(), v.begin() + vv.size(), vv.begin());
      KVQ_RETURN_IF_ERROR(seq->AppendDense(DenseKv{0, 1, n, DType::kFloat32,
                                                   reinterpret_cast<const uint8_t*>(kk.data()),
                                                   reinterpret_cast<const uint8_t*>(vv.data())}));
    }
    SealFullPages(*seq, store->pool(), 0, 1);
  }
  // Sealed page bytes of a token range, over every head.
  auto sealed_bytes = [&](int end) {
    const KvStream& s = seq->stream(0, 0);
    const int pt = s.layout().page_tokens;
    const int full = s.quantized_tokens() / pt;
    const int pages = std::min(full, (std::max(0, end - s.page_base()) + pt - 1) / pt);
    return static_cast<size_t>(pages) * s.layout().page_bytes * kKvHeads;
  };

  // XXH3's own rate over the same pages (every head, every full page), in
  // this thread's CPU time, like the calls' CPU columns.
  {
    std::vector<double> rates;
    for (int r = 0; r < reps; ++r) {
      uint64_t sink = 0;
      size_t bytes = 0;
      const double t0 = ThreadCpuSeconds();
      for (int h = 0; h < kKvHeads; ++h) {
        const KvStream& s = seq->stream(0, h);
        const int full = s.quantized_tokens() / s.layout().page_tokens;
        for (int i = 0; i < full; ++i) {
          sink ^= PageChecksum(s.page(i), s.layout().page_bytes);
          bytes += s.layout().page_bytes;
        }
      }
      const double secs = ThreadCpuSeconds() - t0;
      if (sink == 42) std::fprintf(stderr, " ");  // Keeps the loop.
      rates.push_back(bytes / secs);
    }
    facts->hash_bytes_per_s = Median(rates);
    facts->page_bytes = seq->stream(0, 0).layout().page_bytes;
    facts->pool = store->pool().Stats();
  }

  Endpoint off(store.get(), metrics.get(), 0.0), on(store.get(), metrics.get(), 1.0);
  v1::AttendRequest attend;
  {
    v1::AttendItem* item = attend.add_items();
    item->mutable_sequence()->set_sequence_id("s");
    v1::Tensor* q = item->mutable_q();
    q->set_dtype(v1::DTYPE_FP32);
    for (int64_t d : {1, kQHeads, kDim}) q->add_shape(d);
    std::vector<float> qv(static_cast<size_t>(kQHeads) * kDim);
    std::mt19937 rng(2);
    std::normal_distribution<float> dist;
    for (float& x : qv) x = dist(rng);
    q->set_data(qv.data(), qv.size() * sizeof(float));
  }
  const int fetch_end = std::min(tokens, kFetchTokens);
  const int raw_end = seq->stream(0, 0).page_base() +
                      std::min(seq->stream(0, 0).quantized_tokens(),
                               fetch_end / seq->stream(0, 0).layout().page_tokens *
                                   seq->stream(0, 0).layout().page_tokens);
  std::vector<Row> rows = {{"Attend (1 query)", sealed_bytes(tokens)},
                           {absl::StrCat("FetchDequant fp16, ", fetch_end, " tokens"),
                            sealed_bytes(fetch_end)},
                           {absl::StrCat("FetchDequant raw, ", raw_end, " tokens"),
                            sealed_bytes(raw_end)}};
  seq = SequenceStore::Handle();  // The services look it up by id.
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<double> off_s, on_s, off_cpu, on_cpu;
    for (int r = -1; r < reps; ++r) {  // r = -1: warm-up.
      for (Endpoint* e : {&off, &on}) {
        const double c0 = ProcessCpuSeconds();
        const absl::Time t0 = absl::Now();
        absl::Status st;
        if (i == 0) {
          v1::AttendResponse resp;
          st = e->service->DoAttend(attend, &resp);
        } else {
          st = Fetch(*e->stub, i == 2, i == 2 ? raw_end : fetch_end);
        }
        const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
        const double cpu = ProcessCpuSeconds() - c0;
        if (!st.ok()) return st;
        if (r >= 0) {
          (e == &off ? off_s : on_s).push_back(secs);
          (e == &off ? off_cpu : on_cpu).push_back(cpu);
        }
      }
    }
    rows[i].off_s = Median(off_s);
    rows[i].on_s = Median(on_s);
    rows[i].off_cpu_s = Median(off_cpu);
    rows[i].on_cpu_s = Median(on_cpu);
  }
  return rows;
}

}  // namespace

int ChecksumsMain(const std::string& command) {
  const int tokens = absl::GetFlag(FLAGS_tokens) > 0 ? absl::GetFlag(FLAGS_tokens) : 32768;
  const int reps = absl::GetFlag(FLAGS_reps) > 0 ? absl::GetFlag(FLAGS_reps) : 15;
  std::vector<std::string> schemes = absl::GetFlag(FLAGS_schemes);
  if (schemes.empty()) schemes = {"kivi2", "kivi4"};
  std::printf("# %s\n# one layer, %d tokens, %d KV / %d query heads, head_dim %d; medians of %d "
              "alternating calls\n# off: --verify_fraction=0, on: 1; times in ms (wall, and CPU "
              "of the whole process); MiB: sealed page bytes a call verifies; xxh3 ms: those "
              "bytes / XXH3's rate (CPU time)\n# load average before: %s\n",
              command.c_str(), tokens, kKvHeads, kQHeads, kDim, reps, LoadAverage().c_str());
  std::printf("%-7s %-32s %6s | %8s %8s %6s | %8s %8s %6s %8s | %8s\n", "scheme", "read",
              "MiB", "wall off", "wall on", "ratio", "cpu off", "cpu on", "ratio", "cpu +",
              "xxh3 ms");
  for (const std::string& scheme : schemes) {
    SchemeFacts facts;
    absl::StatusOr<std::vector<Row>> rows = RunScheme(scheme, tokens, reps, &facts);
    const double rate = facts.hash_bytes_per_s;
    if (!rows.ok()) {
      std::cerr << "kvq-bench checksums: " << scheme << ": " << rows.status() << "\n";
      return 2;
    }
    for (const Row& r : *rows) {
      std::printf("%-7s %-32s %6.1f | %8.3f %8.3f %6.3f | %8.3f %8.3f %6.3f %8.3f | %8.3f\n",
                  scheme.c_str(), r.what.c_str(), r.verified_bytes / 1048576.0, r.off_s * 1e3,
                  r.on_s * 1e3, r.on_s / r.off_s, r.off_cpu_s * 1e3, r.on_cpu_s * 1e3,
                  r.on_cpu_s / r.off_cpu_s, (r.on_cpu_s - r.off_cpu_s) * 1e3,
                  r.verified_bytes / rate * 1e3);
    }
    std::printf("%-7s XXH3 over these pages: %.2f GB/s; page %zu bytes; checksum words %zu bytes "
                "for %zu pool bytes in use (%.3f%%), %zu pages sealed\n",
                scheme.c_str(), rate / 1e9, facts.page_bytes, facts.pool.checksum_bytes,
                facts.pool.used_bytes, 100.0 * facts.pool.checksum_bytes / facts.pool.used_bytes,
                facts.pool.sealed_blocks);
  }
  std::printf("# load average after: %s\n", LoadAverage().c_str());
  return 0;
}

}  // namespace kvq
