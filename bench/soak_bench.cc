// `kvq-bench soak`: the load, the sampler and the end-of-run check
// (bench/soak_bench.h).
//
// Which error codes are expected: none. The soak measures the steady state
// of a server that is busy, not one that is out of memory, so it bounds what
// its clients can hold at once and runs the server it starts with a pool
// about ten times that: each prefill client holds one sequence and its fork
// (at most kMaxPrompt tokens, copy-on-write), each decode client one
// sequence (at most kMaxPrompt + kMaxSteps tokens), and the hand-over queue
// at most 2 * decode_clients sequences. With the default 2 + 2 clients that
// is 10 sequences of at most 1088 tokens, under 23 MiB even in fp16 (4
// layers x 2 KV heads x 64 dims x 2 bytes x 2 for K and V per token), plus
// at most a partly filled page per stream and slab, against a 256 MiB pool.
// Every sequence is used by one client at a time, so NOT_FOUND cannot come
// from a race between clients either. A full pool (RESOURCE_EXHAUSTED),
// eviction and concurrent misuse are the fault tests' subject
// (tests/integration/fault_test.cc). Every failed call is counted under its
// code; WRONG_DATA and WRONG_SHAPE count a reply that succeeded with content
// the soak can tell is wrong.
#include "bench/soak_bench.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bench/bench_kvq_server.h"
#include "bench/child_process.h"
#include "client/kvq_client.h"
#include "kernels/status_macros.h"

namespace kvq {
namespace {

constexpr char kNamespace[] = "soak";
constexpr int kLayers = 4, kKvHeads = 2, kQHeads = 8, kHeadDim = 64;
constexpr int kMinPrompt = 64, kMaxPrompt = 1024;
// A quarter of the prompts start with the same "system prompt" token ids,
// so CreateSequence can reuse the stored prefix of a live sequence.
constexpr int kSharedPrefix = 256;
constexpr int kMinSteps = 16, kMaxSteps = 64;
constexpr int kStepVariants = 8;  // Pre-generated decode-step tensors per client.
constexpr int kMaxExamples = 5;

const std::vector<std::string>& Schemes() {
  static const std::vector<std::string> schemes = {"fp16",
                                                   "int8",
                                                   "fp8_e4m3",
                                                   "kivi4:g32:r128:sink=4",
                                                   "kivi2:g32:r128",
                                                   "kivi4:v2:g64:r64:p8",
                                                   "kivi2:g32:r128:pre_rope:outliers=1:sink=4"};
  return schemes;
}

enum Op {
  kCreate,
  kAppendQuantized,
  kAppendDense,
  kFetchDequant,
  kFetchDequantLocal,
  kFork,
  kRelease,
  kStatsSequence,
  kDecodeStreamStep,
  kDecodeStreamPackedStep,
  kAppendAttend,
  kAppendAttendPacked,
  kAttend,
  kAttendPacked,
  kStatsServer,
  kNumOps
};

const char* OpName(int op) {
  static constexpr std::array<const char*, kNumOps> names = {"CreateSequence",
                                                             "Append (quantized)",
                                                             "Append (dense)",
                                                             "FetchDequant (1 layer)",
                                                             "FetchDequantLocal",
                                                             "Fork",
                                                             "Release",
                                                             "Stats (sequence)",
                                                             "DecodeStream step",
                                                             "DecodeStream packed",
                                                             "AppendAttend",
                                                             "AppendAttend packed",
                                                             "Attend",
                                                             "Attend packed",
                                                             "Stats (server)"};
  return names[op];
}

[[maybe_unused]] const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

using Clock = std::chrono::steady_clock;

// What one client thread saw; merged after the run.
struct Recorder {
  std::array<std::vector<float>, kNumOps> ms;
  std::map<std::string, int64_t> errors;
  std::vector<std::string> examples;
  int64_t created = 0, prefix_hits = 0, prefix_tokens = 0, forks = 0, decode_tokens = 0,
          handed_over = 0;
};

// A live sequence a prefill client hands to the decode clients.
struct Live {
  std::string id;
  SequenceConfig config;
  int tokens = 0;
};

// Bounded: a prefill client releases its sequence itself when it is full.
class Handover {
 public:
  explicit Handover(size_t capacity) : capacity_(capacity) {}
  bool Offer(Live live) {
    absl::MutexLock lock(&mu_);
    if (queue_.size() >= capacity_) return false;
    queue_.push_back(std::move(live));
    return true;
  }
  std::optional<Live> Take(absl::Duration wait) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(this, &Handover::NotEmpty), wait);
    if (queue_.empty()) return std::nullopt;
    Live live = std::move(queue_.front());
    queue_.pop_front();
    return live;
  }
  std::deque<Live> Drain() {
    absl::MutexLock lock(&mu_);
    return std::exchange(queue_, {});
  }

