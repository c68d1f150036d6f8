// kvq: command-line client of a kvq server.
//
//   kvq [global flags] <command> [command flags]
//   kvq <command> --help
//
// Tensors are .npy files: K and V [layers, kv_heads, tokens, head_dim],
// queries [num_queries, num_q_heads, head_dim]; float32 or float16.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "client/npy.h"
#include "client/progress_bar.h"
#include "client/sharded_client.h"
#include "client/tls_flags.h"
#include "kernels/build_info.h"
#include "kernels/quant_spec.h"
#include "kernels/status_macros.h"

// Global flags.
ABSL_FLAG(std::string, server, "localhost:50051", "kvq server address, host:port.");
ABSL_FLAG(std::string, targets, "",
          "Shard over these replicas instead of --server: host:port,host:port; each --id goes "
          "to its rendezvous winner and create draws an id for one (docs/CLIENTS.md, "
          "\"Sharding across replicas\").");
ABSL_FLAG(std::string, dns, "",
          "Shard over the addresses of this name:port instead of --server (a Kubernetes "
          "headless Service: kvq.<namespace>.svc.cluster.local:50051).");
ABSL_FLAG(std::string, namespace, "", "Tenant namespace of the sequence(s); \"\" is the default.");
ABSL_FLAG(std::string, token, "",
          "Bearer token of the tenant (a server with --tokens_file); prefer --token_file, which "
          "keeps it out of the process list.");
ABSL_FLAG(std::string, token_file, "",
          "File holding the bearer token (surrounding whitespace ignored).");
ABSL_FLAG(int64_t, deadline_ms, 30000, "Deadline of each RPC attempt, in milliseconds (> 0).");
ABSL_FLAG(int32_t, retries, 3,
          "Retries of idempotent calls (info, fetch, attend, stats, release) on UNAVAILABLE or "
          "DEADLINE_EXCEEDED, with exponential backoff.");
ABSL_FLAG(bool, progress, false,
          "Always draw the progress bar of append/fetch on stderr (it is drawn by default only "
          "when stderr is a terminal).");

// Sequence identity.
ABSL_FLAG(std::string, id, "", "Sequence id.");

// create (and the layout that fetch --local and append --quantize need).
ABSL_FLAG(int32_t, layers, 0, "Number of model layers, [1, 1024].");
ABSL_FLAG(int32_t, kv_heads, 0, "KV heads per layer, [1, 256].");
ABSL_FLAG(int32_t, q_heads, 0, "Query heads per layer, a multiple of --kv_heads (0: = kv_heads).");
ABSL_FLAG(int32_t, head_dim, 0, "Channels per head, a multiple of 16 in [16, 256].");
ABSL_FLAG(std::string, scheme, "kivi4:g32:r128:sink=4",
          "Storage scheme, e.g. fp16, int8, kivi4, kivi2:g32:r128:pre_rope:outliers=1:sink=4, "
          "kivi4:v3:g32:r32:p8:pre_rope:sink=4 (4-bit keys, 3-bit values) "
          "(the default is the one docs/QUALITY.md picked).");
ABSL_FLAG(uint32_t, ttl_s, 0, "Idle lease in seconds (0: the server's default).");
ABSL_FLAG(std::string, calibration, "",
          "crq schemes: the name of a calibration the server has loaded (kvq info lists them).");
ABSL_FLAG(double, rope_theta, 10000.0, "RoPE base (pre_rope schemes).");
ABSL_FLAG(int32_t, rope_dim, 0, "Rotated channels (0: head_dim) (pre_rope schemes).");
ABSL_FLAG(std::string, rope_pairing, "half_split",
          "RoPE channel pairing: half_split (HF Llama, vLLM) or adjacent (GGUF).");
ABSL_FLAG(std::string, rope_scaling, "none", "RoPE scaling: none, linear or ntk.");
ABSL_FLAG(double, rope_factor, 1.0, "RoPE scaling factor (>= 1).");

