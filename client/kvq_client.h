// KvqClient: the C++ client of the kvq.v1.KvCache service.
//
// One method per RPC, typed tensors (HostTensor) in and out, absl::Status
// errors carrying the server's gRPC code and message unchanged (the codes
// are listed in proto/kvq/v1/kvq.proto). Every call has a deadline
// (ClientOptions::deadline unless the call's options set one). Idempotent
// calls (GetServerInfo, FetchDequant, Attend, Stats, Release) are retried
// with exponential backoff on UNAVAILABLE and DEADLINE_EXCEEDED; calls that
// change state (CreateSequence, Append, AppendAttend, DecodeStream, Fork)
// are never retried. A Release retried after a lost reply treats NOT_FOUND
// as success.
//
// A client talks to one namespace (ClientOptions::ns). It is thread-safe;
// a DecodeSession is not (one thread per session).
//
// Prefill:
//   auto client = KvqClient::Connect({.target = "kvq:50051"}).value();
//   SequenceConfig cfg{.layout = {32, 8, 32, 128}, .scheme = "kivi2:g32:r128"};
//   SequenceInfo seq = client->CreateSequence({.config = cfg}).value();
//   cfg.scheme = seq.scheme;
//   client->AppendPromptQuantized(seq.sequence_id, cfg, k, v, {}).value();
// Decode (per step, per layer):
//   auto out = client->AppendAttend(layer, {{seq.sequence_id, k1, v1, q1}}).value();
#ifndef KVQ_CLIENT_KVQ_CLIENT_H_
#define KVQ_CLIENT_KVQ_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/append_plan.h"
#include "client/device_peer.h"
#include "client/host_tensor.h"
#include "client/local_sequence.h"
#include "client/sequence_config.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "kernels/page_allocator.h"
#include "kvq/v1/kvq.grpc.pb.h"