 private:
  bool NotEmpty() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty(); }

  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<Live> queue_ ABSL_GUARDED_BY(mu_);
};

// Tokens [begin, end) of a [layers, heads, tokens, dim] tensor.
HostTensor SliceTokens(const HostTensor& t, int begin, int end) {
  const int64_t layers = t.shape[0], heads = t.shape[1], tokens = t.shape[2], dim = t.shape[3];
  const size_t row = dim * DTypeBytes(t.dtype);
  HostTensor out;
  out.dtype = t.dtype;
  out.shape = {layers, heads, end - begin, dim};
  out.data.resize(layers * heads * (end - begin) * row);
  for (int64_t lh = 0; lh < layers * heads; ++lh) {
    std::memcpy(out.data.data() + lh * (end - begin) * row,
                t.data.data() + (lh * tokens + begin) * row, (end - begin) * row);
  }
  return out;
}

HostTensor RandomTensor(std::vector<int64_t> shape, DType dtype, std::mt19937* rng) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) x = dist(*rng);
  return *HostTensor::FromFloats(values, std::move(shape), dtype);
}

bool AllFinite(const HostTensor& t) {
  for (float x : t.ToFloats()) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// VmRSS of /proc/<pid>/status in bytes; -1 when unreadable.
int64_t ReadRss(const std::string& pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmRSS:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    int64_t kb = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kb)) return kb * 1024;
  }
  return -1;
}

class Soak {
 public:
  Soak(const SoakOptions& options, std::ostream* progress)
      : options_(options),
        progress_(progress),
        handover_(2 * static_cast<size_t>(std::max(options.decode_clients, 1))) {}

  absl::StatusOr<SoakResult> Run();

 private:
  absl::Status StartServer();
  // Runs `call`, records its latency under `op` when it succeeds and its
  // code (and an example) when it fails; returns what it returned.
  template <typename F>
  auto Timed(Recorder* r, Op op, F call) -> decltype(call()) {
    const Clock::time_point t0 = Clock::now();
    auto result = call();
    const float ms = std::chrono::duration<float, std::milli>(Clock::now() - t0).count();
    calls_.fetch_add(1, std::memory_order_relaxed);
    const absl::Status& st = StatusOf(result);
    if (st.ok()) {
      r->ms[op].push_back(ms);
    } else {
      Fail(r, op, absl::StatusCodeToString(st.code()), std::string(st.message()));
    }
    return result;
  }
  void Fail(Recorder* r, Op op, const std::string& code, const std::string& message);
  bool Stopping() const { return stop_.load(std::memory_order_relaxed); }
  void PrefillClient(int index, Recorder* r);
  void DecodeClient(int index, Recorder* r);
  void DecodeOne(const Live& live, int serial, std::mt19937* rng, Recorder* r);
  SoakSample Sample(double t_s, Recorder* r);
  CallOptions Call() const { return {.deadline = options_.call_deadline}; }

  const SoakOptions options_;
  std::ostream* progress_;
  SoakResult result_;
  std::unique_ptr<ScratchDir> dir_;
  std::unique_ptr<ChildProcess> server_;
  std::unique_ptr<KvqClient> client_;  // Shared by every thread (thread-safe).
  Handover handover_;
  HostTensor prompt_k_, prompt_v_;  // fp16 [layers, kv_heads, kMaxPrompt, head_dim].
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> failed_{0};
};

void Soak::Fail(Recorder* r, Op op, const std::string& code, const std::string& message) {
  ++r->errors[code];
  failed_.fetch_add(1, std::memory_order_relaxed);
  if (r->examples.size() < kMaxExamples) {
    r->examples.push_back(absl::StrCat(OpName(op), ": ", code, ": ", message.substr(0, 300)));
  }
}

absl::Status Soak::StartServer() {
  KVQ_ASSIGN_OR_RETURN(dir_, ScratchDir::Create("kvq-bench-soak-"));
  KVQ_ASSIGN_OR_RETURN(
      StartedKvqServer started,
      StartKvqServer(options_.kvq_server_path, "--target", options_.capacity_bytes, *dir_));
  server_ = std::move(started.process);
  result_.target = absl::StrCat("127.0.0.1:", started.port);
  result_.started_server = true;
  return absl::OkStatus();
}