// append
ABSL_FLAG(std::string, k, "", "K as .npy [layers, kv_heads, tokens, head_dim], float32/float16.");
ABSL_FLAG(std::string, v, "", "V as .npy, same shape and dtype as --k.");
ABSL_FLAG(int32_t, layer_begin, 0, "First layer (append: the layer of the file's layer 0).");
ABSL_FLAG(int64_t, chunk_bytes, 1 << 20, "Largest tensor payload per streamed message.");
ABSL_FLAG(bool, quantize, false,
          "Quantize on the client and send raw pages (2-5 bits per element on the wire for "
          "kivi); the sink and fp16 tail go as dense rows.");
ABSL_FLAG(std::string, wire_dtype, "",
          "Dense append: dtype on the wire, float32, float16 or bfloat16 (\"\": the file's).");

// fetch
ABSL_FLAG(std::string, k_out, "", "Where to write K as .npy [layers, kv_heads, tokens, head_dim].");
ABSL_FLAG(std::string, v_out, "", "Where to write V as .npy.");
ABSL_FLAG(int32_t, layer_end, 0, "End of the layer range, exclusive (0: all layers).");
ABSL_FLAG(int32_t, token_begin, 0, "First token.");
ABSL_FLAG(int32_t, token_end, 0, "End of the token range, exclusive (0: all tokens).");
ABSL_FLAG(std::string, dtype, "float16", "Output dtype: float16 or float32.");
ABSL_FLAG(bool, apply_rope, false, "pre_rope schemes: return keys post-RoPE.");
ABSL_FLAG(bool, local, false,
          "Fetch raw pages and dequantize here (needs --layers, --kv_heads, --head_dim and the "
          "rope flags the sequence was created with).");

// attend
ABSL_FLAG(int32_t, layer, 0, "Layer to attend over.");
ABSL_FLAG(std::string, q, "", "Queries as .npy [num_queries, num_q_heads, head_dim], post-RoPE.");
ABSL_FLAG(std::string, q_positions, "",
          "Comma-separated position of each query (causal mask); \"\": every key is visible.");
ABSL_FLAG(int32_t, key_begin, 0, "First key token.");
ABSL_FLAG(int32_t, key_end, 0, "End of the key range, exclusive (0: all stored tokens).");
ABSL_FLAG(double, scale, 0.0, "Softmax scale (0: 1/sqrt(head_dim)).");
ABSL_FLAG(std::string, out, "", "Where to write the output as .npy [num_queries, num_q_heads, head_dim] float32.");
ABSL_FLAG(std::string, lse, "", "Where to write the log-sum-exp as .npy [num_queries, num_q_heads] float32.");

// fork
ABSL_FLAG(std::string, new_id, "", "Id of the fork (\"\": the server picks one).");
ABSL_FLAG(int32_t, tokens, 0, "Prefix length to share (0: all tokens).");

namespace kvq {
namespace {

constexpr int kExitRpc = 1;
constexpr int kExitUsage = 2;

struct Command {
  std::string name;
  std::string summary;
  std::string usage;
  std::vector<std::string> flags;
  std::function<absl::Status()> run;
};

const std::vector<std::string>& GlobalFlags() {
  static const auto* flags =
      new std::vector<std::string>{"server",      "targets",  "dns",    "namespace", "token",
                                   "token_file",  "deadline_ms", "retries", "progress",
                                   "tls_ca",      "tls_cert", "tls_key", "tls_server_name"};
                                   // tls_*: tls_flags.cc.
  return *flags;
}

const std::vector<std::string>& LayoutFlags() {
  static const auto* flags = new std::vector<std::string>{
      "layers", "kv_heads", "q_heads", "head_dim", "rope_theta", "rope_dim", "rope_pairing",
      "rope_scaling", "rope_factor"};
  return *flags;
}

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

absl::Status UsageError(absl::string_view message) {
  return absl::InvalidArgumentError(message);
}

absl::StatusOr<ClientOptions> ClientOptionsFromFlags() {
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_server);
  options.ns = absl::GetFlag(FLAGS_namespace);
  options.token = absl::GetFlag(FLAGS_token);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    if (!options.token.empty()) return UsageError("give --token or --token_file, not both");
    std::ifstream in(path);
    if (!in) return UsageError(absl::StrCat("--token_file=", path, ": cannot be read"));
    std::ostringstream text;
    text << in.rdbuf();
    options.token = std::string(absl::StripAsciiWhitespace(text.str()));
    if (options.token.empty()) return UsageError(absl::StrCat("--token_file=", path, " is empty"));
  }
  const int64_t deadline_ms = absl::GetFlag(FLAGS_deadline_ms);
  if (deadline_ms <= 0) return UsageError("--deadline_ms must be > 0");
  options.deadline = absl::Milliseconds(deadline_ms);
  const int retries = absl::GetFlag(FLAGS_retries);
  if (retries < 0) return UsageError("--retries must be >= 0");
  options.retry.max_attempts = retries + 1;
  if (absl::Status s = ApplyTlsFlags(&options); !s.ok()) return UsageError(s.message());
  return options;
}