namespace kvq {

// Bytes done so far and the total (-1 when unknown, e.g. a fetch).
using ProgressFn = std::function<void(int64_t done_bytes, int64_t total_bytes)>;

struct RetryPolicy {
  int max_attempts = 4;  // 1 disables retries.
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  double multiplier = 2.0;
  double jitter = 0.2;  // Each wait is scaled by a random factor in [1 - j, 1 + j].
};

struct ClientOptions {
  std::string target = "localhost:50051";
  std::string ns;  // Namespace of every sequence this client names.
  // Bearer token of this client's tenant (a server with --tokens_file):
  // sent as "authorization: Bearer <token>" on every call, stream and
  // retry. Empty: none.
  std::string token;
  absl::Duration deadline = absl::Seconds(30);  // Per attempt.
  RetryPolicy retry;
  // Longest wait between the channel's attempts to reconnect to a server
  // that went away, and between its re-resolutions of the target, so a
  // restarted server is reached within a few of these (gRPC's defaults,
  // up to 120 s of backoff and 30 s between resolutions, took 8-13 s after
  // a 2-second outage: docs/RELIABILITY.md, "Faults").
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
  // Channel send/receive message limit (the server has its own:
  // ServerInfo.max_message_bytes).
  int max_message_bytes = 64 << 20;
  // Insecure when null. TLS / mutual TLS from PEM files:
  // TlsCredentialsFromFiles (client/tls_credentials.h).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // TLS: the name checked against the server's certificate instead of the
  // target's host (e.g. a certificate for "kvq.internal" reached by IP).
  std::string tls_server_name;
  // Freed memory of FetchDequantLocal's local streams (their sink and tail
  // buffers) kept for the next call (fresh memory costs a page fault per
  // 4 KiB); 0 keeps none.
  size_t local_page_cache_bytes = size_t{64} << 20;
  // Connect() calls RetainMessageBuffers() (kernels/malloc_tuning.h): glibc
  // then serves message-sized buffers from the heap and keeps up to 64 MiB
  // of freed heap mapped, instead of an mmap, page faults and an munmap per
  // ~1 MiB message. Process-wide; turn it off in a process that tunes
  // malloc itself.
  bool retain_message_buffers = true;
};

// Per-call overrides.
struct CallOptions {
  absl::Duration deadline = absl::ZeroDuration();  // 0: ClientOptions::deadline.
};

struct CreateOptions {
  std::string sequence_id;  // "": the server picks one.
  SequenceConfig config;
  uint32_t ttl_seconds = 0;  // 0: server default.
  std::vector<int32_t> prompt_token_ids;  // Prefix reuse.
  CallOptions call;
};

// MatchPrefix's answer: the leading prompt tokens a CreateSequence with the
// same config would reuse now (0 or sink + k * block_tokens).
struct PrefixMatch {
  int matched_tokens = 0;
  int block_tokens = 0;
};

struct SequenceInfo {
  std::string sequence_id;
  std::string scheme;  // Canonical.
  int num_tokens = 0;  // A reused prefix already present.
  int block_tokens = 0;
  uint32_t ttl_seconds = 0;  // The idle lease granted (capped to the server's maximum).
};

// Where a device payload's bytes are (docs/TRANSPORT.md). With `transport`
// other than kGrpc, the bytes of k and v are at `k` and `v` in memory that
// `peer` reaches (device memory for the CUDA peers,
// client/cuda_device_peers.h) and the call's tensors give only dtype and shape.
struct DevicePayloadOptions {
  PayloadTransport transport = PayloadTransport::kGrpc;
  DevicePeer* peer = nullptr;  // Not owned; must be of `transport`'s kind.
  void* k = nullptr;           // Append: read from; fetch: written to.
  void* v = nullptr;
  uint32_t session_ttl_seconds = 0;  // kNccl: the session's lease (0: server default).
};

struct AppendOptions {
  int64_t max_chunk_bytes = kDefaultMaxChunkBytes;
  int layer_begin = 0;  // Model layer of the prompt's first layer.
  // Dense appends: the wire dtype (default: the prompt's dtype).
  std::optional<DType> wire_dtype;
  std::vector<int32_t> token_ids;  // Sent once, in the first message.
  // Quantized appends: tokens the sequence already holds in every layer
  // (SequenceInfo::num_tokens after prefix reuse) and its block_tokens
  // (0: derived from the scheme).
  int start_tokens = 0;
  int block_tokens = 0;
  const KernelBackend* backend = nullptr;  // Local quantization; null: CPU.
  int quantize_threads = 0;                // 0: one per hardware thread.
  ProgressFn progress;
  // AppendPrompt only: send k and v over a device path instead (their
  // dtype is sent as is; wire_dtype, max_chunk_bytes and progress do not
  // apply). Never retried.
  DevicePayloadOptions device;
  CallOptions call;
};

struct AppendResult {
  int num_tokens = 0;
  int64_t bytes_stored = 0;
  int64_t wire_bytes = 0;  // Tensor/page payload sent.
  int chunks = 0;
};

struct FetchOptions {
  int layer_begin = 0;
  int layer_end = 0;  // Exclusive; 0: num_layers.
  int token_begin = 0;
  int token_end = 0;  // Exclusive; 0: num_tokens.
  DType dtype = DType::kFloat16;
  bool apply_rope = false;   // pre_rope schemes: keys post-RoPE.
  int max_chunk_bytes = 0;   // 0: server default.
  // Where the client dequantizes raw pages (FetchDequantLocal*), outputs (k
  // and v together) of at least this many bytes are written past the caches
  // with non-temporal stores: a prompt's KV that is not read again soon
  // fills faster that way (docs/BENCHMARKS.md section 7). 0: always; negative:
  // never. The bytes are the same either way.
  int64_t streaming_output_bytes = int64_t{16} << 20;
  ProgressFn progress;
  // FetchDequantInto only: the server writes k and v into device memory
  // instead; the output tensors give dtype and shape (their data is not
  // touched).
  DevicePayloadOptions device;
  CallOptions call;
};

// Raw pages as the server sent them, in order.
struct RawFetch {
  std::vector<v1::FetchResponse> responses;
  int64_t wire_bytes = 0;
};

struct AttendQuery {
  std::string sequence_id;
  HostTensor q;  // Post-RoPE [num_queries, num_q_heads, head_dim].
  std::vector<int32_t> q_positions;  // Empty: every stored token is visible.
  int key_begin = 0;
  int key_end = 0;  // 0: all stored tokens.
};

struct AppendAttendItem {
  std::string sequence_id;
  HostTensor k;  // [kv_heads, tokens, head_dim]
  HostTensor v;
  HostTensor q;  // [tokens, num_q_heads, head_dim]
};

// One decode step of a batch, packed (AppendAttendRequest.k/.v/.q): row i
// of each tensor for sequence_ids[i], one new token per sequence.
struct DecodeBatch {
  std::vector<std::string> sequence_ids;
  HostTensor k;  // [sequences, kv_heads, head_dim]: this step's key of each sequence.
  HostTensor v;  // Same shape and dtype as k.
  HostTensor q;  // Post-RoPE [sequences, num_q_heads, head_dim].
};

struct AttendBatchOptions {
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim).
  int key_end = 0;             // Keys [0, key_end) of every sequence; 0: all stored.
  CallOptions call;
};