void Soak::PrefillClient(int index, Recorder* r) {
  std::mt19937 rng(options_.seed * 7919u + index);
  const std::vector<std::string>& schemes = Schemes();
  for (int64_t iter = 0; !Stopping(); ++iter) {
    SequenceConfig config;
    config.layout = {kLayers, kKvHeads, kQHeads, kHeadDim, {}};
    config.scheme = schemes[(index + iter) % schemes.size()];
    const bool shared_prefix = iter % 4 == 1;
    const int tokens = std::uniform_int_distribution<int>(
        shared_prefix ? kSharedPrefix + kMinPrompt : kMinPrompt, kMaxPrompt)(rng);
    std::vector<int32_t> ids;
    if (shared_prefix) {
      for (int t = 0; t < tokens; ++t) {
        ids.push_back(
            t < kSharedPrefix ? t : std::uniform_int_distribution<int32_t>(1000, 1 << 30)(rng));
      }
    }
    CreateOptions create;
    create.config = config;
    // A lease long enough for any pause of a loaded machine, short enough
    // that a killed soak's sequences leave a server it did not start.
    create.ttl_seconds = 300;
    create.prompt_token_ids = ids;
    create.call = Call();
    absl::StatusOr<SequenceInfo> info =
        Timed(r, kCreate, [&] { return client_->CreateSequence(create); });
    if (!info.ok()) continue;
    ++r->created;
    const std::string id = info->sequence_id;
    config.scheme = info->scheme;
    const int start = info->num_tokens;
    if (start > 0) {
      ++r->prefix_hits;
      r->prefix_tokens += start;
    }
    auto release = [&](const std::string& which) {
      (void)Timed(r, kRelease, [&] { return client_->Release(which, Call()); });
    };

    AppendOptions append;
    append.max_chunk_bytes = 256 << 10;
    append.start_tokens = start;
    append.block_tokens = info->block_tokens;
    append.quantize_threads = 1;
    // No token_ids: CreateSequence's prompt_token_ids already named every
    // token, and the server registers the blocks as they are stored.
    append.call = Call();
    const HostTensor k = SliceTokens(prompt_k_, start, tokens);
    const HostTensor v = SliceTokens(prompt_v_, start, tokens);
    const bool quantized = iter % 2 == 0;
    absl::StatusOr<AppendResult> appended =
        quantized ? Timed(r, kAppendQuantized,
                          [&] { return client_->AppendPromptQuantized(id, config, k, v, append); })
                  : Timed(r, kAppendDense, [&] { return client_->AppendPrompt(id, k, v, append); });
    if (!appended.ok()) {
      release(id);
      continue;
    }
    if (appended->num_tokens != tokens) {
      Fail(r, quantized ? kAppendQuantized : kAppendDense, "WRONG_SHAPE",
           absl::StrCat(id, " holds ", appended->num_tokens, " tokens, expected ", tokens));
    }

    // One layer back: the shape always, the bytes for fp16 (stored as sent;
    // a reused prefix holds the same bank rows).
    FetchOptions fetch;
    fetch.layer_begin = static_cast<int>(iter % kLayers);
    fetch.layer_end = fetch.layer_begin + 1;
    fetch.call = Call();
    const bool local = absl::StartsWith(config.scheme, "kivi") && iter % 4 >= 2;
    absl::StatusOr<FetchedKv> got =
        local ? Timed(r, kFetchDequantLocal,
                      [&] { return client_->FetchDequantLocal(id, config, fetch); })
              : Timed(r, kFetchDequant, [&] { return client_->FetchDequant(id, fetch); });
    if (got.ok()) {
      const std::vector<int64_t> want = {1, kKvHeads, tokens, kHeadDim};
      if (got->k.shape != want || got->v.shape != want) {
        Fail(r, local ? kFetchDequantLocal : kFetchDequant, "WRONG_SHAPE",
             absl::StrCat(id, ": fetched ", got->k.DebugString()));
      } else if (config.scheme == "fp16") {
        HostTensor layer_k = SliceTokens(prompt_k_, 0, tokens);
        HostTensor layer_v = SliceTokens(prompt_v_, 0, tokens);
        const size_t layer_bytes = layer_k.data.size() / kLayers;
        const bool same =
            got->k.data == layer_k.data.substr(fetch.layer_begin * layer_bytes, layer_bytes) &&
            got->v.data == layer_v.data.substr(fetch.layer_begin * layer_bytes, layer_bytes);
        if (!same) Fail(r, kFetchDequant, "WRONG_DATA", absl::StrCat(id, ": fp16 bytes differ"));
      }
    }

    if (iter % 4 == 3) {
      ForkOptions fork;
      fork.call = Call();
      absl::StatusOr<ForkResult> forked = Timed(r, kFork, [&] { return client_->Fork(id, fork); });
      if (forked.ok()) {
        ++r->forks;
        if (forked->num_tokens != tokens) {
          Fail(r, kFork, "WRONG_SHAPE",
               absl::StrCat("fork of ", id, " holds ", forked->num_tokens, " tokens"));
        }
        release(forked->sequence_id);
      }
    }

    if (handover_.Offer(Live{id, config, tokens})) {
      ++r->handed_over;
    } else {
      release(id);
    }
  }
}