// --targets or --dns: the calls go through a ShardedKvqClient.
bool Sharded() { return !absl::GetFlag(FLAGS_targets).empty() || !absl::GetFlag(FLAGS_dns).empty(); }

absl::StatusOr<std::unique_ptr<ShardedKvqClient>> MakeShardedClient() {
  const std::string targets = absl::GetFlag(FLAGS_targets), dns = absl::GetFlag(FLAGS_dns);
  if (!targets.empty() && !dns.empty()) return UsageError("give --targets or --dns, not both");
  ShardOptions options;
  KVQ_ASSIGN_OR_RETURN(options.client, ClientOptionsFromFlags());
  return ShardedKvqClient::Connect(targets.empty() ? "dns:" + dns : targets, options);
}

// The client of --server, or with sharding that of `id`'s replica.
absl::StatusOr<std::shared_ptr<KvqClient>> MakeClient(absl::string_view id = "") {
  if (Sharded()) {
    KVQ_ASSIGN_OR_RETURN(std::unique_ptr<ShardedKvqClient> sharded, MakeShardedClient());
    return sharded->ClientFor(id);
  }
  KVQ_ASSIGN_OR_RETURN(const ClientOptions options, ClientOptionsFromFlags());
  return KvqClient::Connect(options);
}

bool ProgressWanted() { return absl::GetFlag(FLAGS_progress) || isatty(STDERR_FILENO) == 1; }

absl::Status RequireFlag(absl::string_view name, const std::string& value) {
  if (value.empty()) return UsageError(absl::StrCat("--", name, " is required"));
  return absl::OkStatus();
}

absl::StatusOr<DType> OutputDType(const std::string& name) {
  if (name == "float16" || name == "fp16") return DType::kFloat16;
  if (name == "float32" || name == "fp32") return DType::kFloat32;
  return UsageError(absl::StrCat("--dtype must be float16 or float32, got '", name, "'"));
}

absl::StatusOr<RopeConfig> RopeFromFlags() {
  RopeConfig r;
  r.theta = static_cast<float>(absl::GetFlag(FLAGS_rope_theta));
  r.rotary_dim = absl::GetFlag(FLAGS_rope_dim);
  const std::string pairing = absl::GetFlag(FLAGS_rope_pairing);
  if (pairing == "half_split") {
    r.pairing = RopeConfig::Pairing::kHalfSplit;
  } else if (pairing == "adjacent") {
    r.pairing = RopeConfig::Pairing::kAdjacent;
  } else {
    return UsageError(absl::StrCat("--rope_pairing must be half_split or adjacent, got '",
                                   pairing, "'"));
  }
  const std::string scaling = absl::GetFlag(FLAGS_rope_scaling);
  if (scaling == "none") {
    r.scaling = RopeConfig::Scaling::kNone;
  } else if (scaling == "linear") {
    r.scaling = RopeConfig::Scaling::kLinear;
  } else if (scaling == "ntk") {
    r.scaling = RopeConfig::Scaling::kNtk;
  } else {
    return UsageError(
        absl::StrCat("--rope_scaling must be none, linear or ntk, got '", scaling, "'"));
  }
  r.factor = static_cast<float>(absl::GetFlag(FLAGS_rope_factor));
  return r;
}