struct AttendOutput {
  HostTensor out;  // fp32 [num_queries, num_q_heads, head_dim]
  HostTensor lse;  // fp32 [num_queries, num_q_heads]
};

struct ForkOptions {
  std::string new_sequence_id;  // "": the server picks one.
  int num_tokens = 0;           // Prefix to share; 0: all.
  uint32_t ttl_seconds = 0;
  CallOptions call;
};

struct ForkResult {
  std::string sequence_id;
  int num_tokens = 0;
  uint32_t ttl_seconds = 0;  // The idle lease granted.
};

// A DecodeStream: each Write appends and attends one layer for some
// sequences; Read returns the results in write order. Not thread-safe.
class DecodeSession {
 public:
  ~DecodeSession();  // Cancels the stream if Close() was not called.
  DecodeSession(const DecodeSession&) = delete;
  DecodeSession& operator=(const DecodeSession&) = delete;

  // Errors: the stream's final status once it broke (then every later call
  // returns it too), INVALID_ARGUMENT for a malformed tensor.
  absl::Status Write(int layer, absl::Span<const AppendAttendItem> items,
                     float softmax_scale = 0.0f);
  absl::StatusOr<std::vector<AttendOutput>> Read();
  // Write then Read.
  absl::StatusOr<std::vector<AttendOutput>> Step(int layer,
                                                 absl::Span<const AppendAttendItem> items,
                                                 float softmax_scale = 0.0f);
  // The packed form: one tensor each for the batch's k, v and q, one out
  // and one lse back (KvqClient::AppendAttendBatch). Read a batch step's
  // reply with ReadBatch.
  absl::Status WriteBatch(int layer, const DecodeBatch& batch, float softmax_scale = 0.0f);
  absl::StatusOr<AttendOutput> ReadBatch();
  absl::StatusOr<AttendOutput> StepBatch(int layer, const DecodeBatch& batch,
                                         float softmax_scale = 0.0f);
  // Half-closes and returns the stream's final status.
  absl::Status Close();

 private:
  friend class KvqClient;
  DecodeSession() = default;
  absl::Status Broken();
  // The stream's final status once it broke, FAILED_PRECONDITION once
  // closed (for writing: once half-closed).
  absl::Status CheckOpen(bool writing) const;
  // One request out (after CheckOpen), one step's result in.
  absl::Status Send(const v1::DecodeRequest& request);
  absl::StatusOr<v1::AttendResponse> Receive();

  std::string ns_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriterInterface<v1::DecodeRequest, v1::DecodeResponse>>
      stream_;
  std::optional<absl::Status> final_;
  bool writes_done_ = false;
};