void Soak::DecodeOne(const Live& live, int serial, std::mt19937* rng, Recorder* r) {
  // Per-client step tensors, generated once per sequence from the rng (cheap
  // next to the calls: a few KiB).
  std::vector<AppendAttendItem> items;
  for (int i = 0; i < kStepVariants; ++i) {
    items.push_back({live.id, RandomTensor({kKvHeads, 1, kHeadDim}, DType::kFloat16, rng),
                     RandomTensor({kKvHeads, 1, kHeadDim}, DType::kFloat16, rng),
                     RandomTensor({1, kQHeads, kHeadDim}, DType::kFloat32, rng)});
  }
  auto packed = [&](const AppendAttendItem& item) {
    DecodeBatch batch;
    batch.sequence_ids = {live.id};
    batch.k = item.k;
    batch.k.shape = {1, kKvHeads, kHeadDim};
    batch.v = item.v;
    batch.v.shape = {1, kKvHeads, kHeadDim};
    batch.q = item.q;
    return batch;
  };
  // 0: DecodeStream; 1: unary AppendAttend; 2: packed steps, on the stream
  // and unary in turn.
  const int mode = serial % 3;
  std::unique_ptr<DecodeSession> session;
  if (mode != 1) {
    absl::StatusOr<std::unique_ptr<DecodeSession>> opened =
        client_->OpenDecodeSession(4 * options_.call_deadline);
    if (!opened.ok()) {
      Fail(r, kDecodeStreamStep, absl::StatusCodeToString(opened.status().code()),
           std::string(opened.status().message()));
      return;
    }
    session = std::move(*opened);
  }
  const int steps = std::uniform_int_distribution<int>(kMinSteps, kMaxSteps)(*rng);
  int done = 0;
  bool failed = false;
  for (int step = 0; step < steps && !failed && !Stopping(); ++step) {
    for (int layer = 0; layer < kLayers && !failed; ++layer) {
      const AppendAttendItem& item = items[(step * kLayers + layer) % kStepVariants];
      const HostTensor* lse = nullptr;
      absl::StatusOr<std::vector<AttendOutput>> outs;
      absl::StatusOr<AttendOutput> out;
      if (mode == 0) {
        outs = Timed(r, kDecodeStreamStep, [&] { return session->Step(layer, {item}); });
        if (outs.ok()) lse = &(*outs)[0].lse;
      } else if (mode == 1) {
        outs = Timed(r, kAppendAttend,
                     [&] { return client_->AppendAttend(layer, {item}, 0, Call()); });
        if (outs.ok()) lse = &(*outs)[0].lse;
      } else if (step % 2 == 0) {
        out = Timed(r, kDecodeStreamPackedStep,
                    [&] { return session->StepBatch(layer, packed(item)); });
        if (out.ok()) lse = &out->lse;
      } else {
        out = Timed(r, kAppendAttendPacked,
                    [&] { return client_->AppendAttendBatch(layer, packed(item), 0, Call()); });
        if (out.ok()) lse = &out->lse;
      }
      if (lse == nullptr) {
        failed = true;
      } else if (!AllFinite(*lse)) {
        Fail(r, mode == 1 ? kAppendAttend : kDecodeStreamStep, "WRONG_DATA",
             absl::StrCat(live.id, ": lse not finite"));
      }
    }
    if (failed) break;
    ++done;
    ++r->decode_tokens;
    if (step % 8 == 7) {
      const int layer = step / 8 % kLayers;
      const HostTensor& q = items[step % kStepVariants].q;
      if (step % 16 == 7) {
        (void)Timed(r, kAttend, [&] {
          return client_->Attend(layer, {AttendQuery{live.id, q, {}, 0, 0}}, 0, Call());
        });
      } else {
        AttendBatchOptions batch;
        batch.call = Call();
        const std::vector<std::string> ids = {live.id};
        (void)Timed(r, kAttendPacked, [&] { return client_->AttendBatch(layer, ids, q, batch); });
      }
    }
  }
  if (session != nullptr) {
    const absl::Status closed = session->Close();
    if (!closed.ok() && !failed) {
      Fail(r, kDecodeStreamStep, absl::StatusCodeToString(closed.code()),
           std::string(closed.message()));
    }
  }
  if (!failed) {
    absl::StatusOr<v1::StatsResponse> stats =
        Timed(r, kStatsSequence, [&] { return client_->Stats(live.id, Call()); });
    if (stats.ok() && stats->num_tokens() != live.tokens + done) {
      Fail(r, kStatsSequence, "WRONG_SHAPE",
           absl::StrCat(live.id, " holds ", stats->num_tokens(), " tokens after ", done,
                        " decode steps on ", live.tokens));
    }
  }
  (void)Timed(r, kRelease, [&] { return client_->Release(live.id, Call()); });
}