absl::StatusOr<ModelLayout> LayoutFromFlags() {
  ModelLayout m;
  m.num_layers = absl::GetFlag(FLAGS_layers);
  m.num_kv_heads = absl::GetFlag(FLAGS_kv_heads);
  m.num_q_heads = absl::GetFlag(FLAGS_q_heads);
  if (m.num_q_heads == 0) m.num_q_heads = m.num_kv_heads;
  m.head_dim = absl::GetFlag(FLAGS_head_dim);
  if (m.num_layers <= 0 || m.num_kv_heads <= 0 || m.head_dim <= 0) {
    return UsageError("--layers, --kv_heads and --head_dim are required (> 0)");
  }
  KVQ_ASSIGN_OR_RETURN(m.rope, RopeFromFlags());
  return m;
}

std::string DTypeList(const google::protobuf::RepeatedField<int>& dtypes) {
  std::vector<std::string> names;
  for (int d : dtypes) names.push_back(v1::DType_Name(static_cast<v1::DType>(d)));
  return absl::StrJoin(names, ", ");
}

// ---------------------------------------------------------------- commands

absl::Status RunInfo() {
  KVQ_ASSIGN_OR_RETURN(auto client, MakeClient());
  KVQ_ASSIGN_OR_RETURN(const v1::ServerInfo info, client->GetServerInfo());
  absl::PrintF("version: %s\nbackend: %s\n", info.version(), info.backend());
  absl::PrintF("schemes: %s\n", absl::StrJoin(info.schemes(), ", "));
  absl::PrintF("scheme_options: %s\n", absl::StrJoin(info.scheme_options(), ", "));
  absl::PrintF("input_dtypes: %s\n", DTypeList(info.input_dtypes()));
  absl::PrintF("output_dtypes: %s\n", DTypeList(info.output_dtypes()));
  absl::PrintF("capacity_bytes: %d\nmax_message_bytes: %d\nmax_tokens_per_sequence: %d\n",
               info.capacity_bytes(), info.max_message_bytes(), info.max_tokens_per_sequence());
  absl::PrintF("calibrations: %s\n", absl::StrJoin(info.calibrations(), ", "));
  return absl::OkStatus();
}

absl::Status RunCreate() {
  CreateOptions options;
  KVQ_ASSIGN_OR_RETURN(options.config.layout, LayoutFromFlags());
  options.config.scheme = absl::GetFlag(FLAGS_scheme);
  options.config.calibration = absl::GetFlag(FLAGS_calibration);
  options.sequence_id = absl::GetFlag(FLAGS_id);
  options.ttl_seconds = absl::GetFlag(FLAGS_ttl_s);
  KVQ_ASSIGN_OR_RETURN(const QuantSpec spec, QuantSpec::Parse(options.config.scheme));
  if (spec.nuq) {
    return UsageError("nuq schemes need codebooks, which the CLI cannot send; use the C++ or "
                      "Python client");
  }
  absl::StatusOr<SequenceInfo> created;
  if (Sharded()) {  // The sharded client draws the id (or places the given one).
    KVQ_ASSIGN_OR_RETURN(auto sharded, MakeShardedClient());
    created = sharded->CreateSequence(options);
  } else {
    KVQ_ASSIGN_OR_RETURN(auto client, MakeClient());
    created = client->CreateSequence(options);
  }
  KVQ_ASSIGN_OR_RETURN(const SequenceInfo seq, std::move(created));
  absl::PrintF("sequence_id: %s\nscheme: %s\nnum_tokens: %d\nblock_tokens: %d\n",
               seq.sequence_id, seq.scheme, seq.num_tokens, seq.block_tokens);
  return absl::OkStatus();
}

