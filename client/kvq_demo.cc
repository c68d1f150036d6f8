// kvq-demo: what kvq buys a decode worker, end to end against a running
// kvq-server. For several schemes it stores a long prompt's KV for a
// SmolLM2-135M-shaped model (30 layers, 3 KV heads, 9 query heads,
// head_dim 64), runs decode steps through a DecodeStream (append one token
// and attend, layer by layer), attends once from a fixed query and fetches
// a layer back, then prints memory saved against fp16, attention error
// against the fp16 cache and latencies.
//
//   kvq-demo --server=localhost:50051 [--tokens=4096] [--steps=16]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "synthetic/synthetic_kv.h"
#include "client/kvq_client.h"
#include "client/parallel_for.h"
#include "client/tls_flags.h"
#include "kernels/build_info.h"
#include "kernels/tensor.h"

ABSL_FLAG(std::string, server, "localhost:50051", "kvq-server address");
ABSL_FLAG(std::string, token, "", "Bearer token of the tenant (a server with --tokens_file)");
ABSL_FLAG(int32_t, tokens, 4096, "Prompt length");
ABSL_FLAG(int32_t, steps, 16, "Decode steps (each appends and attends all 30 layers)");
ABSL_FLAG(std::string, schemes,
          "fp16,int8,kivi4,kivi4:g64:r64:p8:pre_rope:sink=4,kivi4:v3:g32:r32:p8:pre_rope:sink=4,kivi2,"
          "kivi2:pre_rope:outliers=1:sink=4",
          "Comma-separated schemes; the first is the baseline");