void Soak::DecodeClient(int index, Recorder* r) {
  std::mt19937 rng(options_.seed * 104729u + index);
  for (int serial = index; !Stopping(); serial += std::max(options_.decode_clients, 1)) {
    std::optional<Live> live = handover_.Take(absl::Milliseconds(200));
    if (live.has_value()) DecodeOne(*live, serial, &rng, r);
  }
}

SoakSample Soak::Sample(double t_s, Recorder* r) {
  SoakSample s;
  s.t_s = t_s;
  if (server_ != nullptr) s.server_rss_bytes = ReadRss(absl::StrCat(server_->pid()));
  s.client_rss_bytes = ReadRss("self");
  absl::StatusOr<v1::StatsResponse> stats =
      Timed(r, kStatsServer, [&] { return client_->Stats("", Call()); });
  if (stats.ok()) {
    s.used_bytes = stats->used_bytes();
    s.slabs_used = stats->pages_used();
    s.sequences = stats->sequences();
  }
  return s;
}

absl::StatusOr<SoakResult> Soak::Run() {
  if (options_.prefill_clients < 1 || options_.decode_clients < 0) {
    return absl::InvalidArgumentError("--prefill_clients must be >= 1 and --decode_clients >= 0");
  }
  if (options_.duration <= absl::ZeroDuration() || options_.duration > absl::Hours(24)) {
    return absl::InvalidArgumentError("--duration must be in (0, 24h]");
  }
  if (options_.target.empty()) {
    KVQ_RETURN_IF_ERROR(StartServer());
  } else {
    result_.target = options_.target;
  }
  ClientOptions client_options;
  client_options.target = result_.target;
  client_options.ns = kNamespace;
  client_options.deadline = options_.call_deadline;
  KVQ_ASSIGN_OR_RETURN(client_, KvqClient::Connect(client_options));
  KVQ_ASSIGN_OR_RETURN(const v1::ServerInfo info, client_->GetServerInfo());
  result_.server_version = info.version();
  result_.server_backend = info.backend();
  result_.duration_s = absl::ToDoubleSeconds(options_.duration);
  result_.prefill_clients = options_.prefill_clients;
  result_.decode_clients = options_.decode_clients;
  result_.schemes = Schemes();

  std::mt19937 rng(options_.seed);
  prompt_k_ = RandomTensor({kLayers, kKvHeads, kMaxPrompt, kHeadDim}, DType::kFloat16, &rng);
  prompt_v_ = RandomTensor({kLayers, kKvHeads, kMaxPrompt, kHeadDim}, DType::kFloat16, &rng);

  Recorder sampler;
  result_.start = Sample(0, &sampler);
  if (result_.start.used_bytes < 0) {
    return absl::UnavailableError(absl::StrCat(
        "Stats failed before the run: ", sampler.examples.empty() ? "" : sampler.examples[0]));
  }
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats("", Call());
  if (stats.ok()) result_.capacity_bytes = stats->capacity_bytes();

  const int clients = options_.prefill_clients + options_.decode_clients;
  std::vector<Recorder> recorders(clients);
  std::vector<std::thread> threads;
  const Clock::time_point t0 = Clock::now();
  auto elapsed_s = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  for (int i = 0; i < options_.prefill_clients; ++i) {
    threads.emplace_back([this, i, &recorders] { PrefillClient(i, &recorders[i]); });
  }
  for (int i = 0; i < options_.decode_clients; ++i) {
    Recorder* r = &recorders[options_.prefill_clients + i];
    threads.emplace_back([this, i, r] { DecodeClient(i, r); });
  }

  const double duration_s = result_.duration_s;
  const double interval_s = absl::ToDoubleSeconds(options_.sample_interval);
  double next_progress = 30;
  for (int n = 1;; ++n) {
    const double due = n * interval_s;
    while (elapsed_s() < std::min(due, duration_s) && !Stopping()) {
      absl::SleepFor(absl::Milliseconds(20));
      if (calls_.load() >= options_.max_calls) {
        result_.stopped_early = absl::StrCat("--max_calls=", options_.max_calls, " reached");
        stop_ = true;
      } else if (failed_.load() > options_.max_errors) {
        result_.stopped_early =
            absl::StrCat("more than --max_errors=", options_.max_errors, " failed calls");
        stop_ = true;
      } else if (server_ != nullptr && !server_->Running()) {
        result_.stopped_early = absl::StrCat("kvq-server exited: ", server_->LogTail(500));
        stop_ = true;
      }
    }
    if (elapsed_s() >= duration_s || Stopping()) break;
    result_.samples.push_back(Sample(elapsed_s(), &sampler));
    if (elapsed_s() >= next_progress) {
      next_progress += 30;
      const SoakSample& s = result_.samples.back();
      *progress_ << absl::StrFormat(
          "soak: %4.0f / %.0f s, %d calls, %d failed, server RSS %.1f MiB, pool %.1f MiB in %d "
          "slabs, %d sequences\n",
          s.t_s, duration_s, calls_.load(), failed_.load(), s.server_rss_bytes / double(1 << 20),
          s.used_bytes / double(1 << 20), s.slabs_used, s.sequences);
      progress_->flush();
    }
  }
  stop_ = true;
  for (std::thread& t : threads) t.join();
  result_.duration_s = elapsed_s();
  Recorder tail;
  for (Live& live : handover_.Drain()) {
    (void)Timed(&tail, kRelease, [&] { return client_->Release(live.id, Call()); });
  }
  // Everything is released: the pool must come back to where it started
  // (polled briefly: a raw fetch's pages are freed once gRPC dropped them).
  const Clock::time_point give_up = Clock::now() + std::chrono::seconds(10);
  do {
    result_.end = Sample(elapsed_s(), &tail);
    result_.returned_to_start = result_.end.used_bytes == result_.start.used_bytes &&
                                result_.end.slabs_used == result_.start.slabs_used &&
                                result_.end.sequences == result_.start.sequences;
    if (result_.returned_to_start) break;
    absl::SleepFor(absl::Milliseconds(100));
  } while (Clock::now() < give_up);

  recorders.push_back(std::move(sampler));
  recorders.push_back(std::move(tail));
  std::array<std::vector<float>, kNumOps> all;
  for (Recorder& r : recorders) {
    for (int op = 0; op < kNumOps; ++op) {
      all[op].insert(all[op].end(), r.ms[op].begin(), r.ms[op].end());
      r.ms[op] = {};
    }
    for (const auto& [code, count] : r.errors) result_.errors[code] += count;
    for (const std::string& e : r.examples) {
      if (result_.error_examples.size() < kMaxExamples) result_.error_examples.push_back(e);
    }
    result_.sequences_created += r.created;
    result_.prefix_hits += r.prefix_hits;
    result_.prefix_tokens_reused += r.prefix_tokens;
    result_.forks += r.forks;
    result_.decode_tokens += r.decode_tokens;
    result_.handed_over += r.handed_over;
  }
  for (int op = 0; op < kNumOps; ++op) {
    if (!all[op].empty()) result_.ops.push_back(Summarize(OpName(op), &all[op]));
  }
  result_.flat = EvaluateFlat(result_.samples, duration_s, options_);
  if (server_ != nullptr) {
    client_.reset();
    (void)server_->Stop();
  }
  return std::move(result_);
}

}  // namespace

absl::StatusOr<SoakResult> RunSoak(const SoakOptions& options, std::ostream* progress) {
  Soak soak(options, progress);
  return soak.Run();
}

}  // namespace kvq