absl::Status RunAppend() {
  const std::string id = absl::GetFlag(FLAGS_id);
  KVQ_RETURN_IF_ERROR(RequireFlag("id", id));
  KVQ_RETURN_IF_ERROR(RequireFlag("k", absl::GetFlag(FLAGS_k)));
  KVQ_RETURN_IF_ERROR(RequireFlag("v", absl::GetFlag(FLAGS_v)));
  KVQ_ASSIGN_OR_RETURN(HostTensor k, ReadNpy(absl::GetFlag(FLAGS_k)));
  KVQ_ASSIGN_OR_RETURN(HostTensor v, ReadNpy(absl::GetFlag(FLAGS_v)));
  if (k.dtype != v.dtype) {  // One dtype on the wire: widen the fp16 one.
    k = k.Cast(DType::kFloat32);
    v = v.Cast(DType::kFloat32);
  }
  if (k.rank() != 4 || k.shape != v.shape) {
    return UsageError(absl::StrCat("--k and --v must both be [layers, kv_heads, tokens, "
                                   "head_dim], got ", k.DebugString(), " and ",
                                   v.DebugString()));
  }
  KVQ_ASSIGN_OR_RETURN(auto client, MakeClient(id));
  AppendOptions options;
  options.max_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  if (options.max_chunk_bytes <= 0) return UsageError("--chunk_bytes must be > 0");
  options.layer_begin = absl::GetFlag(FLAGS_layer_begin);
  const std::string wire = absl::GetFlag(FLAGS_wire_dtype);
  if (!wire.empty()) {
    KVQ_ASSIGN_OR_RETURN(options.wire_dtype, ParseDType(wire));
  }
  ProgressBar bar("append", ProgressWanted(), absl::GetFlag(FLAGS_progress));
  options.progress = [&bar](int64_t done, int64_t total) { bar.Update(done, total); };
  const absl::Time start = absl::Now();
  absl::StatusOr<AppendResult> result;
  if (absl::GetFlag(FLAGS_quantize)) {
    // The sequence's canonical scheme and its length come from the server,
    // the rest of the layout from the files; pages do not depend on RoPE, so
    // the default RoPE serves.
    KVQ_ASSIGN_OR_RETURN(const v1::StatsResponse stats, client->Stats(id));
    SequenceConfig config;
    config.scheme = stats.scheme();
    config.layout.num_layers = options.layer_begin + static_cast<int>(k.shape[0]);
    config.layout.num_kv_heads = static_cast<int>(k.shape[1]);
    config.layout.num_q_heads = config.layout.num_kv_heads;
    config.layout.head_dim = static_cast<int>(k.shape[3]);
    KVQ_ASSIGN_OR_RETURN(const QuantSpec spec, QuantSpec::Parse(config.scheme));
    if (spec.nuq) return UsageError("--quantize does not support nuq schemes (no codebooks)");
    options.start_tokens = stats.num_tokens();
    result = client->AppendPromptQuantized(id, config, k, v, options);
  } else {
    result = client->AppendPrompt(id, k, v, options);
  }
  bar.Finish();
  KVQ_RETURN_IF_ERROR(result.status());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  absl::PrintF("num_tokens: %d\nbytes_stored: %d\nwire_bytes: %d\nchunks: %d\nseconds: %.3f\n",
               result->num_tokens, result->bytes_stored, result->wire_bytes, result->chunks,
               seconds);
  return absl::OkStatus();
}

absl::Status RunFetch() {
  const std::string id = absl::GetFlag(FLAGS_id);
  KVQ_RETURN_IF_ERROR(RequireFlag("id", id));
  const std::string k_out = absl::GetFlag(FLAGS_k_out), v_out = absl::GetFlag(FLAGS_v_out);
  if (k_out.empty() && v_out.empty()) return UsageError("give --k_out and/or --v_out");
  FetchOptions options;
  options.layer_begin = absl::GetFlag(FLAGS_layer_begin);
  options.layer_end = absl::GetFlag(FLAGS_layer_end);
  options.token_begin = absl::GetFlag(FLAGS_token_begin);
  options.token_end = absl::GetFlag(FLAGS_token_end);
  KVQ_ASSIGN_OR_RETURN(options.dtype, OutputDType(absl::GetFlag(FLAGS_dtype)));
  options.apply_rope = absl::GetFlag(FLAGS_apply_rope);
  const int64_t chunk = absl::GetFlag(FLAGS_chunk_bytes);
  if (chunk <= 0 || chunk > (int64_t{1} << 30)) return UsageError("--chunk_bytes must be in (0, 1 GiB]");
  options.max_chunk_bytes = static_cast<int>(chunk);
  KVQ_ASSIGN_OR_RETURN(auto client, MakeClient(id));
  ProgressBar bar("fetch", ProgressWanted(), absl::GetFlag(FLAGS_progress));
  options.progress = [&bar](int64_t done, int64_t total) { bar.Update(done, total); };
  absl::StatusOr<FetchedKv> kv;
  if (absl::GetFlag(FLAGS_local)) {
    KVQ_ASSIGN_OR_RETURN(const v1::StatsResponse stats, client->Stats(id));
    SequenceConfig config;
    config.scheme = stats.scheme();
    KVQ_ASSIGN_OR_RETURN(config.layout, LayoutFromFlags());
    kv = client->FetchDequantLocal(id, config, options);
  } else {
    kv = client->FetchDequant(id, options);
  }
  bar.Finish();
  KVQ_RETURN_IF_ERROR(kv.status());
  if (!k_out.empty()) KVQ_RETURN_IF_ERROR(WriteNpy(k_out, kv->k));
  if (!v_out.empty()) KVQ_RETURN_IF_ERROR(WriteNpy(v_out, kv->v));
  absl::PrintF("layer_begin: %d\ntoken_begin: %d\nshape: %s\n", kv->layer_begin, kv->token_begin,
               kv->k.DebugString());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ParsePositions(const std::string& text) {
  std::vector<int32_t> out;
  if (text.empty()) return out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t p;
    if (!absl::SimpleAtoi(part, &p)) {
      return UsageError(absl::StrCat("--q_positions: '", part, "' is not an integer"));
    }
    out.push_back(p);
  }
  return out;
}