class KvqClient {
 public:
  // Creates the channel (connection happens on the first call).
  static absl::StatusOr<std::unique_ptr<KvqClient>> Connect(const ClientOptions& options);
  // Uses an existing channel (in-process servers, custom channel args).
  KvqClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);

  const ClientOptions& options() const { return options_; }

  absl::StatusOr<v1::ServerInfo> GetServerInfo(const CallOptions& call = {});

  // ALREADY_EXISTS for an id in use; INVALID_ARGUMENT for a bad layout or
  // scheme (checked locally first: no round trip for a typo).
  absl::StatusOr<SequenceInfo> CreateSequence(const CreateOptions& options);

  // Read-only probe of the server's prefix cache under this client's
  // namespace and `config` (layout, scheme, codebooks): creates, forks and
  // pins nothing. Idempotent (retried). INVALID_ARGUMENT for a bad config.
  absl::StatusOr<PrefixMatch> MatchPrefix(const SequenceConfig& config,
                                          const std::vector<int32_t>& prompt_token_ids,
                                          const CallOptions& call = {});

  // Streams k and v ([layers, kv_heads, tokens, head_dim], same dtype) as
  // dense chunks of at most max_chunk_bytes. One all-or-nothing append.
  absl::StatusOr<AppendResult> AppendPrompt(absl::string_view sequence_id, const HostTensor& k,
                                            const HostTensor& v, const AppendOptions& options = {});

  // Quantizes k and v locally in the sequence's scheme (`config.scheme`
  // should be the canonical scheme the server returned) and sends the
  // quantized part as raw pages; the sink, any alignment and the fp16 tail
  // go as dense rows. fp8_e4m3 sends everything dense. Errors of local
  // quantization (NaN, beyond fp16) come back before anything is stored.
  absl::StatusOr<AppendResult> AppendPromptQuantized(absl::string_view sequence_id,
                                                     const SequenceConfig& config,
                                                     const HostTensor& k, const HostTensor& v,
                                                     const AppendOptions& options = {});

  // Dequantized K/V ([layers, kv_heads, tokens, head_dim] of options.dtype),
  // sized from the range the first message states and filled as messages
  // arrive. Retried as a whole.
  absl::StatusOr<FetchedKv> FetchDequant(absl::string_view sequence_id,
                                         const FetchOptions& options = {});
  // FetchDequant into tensors the caller owns and may reuse across calls:
  // k and v are [layers, kv_heads, tokens, head_dim] of options.dtype, and
  // their shape sets the range (layers from options.layer_begin, tokens from
  // options.token_begin; options.layer_end / token_end must be 0 or agree).
  // Each message is copied straight into place as it arrives: no assembly
  // buffer, and no fresh allocation when the caller reuses k and v (the way
  // a decode worker fills its own KV blocks). INVALID_ARGUMENT names a bad
  // output tensor; DATA_LOSS if the server's stream does not cover the
  // range exactly. On error the tensors' contents are unspecified.
  absl::Status FetchDequantInto(absl::string_view sequence_id, const FetchOptions& options,
                                HostTensor* k, HostTensor* v);
  // The stored pages (raw = true), unprocessed. The server serves raw pages
  // only for quantized tokens: the range must start on a page boundary
  // (sink + k * page_tokens) and end inside the quantized part (OUT_OF_RANGE
  // otherwise); options.dtype and apply_rope are not sent.
  absl::StatusOr<RawFetch> FetchRaw(absl::string_view sequence_id,
                                    const FetchOptions& options = {});
  // The range's quantized part as raw pages (FetchRaw), dequantized here
  // with the core's kernels as each message arrives (the pages are
  // validated, not stored): the wire carries the quantized bytes. The sink
  // and the fp16 tail come dequantized by the server (FetchDequant). One
  // Stats call first for the length. Bit-exact against FetchDequant.
  // fp8_e4m3 (no raw pages) falls back to FetchDequant.
  absl::StatusOr<FetchedKv> FetchDequantLocal(absl::string_view sequence_id,
                                              const SequenceConfig& config,
                                              const FetchOptions& options = {});
  // FetchDequantLocal into tensors the caller owns, shaped as for
  // FetchDequantInto (their shape sets the range): no fresh result to
  // zero-fill and fault in.
  absl::Status FetchDequantLocalInto(absl::string_view sequence_id, const SequenceConfig& config,
                                     const FetchOptions& options, HostTensor* k, HostTensor* v);

  // One result per query, in order.
  absl::StatusOr<std::vector<AttendOutput>> Attend(int layer, absl::Span<const AttendQuery> items,
                                                   float softmax_scale = 0.0f,
                                                   const CallOptions& call = {});
  // Attend's packed form for one query per sequence, as a batched decode
  // step holds them: q [sequences, num_q_heads, head_dim] (row i for
  // sequence_ids[i]) in one tensor, out [sequences, num_q_heads, head_dim]
  // and lse [sequences, num_q_heads] (fp32) back in one each. The same
  // kernel call as Attend with one query per item, without a tensor per
  // item each way.
  absl::StatusOr<AttendOutput> AttendBatch(int layer, absl::Span<const std::string> sequence_ids,
                                           const HostTensor& q,
                                           const AttendBatchOptions& options = {});
  absl::StatusOr<std::vector<AttendOutput>> AppendAttend(
      int layer, absl::Span<const AppendAttendItem> items, float softmax_scale = 0.0f,
      const CallOptions& call = {});
  // AppendAttend's packed form for one new token per sequence: the batch's
  // k, v and q travel as one tensor each, the reply as one out and one lse
  // tensor. The same appends and attention as AppendAttend. Never retried.
  absl::StatusOr<AttendOutput> AppendAttendBatch(int layer, const DecodeBatch& batch,
                                                 float softmax_scale = 0.0f,
                                                 const CallOptions& call = {});
  // A decode stream; its deadline covers the whole session (infinite by
  // default: a session lives as long as the decode loop).
  absl::StatusOr<std::unique_ptr<DecodeSession>> OpenDecodeSession(
      absl::Duration deadline = absl::InfiniteDuration());

  absl::StatusOr<ForkResult> Fork(absl::string_view source_id, const ForkOptions& options = {});
  // Bytes freed (0 when a retry found the sequence already released).
  absl::StatusOr<int64_t> Release(absl::string_view sequence_id, const CallOptions& call = {});
  // Per-sequence stats, or server-wide ones for an empty id.
  absl::StatusOr<v1::StatsResponse> Stats(absl::string_view sequence_id = "",
                                          const CallOptions& call = {});

 private:
  // Runs `attempt` (one RPC on a fresh context) until it succeeds, fails
  // with a code that is not retried, or attempts run out.
  absl::Status Call(bool idempotent, const CallOptions& call,
                    const std::function<grpc::Status(grpc::ClientContext*, int attempt)>& attempt);
  void SetDeadline(grpc::ClientContext* context, const CallOptions& call) const;
  void AddToken(grpc::ClientContext* context) const;
  // AppendAttend, either form (never retried).
  absl::StatusOr<v1::AttendResponse> CallAppendAttend(const v1::AppendAttendRequest& request,
                                                      const CallOptions& call);
  void Ref(absl::string_view sequence_id, v1::SequenceRef* out) const;
  absl::StatusOr<AppendResult> SendPlan(absl::string_view sequence_id, const HostTensor& k,
                                        const HostTensor& v, const AppendPlan& plan,
                                        const AppendOptions& options,
                                        const SequenceConfig* config);
  absl::Status FetchStream(absl::string_view sequence_id, const FetchOptions& options, bool raw,
                           const std::function<absl::Status(v1::FetchResponse&&)>& on_message,
                           const std::function<void()>& on_restart);
  // FetchDequantLocalInto with the range resolved (o.layer_end and
  // o.token_end set, inside the sequence's num_tokens): the sink and tail
  // dequantized by the server, the quantized part as raw pages dequantized
  // here, each message placed as it arrives.
  // AppendPrompt / FetchDequantInto over options.device (client/device_calls.cc).
  absl::StatusOr<AppendResult> AppendDevice(absl::string_view sequence_id, const HostTensor& k,
                                            const HostTensor& v, const AppendOptions& options);
  absl::Status FetchDevice(absl::string_view sequence_id, const FetchOptions& options,
                           const HostTensor& k, const HostTensor& v);
  // The descriptors of a request's two payloads; kNccl opens and joins a
  // session first (its id in *session).
  absl::Status DescribePayloads(const DevicePayloadOptions& device, int64_t bytes,
                                const CallOptions& call, v1::DevicePayload* k,
                                v1::DevicePayload* v, std::string* session);
  absl::Status FetchLocalInto(absl::string_view sequence_id, const SequenceConfig& config,
                              const FetchOptions& o, int num_tokens, HostTensor* k,
                              HostTensor* v);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  // Aux blocks of FetchLocalInto's (empty) local streams.
  std::unique_ptr<RecyclingPageAllocator> local_pages_;
};

// Backoff before retry number `retry` (1-based), without jitter.
absl::Duration RetryBackoff(const RetryPolicy& policy, int retry);
// Whether a failed idempotent call with this code is retried.
bool IsRetryableCode(absl::StatusCode code);

}  // namespace kvq

#endif  // KVQ_CLIENT_KVQ_CLIENT_H_