namespace kvq {
namespace {

constexpr int kLayers = 30, kKvHeads = 3, kQHeads = 9, kDim = 64;

// The prompt's K/V and the fixed query: the seeded synthetic set of
// docs/KERNELS.md section 2 (synthetic/synthetic_kv.h) for every (layer, KV
// head), so attention has what real caches give each kvq option to work
// on: stable outlier key channels that RoPE swings, outlier tokens,
// heavy-tailed values and an attention sink on the first tokens. (On
// unstructured noise attention is nearly uniform over the context and the
// error column would measure only the noise.) fp16 [layers, kv_heads,
// tokens, head_dim]; keys before RoPE in `k_pre` and after it in `k_post`
// (the layout's default RoPE); `query` [1, q_heads, head_dim] is layer 0's
// decode query at position tokens - 1.
absl::Status MakePrompt(int tokens, HostTensor* k_pre, HostTensor* k_post, HostTensor* v,
                        HostTensor* query) {
  constexpr int kGroup = kQHeads / kKvHeads;
  const std::vector<int64_t> shape = {kLayers, kKvHeads, tokens, kDim};
  *k_pre = HostTensor::Zeros(DType::kFloat16, shape);
  *k_post = HostTensor::Zeros(DType::kFloat16, shape);
  *v = HostTensor::Zeros(DType::kFloat16, shape);
  *query = HostTensor::Zeros(DType::kFloat16, {1, kQHeads, kDim});
  const int per_head = tokens * kDim;  // Elements of one (layer, KV head).
  std::vector<absl::Status> status(kLayers * kKvHeads);
  // Every head on the client's threads: 90 heads of a 4k prompt take about
  // 2 s on one. Each head's floats go straight into its fp16 rows.
  ParallelFor(kLayers * kKvHeads, 0, [&](int i) {
    SyntheticKvConfig config;
    config.head_dim = kDim;
    config.tokens = tokens;
    config.group_size = kGroup;
    config.layer = i / kKvHeads;
    config.kv_head = i % kKvHeads;
    absl::StatusOr<SyntheticKv> kv = GenerateSyntheticKv(config);
    if (!kv.ok()) {
      status[i] = kv.status();
      return;
    }
    const size_t at = static_cast<size_t>(i) * per_head * 2;  // fp16 bytes.
    FloatToRow(kv->keys_pre_rope.data(), per_head, DType::kFloat16, k_pre->mutable_bytes() + at);
    FloatToRow(kv->keys.data(), per_head, DType::kFloat16, k_post->mutable_bytes() + at);
    FloatToRow(kv->values.data(), per_head, DType::kFloat16, v->mutable_bytes() + at);
    if (config.layer == 0) {
      FloatToRow(kv->queries.data(), kGroup * kDim, DType::kFloat16,
                 query->mutable_bytes() + static_cast<size_t>(config.kv_head) * kGroup * kDim * 2);
    }
  });
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

HostTensor Random(std::vector<int64_t> shape, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n;
  size_t count = 1;
  for (int64_t s : shape) count *= static_cast<size_t>(s);
  std::vector<float> x(count);
  for (float& e : x) e = scale * n(rng);
  return *HostTensor::FromFloats(x, std::move(shape), DType::kFloat16);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Row {
  std::string scheme;
  double bits = 0, mib = 0, saved = 0, append_ms = 0, wire_mib = 0, step_ms = 0, fetch_ms = 0;
  double attn_err = 0;
};

int Run() {
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_server);
  options.ns = "demo";
  if (absl::Status s = ApplyTlsFlags(&options); !s.ok()) {
    return std::fprintf(stderr, "kvq-demo: %s\n", std::string(s.message()).c_str()), 1;
  }
  options.token = absl::GetFlag(FLAGS_token);
  absl::StatusOr<std::unique_ptr<KvqClient>> client = KvqClient::Connect(options);
  if (!client.ok()) return std::fprintf(stderr, "%s\n", client.status().ToString().c_str()), 1;
  absl::StatusOr<v1::ServerInfo> info = (*client)->GetServerInfo();
  if (!info.ok()) return std::fprintf(stderr, "kvq-demo: %s\n", info.status().ToString().c_str()), 1;
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const int steps = absl::GetFlag(FLAGS_steps);
  std::printf("kvq-demo: server %s (backend %s); prompt %d tokens, %d decode steps, "
              "SmolLM2-135M layout (%d layers, %d KV heads, head_dim %d)\n",
              options.target.c_str(), info->backend().c_str(), tokens, steps, kLayers, kKvHeads,
              kDim);
  HostTensor k_pre, k_post, v, query;
  if (absl::Status made = MakePrompt(tokens, &k_pre, &k_post, &v, &query); !made.ok()) {
    return std::fprintf(stderr, "kvq-demo: --tokens=%d: %s\n", tokens, made.ToString().c_str()), 1;
  }
  std::vector<float> baseline_out;
  std::vector<Row> rows;

  for (absl::string_view scheme_view : absl::StrSplit(absl::GetFlag(FLAGS_schemes), ',')) {
    const std::string scheme(scheme_view);
    Row row;
    row.scheme = scheme;
    CreateOptions create;
    create.config.layout = {kLayers, kKvHeads, kQHeads, kDim, {}};
    create.config.scheme = scheme;
    absl::StatusOr<SequenceInfo> seq = (*client)->CreateSequence(create);
    if (!seq.ok()) return std::fprintf(stderr, "%s: %s\n", scheme.c_str(), seq.status().ToString().c_str()), 1;
    create.config.scheme = seq->scheme;

    // 1. The prompt: quantized on the client for kivi (the wire carries the
    // quantized pages), dense fp16 otherwise. pre_rope schemes take the
    // keys before RoPE and apply it themselves.
    const HostTensor& k = absl::StrContains(scheme, "pre_rope") ? k_pre : k_post;
    absl::Time t0 = absl::Now();
    absl::StatusOr<AppendResult> appended =
        absl::StrContains(scheme, "kivi")
            ? (*client)->AppendPromptQuantized(seq->sequence_id, create.config, k, v)
            : (*client)->AppendPrompt(seq->sequence_id, k, v);
    if (!appended.ok()) return std::fprintf(stderr, "%s: %s\n", scheme.c_str(), appended.status().ToString().c_str()), 1;
    row.append_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    row.wire_mib = appended->wire_bytes / 1048576.0;

    // 2. Attention from a fixed query over layer 0, compared with fp16.
    AttendQuery q{seq->sequence_id, query, {}, 0, 0};
    absl::StatusOr<std::vector<AttendOutput>> out = (*client)->Attend(0, {&q, 1});
    if (!out.ok()) return std::fprintf(stderr, "%s: %s\n", scheme.c_str(), out.status().ToString().c_str()), 1;
    const std::vector<float> o = (*out)[0].out.ToFloats();
    if (baseline_out.empty()) baseline_out = o;
    double num = 0, den = 0;
    for (size_t i = 0; i < o.size(); ++i) {
      num += (o[i] - baseline_out[i]) * (o[i] - baseline_out[i]);
      den += baseline_out[i] * baseline_out[i];
    }
    row.attn_err = std::sqrt(num / std::max(den, 1e-30));

    // 3. Decode: each step appends one token and attends, layer by layer.
    absl::StatusOr<std::unique_ptr<DecodeSession>> session = (*client)->OpenDecodeSession();
    if (!session.ok()) return 1;
    std::vector<double> step_ms;
    for (int s = 0; s < steps; ++s) {
      const absl::Time start = absl::Now();
      for (int layer = 0; layer < kLayers; ++layer) {
        AppendAttendItem item{seq->sequence_id, Random({kKvHeads, 1, kDim}, 100 + s, 1.0f),
                              Random({kKvHeads, 1, kDim}, 200 + s, 0.5f),
                              Random({1, kQHeads, kDim}, 300 + s, 1.0f)};
        absl::StatusOr<std::vector<AttendOutput>> r = (*session)->Step(layer, {&item, 1});
        if (!r.ok()) return std::fprintf(stderr, "%s: decode: %s\n", scheme.c_str(), r.status().ToString().c_str()), 1;
      }
      step_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    }
    (void)(*session)->Close();
    row.step_ms = Median(step_ms);

    // 4. Fetch one layer back, dequantized to fp16 by the server.
    FetchOptions fetch;
    fetch.layer_end = 1;
    t0 = absl::Now();
    absl::StatusOr<FetchedKv> fetched = (*client)->FetchDequant(seq->sequence_id, fetch);
    if (!fetched.ok()) return std::fprintf(stderr, "%s: %s\n", scheme.c_str(), fetched.status().ToString().c_str()), 1;
    row.fetch_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);

    absl::StatusOr<v1::StatsResponse> stats = (*client)->Stats(seq->sequence_id);
    if (!stats.ok()) return 1;
    row.bits = stats->bits_per_element();
    row.mib = stats->bytes().total() / 1048576.0;
    row.saved = 1.0 - 1.0 / std::max(stats->compression_vs_fp16(), 1e-9);
    rows.push_back(row);
    (void)(*client)->Release(seq->sequence_id);
  }

  std::printf("\n%-36s %7s %9s %7s %10s %9s %12s %9s %10s\n", "scheme", "bits/el", "KV MiB",
              "saved", "append ms", "wire MiB", "step ms(30L)", "fetch ms", "attn err");
  for (const Row& r : rows) {
    std::printf("%-36s %7.2f %9.1f %6.1f%% %10.1f %9.1f %12.2f %9.1f %10.2e\n", r.scheme.c_str(),
                r.bits, r.mib, 100 * r.saved, r.append_ms, r.wire_mib, r.step_ms, r.fetch_ms,
                r.attn_err);
  }
  std::printf("\nbits/el and KV MiB come from the server's allocation (Stats) at %d + %d tokens; "
              "attn err is ||o - o_fp16|| / ||o_fp16|| for layer 0's decode query on the seeded "
              "synthetic KV of docs/KERNELS.md section 2; step ms is the median time of one decode "
              "token through all %d layers (DecodeStream).\n",
              tokens, steps, kLayers);
  return 0;
}

}  // namespace
}  // namespace kvq

int main(int argc, char** argv) {
  if (kvq::PrintVersionIfAsked(argc, argv, "kvq-demo")) return 0;
  absl::SetProgramUsageMessage("kvq-demo --server=host:port: stores a prompt in several schemes and decodes");
  absl::ParseCommandLine(argc, argv);
  return kvq::Run();
}