absl::Status RunAttend() {
  AttendQuery query;
  query.sequence_id = absl::GetFlag(FLAGS_id);
  KVQ_RETURN_IF_ERROR(RequireFlag("id", query.sequence_id));
  KVQ_RETURN_IF_ERROR(RequireFlag("q", absl::GetFlag(FLAGS_q)));
  KVQ_ASSIGN_OR_RETURN(query.q, ReadNpy(absl::GetFlag(FLAGS_q)));
  KVQ_ASSIGN_OR_RETURN(query.q_positions, ParsePositions(absl::GetFlag(FLAGS_q_positions)));
  query.key_begin = absl::GetFlag(FLAGS_key_begin);
  query.key_end = absl::GetFlag(FLAGS_key_end);
  KVQ_ASSIGN_OR_RETURN(auto client, MakeClient(query.sequence_id));
  KVQ_ASSIGN_OR_RETURN(std::vector<AttendOutput> results,
                       client->Attend(absl::GetFlag(FLAGS_layer), {query},
                                      static_cast<float>(absl::GetFlag(FLAGS_scale))));
  if (results.size() != 1) {
    return absl::InternalError(absl::StrCat("server returned ", results.size(), " results for 1 query"));
  }
  const std::string out = absl::GetFlag(FLAGS_out), lse = absl::GetFlag(FLAGS_lse);
  if (!out.empty()) KVQ_RETURN_IF_ERROR(WriteNpy(out, results[0].out));
  if (!lse.empty()) KVQ_RETURN_IF_ERROR(WriteNpy(lse, results[0].lse));
  absl::PrintF("out: %s\nlse: %s\n", results[0].out.DebugString(), results[0].lse.DebugString());
  if (out.empty() && lse.empty()) {
    absl::PrintF("lse values: %s\n", absl::StrJoin(results[0].lse.ToFloats(), " "));
  }
  return absl::OkStatus();
}

void PrintStats(const v1::StatsResponse& s, bool per_sequence) {
  absl::PrintF("capacity_bytes: %d\nused_bytes: %d\npages_total: %d\npages_used: %d\n"
               "sequences: %d\n",
               s.capacity_bytes(), s.used_bytes(), s.pages_total(), s.pages_used(), s.sequences());
  if (per_sequence) absl::PrintF("num_tokens: %d\nscheme: %s\n", s.num_tokens(), s.scheme());
  const v1::ByteBreakdown& b = s.bytes();
  absl::PrintF("bytes: codes=%d scales=%d outliers=%d residual=%d sink=%d codebook=%d "
               "padding=%d total=%d\n",
               b.codes(), b.scales(), b.outliers(), b.residual(), b.sink(), b.codebook(),
               b.padding(), b.total());
  absl::PrintF("bits_per_element: %.3f\ncompression_vs_fp16: %.3f\n", s.bits_per_element(),
               s.compression_vs_fp16());
}

absl::Status RunStats() {
  const std::string id = absl::GetFlag(FLAGS_id);
  if (Sharded() && id.empty()) {  // Server-wide: each replica's, the first failure returned.
    KVQ_ASSIGN_OR_RETURN(auto sharded, MakeShardedClient());
    absl::Status first_error;
    for (const ReplicaStats& r : sharded->StatsAll()) {
      absl::PrintF("replica: %s\n", r.replica);
      if (r.stats.ok()) {
        PrintStats(*r.stats, false);
      } else {
        absl::PrintF("error: %s\n", r.stats.status().ToString());
        if (first_error.ok()) first_error = r.stats.status();
      }
    }
    return first_error;
  }
  KVQ_ASSIGN_OR_RETURN(auto client, MakeClient(id));
  KVQ_ASSIGN_OR_RETURN(const v1::StatsResponse s, client->Stats(id));
  PrintStats(s, !id.empty());
  return absl::OkStatus();
}

absl::Status RunRelease() {
  const std::string id = absl::GetFlag(FLAGS_id);
  KVQ_RETURN_IF_ERROR(RequireFlag("id", id));
  KVQ_ASSIGN_OR_RETURN(auto client, MakeClient(id));
  KVQ_ASSIGN_OR_RETURN(const int64_t freed, client->Release(id));
  absl::PrintF("bytes_freed: %d\n", freed);
  return absl::OkStatus();
}

absl::Status RunFork() {
  const std::string id = absl::GetFlag(FLAGS_id);
  KVQ_RETURN_IF_ERROR(RequireFlag("id", id));
  ForkOptions options;
  options.new_sequence_id = absl::GetFlag(FLAGS_new_id);
  options.num_tokens = absl::GetFlag(FLAGS_tokens);
  options.ttl_seconds = absl::GetFlag(FLAGS_ttl_s);
  absl::StatusOr<ForkResult> forked;
  if (Sharded()) {  // The fork's id must win the source's replica.
    KVQ_ASSIGN_OR_RETURN(auto sharded, MakeShardedClient());
    forked = sharded->Fork(id, options);
  } else {
    KVQ_ASSIGN_OR_RETURN(auto client, MakeClient());
    forked = client->Fork(id, options);
  }
  KVQ_ASSIGN_OR_RETURN(const ForkResult fork, std::move(forked));
  absl::PrintF("sequence_id: %s\nnum_tokens: %d\n", fork.sequence_id, fork.num_tokens);
  return absl::OkStatus();
}

const std::vector<Command>& Commands() {
  static const auto* commands = new std::vector<Command>{
      {"info", "Show what the server supports (schemes, dtypes, capacity, limits).",
       "kvq info", {}, RunInfo},
      {"create", "Create a sequence for a model layout and storage scheme; prints its id.",
       "kvq create --layers=32 --kv_heads=8 --q_heads=32 --head_dim=128 "
       "--scheme=kivi4:g32:r128:sink=4 [--id=ID]",
       Concat({"id", "scheme", "calibration", "ttl_s"}, LayoutFlags()), RunCreate},
      {"append", "Append a prompt's K/V from .npy files (streamed in chunks).",
       "kvq append --id=ID --k=k.npy --v=v.npy [--quantize]",
       {"id", "k", "v", "layer_begin", "chunk_bytes", "quantize", "wire_dtype"}, RunAppend},
      {"fetch", "Fetch dequantized K/V into .npy files [layers, kv_heads, tokens, head_dim].",
       "kvq fetch --id=ID --k_out=k.npy --v_out=v.npy [--dtype=float32]",
       Concat({"id", "k_out", "v_out", "layer_begin", "layer_end", "token_begin", "token_end",
               "dtype", "apply_rope", "chunk_bytes", "local"},
              LayoutFlags()),
       RunFetch},
      {"attend", "Attention of queries (.npy) over one layer of a sequence; writes out/lse.",
       "kvq attend --id=ID --layer=0 --q=q.npy --out=out.npy --lse=lse.npy",
       {"id", "layer", "q", "q_positions", "key_begin", "key_end", "scale", "out", "lse"},
       RunAttend},
      {"stats", "Byte accounting of one sequence (--id) or of the whole server.",
       "kvq stats [--id=ID]", {"id"}, RunStats},
      {"release", "Release a sequence and free its pages.", "kvq release --id=ID", {"id"},
       RunRelease},
      {"fork", "Fork a sequence, sharing a prefix of its pages.",
       "kvq fork --id=ID [--new_id=ID2] [--tokens=N]", {"id", "new_id", "tokens", "ttl_s"},
       RunFork},
  };
  return *commands;
}

const Command* FindCommand(absl::string_view name) {
  for (const Command& c : Commands()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

void PrintFlag(const std::string& name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if (flag == nullptr) return;
  absl::PrintF("  --%s (default: %s)\n      %s\n", name,
               flag->DefaultValue().empty() ? "\"\"" : flag->DefaultValue(), flag->Help());
}

void PrintMainHelp() {
  absl::PrintF("kvq: command-line client of a kvq server.\n\n"
               "Usage: kvq [global flags] <command> [flags]\n"
               "       kvq <command> --help\n\nCommands:\n");
  for (const Command& c : Commands()) absl::PrintF("  %-8s %s\n", c.name, c.summary);
  absl::PrintF("\nGlobal flags:\n");
  for (const std::string& f : GlobalFlags()) PrintFlag(f);
}

void PrintCommandHelp(const Command& c) {
  absl::PrintF("kvq %s: %s\n\nUsage: %s\n", c.name, c.summary, c.usage);
  if (!c.flags.empty()) {
    absl::PrintF("\nFlags:\n");
    for (const std::string& f : c.flags) PrintFlag(f);
  }
  absl::PrintF("\nGlobal flags:\n");
  for (const std::string& f : GlobalFlags()) PrintFlag(f);
}

// The flag name of a "--name=value" / "--name" / "-name" argument.
std::string FlagName(absl::string_view arg) {
  while (!arg.empty() && arg.front() == '-') arg.remove_prefix(1);
  return std::string(arg.substr(0, arg.find('=')));
}

int Main(int argc, char** argv) {
  if (PrintVersionIfAsked(argc, argv, "kvq")) return 0;
  absl::SetProgramUsageMessage("kvq <command> [flags]; kvq --help lists the commands");
  // Find the command and handle --help ourselves (per command), before absl
  // sees the flags.
  const Command* command = nullptr;
  bool help = false;
  std::vector<std::string> flags_given;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg == "--help" || arg == "-h" || arg == "-help" || arg == "--helpfull") {
      help = true;
    } else if (absl::StartsWith(arg, "-")) {
      flags_given.push_back(FlagName(arg));
    } else if (command == nullptr) {
      command = FindCommand(arg);
      if (command == nullptr && arg != "help") {
        absl::FPrintF(stderr, "kvq: unknown command '%s' (kvq --help lists them)\n", arg);
        return kExitUsage;
      }
      if (arg == "help") help = true;
    }
  }
  if (help || command == nullptr) {
    if (command != nullptr) {
      PrintCommandHelp(*command);
    } else {
      PrintMainHelp();
    }
    return help ? 0 : kExitUsage;
  }
  for (const std::string& f : flags_given) {
    const bool global = absl::c_linear_search(GlobalFlags(), f);
    const bool own = absl::c_linear_search(command->flags, f);
    // Boolean flags may be negated as --noname.
    const bool negated = absl::StartsWith(f, "no") &&
                         (absl::c_linear_search(command->flags, f.substr(2)) ||
                          absl::c_linear_search(GlobalFlags(), f.substr(2)));
    if (!global && !own && !negated) {
      absl::FPrintF(stderr, "kvq %s: --%s does not apply to this command (kvq %s --help)\n",
                    command->name, f, command->name);
      return kExitUsage;
    }
  }
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() != 2) {
    absl::FPrintF(stderr, "kvq %s: unexpected arguments after the command\n", command->name);
    return kExitUsage;
  }
  const absl::Status st = command->run();
  if (!st.ok()) {
    absl::FPrintF(stderr, "kvq %s: %s\n", command->name, st.ToString());
    return st.code() == absl::StatusCode::kInvalidArgument &&
                   absl::StrContains(st.message(), "--")
               ? kExitUsage
               : kExitRpc;
  }
  return 0;
}

}  // namespace
}  // namespace kvq

int main(int argc, char** argv) { return kvq::Main(argc, argv); }
