// Behaviour of the real kvq-server through the C++ client (and a raw stub
// where the client would stop a malformed request first): error codes and
// messages, failed writes that leave the data untouched, concurrent
// appends, a cancelled append stream, lease expiry, eviction, the metrics
// endpoint and graceful shutdown.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "client/local_sequence.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "kernels/malloc_tuning.h"
#include "tests/integration/server_client_fixture.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_helpers.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64;
constexpr char kScheme[] = "kivi2:g32:r128";

SequenceConfig Config() {
  SequenceConfig c;
  c.layout = {kLayers, kHeads, kQHeads, kDim, {}};
  c.scheme = kScheme;
  return c;
}

void ExpectStatus(const absl::Status& st, absl::StatusCode code, absl::string_view text) {
  EXPECT_EQ(st.code(), code) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), text)) << st << "\n  expected text: " << text;
}

void ExpectStatus(const grpc::Status& st, grpc::StatusCode code, absl::string_view text) {
  EXPECT_EQ(st.error_code(), code) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), text))
      << st.error_message() << "\n  expected text: " << text;
}

// What a sequence holds: each layer fetched separately (an AppendAttend
// touches one layer) and the token count.
struct Snapshot {
  int num_tokens = -1;
  std::vector<FetchedKv> layers;
};

// Parses a Prometheus text exposition: one (name, labels, value) per sample.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::vector<Sample> ParseMetrics(const std::string& text) {
  std::vector<Sample> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    if (brace != absl::string_view::npos && brace < space) {
      s.name = std::string(line.substr(0, brace));
      const size_t close = line.find('}', brace);
      for (absl::string_view kv :
           absl::StrSplit(line.substr(brace + 1, close - brace - 1), ',', absl::SkipEmpty())) {
        const size_t eq = kv.find('=');
        std::string value(kv.substr(eq + 1));
        if (value.size() >= 2 && value.front() == '"') value = value.substr(1, value.size() - 2);
        s.labels[std::string(kv.substr(0, eq))] = value;
      }
    } else {
      s.name = std::string(line.substr(0, space));
    }
    s.value = std::strtod(std::string(line.substr(space + 1)).c_str(), nullptr);
    out.push_back(std::move(s));
  }
  return out;
}

// Sum of the samples of `name` whose labels include `labels`; -1 when none.
double MetricValue(const std::vector<Sample>& samples, absl::string_view name,
                   const std::map<std::string, std::string>& labels) {
  double sum = 0;
  bool found = false;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      match = match && it != s.labels.end() && it->second == v;
    }
    if (match) {
      sum += s.value;
      found = true;
    }
  }
  return found ? sum : -1;
}

// GET http://<host_port>/metrics over HTTP/1.0; the body.
absl::StatusOr<std::string> HttpGetMetrics(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("bad address ", host_port));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad host in ", host_port));
  }
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to ", host_port));
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: " + host_port + "\r\n\r\n";
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, 0);
    if (n <= 0) {
      close(fd);
      return absl::InternalError("send failed");
    }
    sent += n;
  }
  std::string response;
  char buf[8192];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, n);
  close(fd);
  if (!absl::StartsWith(response, "HTTP/1.") || response.find(" 200 ") == std::string::npos) {
    return absl::InternalError(absl::StrCat("bad response: ", response.substr(0, 200)));
  }
  const size_t body = response.find("\r\n\r\n");
  if (body == std::string::npos) return absl::InternalError("no end of headers");
  return response.substr(body + 4);
}

class ServerBehaviorTest : public ServerClientFixture {
 protected:
  void Create(const std::string& id) {
    CreateOptions create;
    create.sequence_id = id;
    create.config = Config();
    absl::StatusOr<SequenceInfo> info = client_->CreateSequence(create);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->scheme, kScheme);
  }

  void Append(const std::string& id, const HostTensor& k, const HostTensor& v) {
    AppendOptions options;
    options.max_chunk_bytes = 16 << 10;
    absl::StatusOr<AppendResult> r = client_->AppendPrompt(id, k, v, options);
    ASSERT_TRUE(r.ok()) << r.status();
  }

  Snapshot Take(const std::string& id) {
    Snapshot s;
    absl::StatusOr<v1::StatsResponse> stats = client_->Stats(id);
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (stats.ok()) s.num_tokens = stats->num_tokens();
    for (int l = 0; l < kLayers; ++l) {
      FetchOptions fetch;
      fetch.dtype = DType::kFloat32;
      fetch.layer_begin = l;
      fetch.layer_end = l + 1;
      absl::StatusOr<FetchedKv> kv = client_->FetchDequant(id, fetch);
      EXPECT_TRUE(kv.ok()) << kv.status();
      s.layers.push_back(kv.ok() ? *kv : FetchedKv());
    }
    return s;
  }

  void ExpectUnchanged(const std::string& id, const Snapshot& before) {
    const Snapshot after = Take(id);
    EXPECT_EQ(after.num_tokens, before.num_tokens);
    ASSERT_EQ(after.layers.size(), before.layers.size());
    for (size_t l = 0; l < before.layers.size(); ++l) {
      EXPECT_EQ(after.layers[l].k.shape, before.layers[l].k.shape) << "layer " << l;
      EXPECT_TRUE(after.layers[l].k == before.layers[l].k) << "layer " << l;
      EXPECT_TRUE(after.layers[l].v == before.layers[l].v) << "layer " << l;
    }
  }

  v1::StatsResponse ServerStats() {
    absl::StatusOr<v1::StatsResponse> stats = client_->Stats("");
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? *stats : v1::StatsResponse();
  }

  // An Append stream through the raw stub: `chunks` in order, the first
  // message naming the sequence.
  grpc::Status RawAppend(const std::string& id, const std::vector<v1::KvChunk>& chunks) {
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w = stub_->Append(&ctx, &resp);
    for (size_t i = 0; i < chunks.size(); ++i) {
      v1::AppendRequest req;
      if (i == 0) {
        req.mutable_sequence()->set_namespace_(ns_);
        req.mutable_sequence()->set_sequence_id(id);
      }
      *req.mutable_chunk() = chunks[i];
      if (!w->Write(req)) break;
    }
    w->WritesDone();
    return w->Finish();
  }

  static v1::KvChunk Chunk(const HostTensor& k, const HostTensor& v) {
    v1::KvChunk c;
    ToProto(k, c.mutable_k());
    ToProto(v, c.mutable_v());
    return c;
  }
};

// ------------------------------------------------------------ error paths

// Seeded random corruption of request fields: what a broken or hostile
// client could send (the randomized error-path tests).
class Corrupter {
 public:
  explicit Corrupter(uint64_t seed) : rng_(seed) {}
  uint64_t Next() { return rng_(); }
  // x with one random bit flipped.
  template <typename Int>
  Int Flip(Int x) {
    using U = std::make_unsigned_t<Int>;
    return static_cast<Int>(static_cast<U>(x) ^ (U{1} << (rng_() % (8 * sizeof(Int)))));
  }
  // Zero, ordinary, tiny, near float's range, inf or NaN.
  float AnyFloat() {
    static constexpr float kFloats[] = {0.0f, -1.0f, 1e-30f, 0.5f, 3e38f, -3e38f,
                                        std::numeric_limits<float>::infinity(),
                                        std::numeric_limits<float>::quiet_NaN()};
    return kFloats[rng_() % std::size(kFloats)];
  }
  // 1 to 4 bits flipped.
  void FlipBits(std::string* data) {
    if (data->empty()) return;
    for (int f = 1 + static_cast<int>(rng_() % 4); f > 0; --f) {
      (*data)[rng_() % data->size()] ^= static_cast<char>(1 << (rng_() % 8));
    }
  }
  // Cut short or grown by 1 to 64 bytes.
  void Resize(std::string* data) {
    const size_t delta = 1 + rng_() % 64;
    data->resize(rng_() % 2 == 0 && data->size() > delta ? data->size() - delta
                                                          : data->size() + delta);
  }
  // One of: a shape entry, the dtype, the rank, the byte count, data bits,
  // or a float of AnyFloat() written over 4 data bytes.
  void Tensor(v1::Tensor* t) {
    switch (rng_() % 6) {
      case 0:
        if (t->shape_size() > 0) {
          const int i = static_cast<int>(rng_() % t->shape_size());
          t->set_shape(i, Flip(t->shape(i)));
        }
        break;
      case 1: t->set_dtype(static_cast<v1::DType>(rng_() % 6)); break;
      case 2:
        if (rng_() % 2 == 0) t->add_shape(1 + static_cast<int64_t>(rng_() % 4));
        else if (t->shape_size() > 0) t->mutable_shape()->RemoveLast();
        break;
      case 3: Resize(t->mutable_data()); break;
      case 4: FlipBits(t->mutable_data()); break;
      default: {
        std::string* d = t->mutable_data();
        if (d->size() >= 4) {
          const float f = AnyFloat();
          std::memcpy(d->data() + 4 * (rng_() % (d->size() / 4)), &f, 4);
        }
      }
    }
  }

 private:
  std::mt19937_64 rng_;
};

// The codes a corrupted request may get: success, or one of the validation
// statuses (never UNKNOWN, INTERNAL or a transport error).
bool IsValidationOutcome(grpc::StatusCode code) {
  return code == grpc::StatusCode::OK || code == grpc::StatusCode::INVALID_ARGUMENT ||
         code == grpc::StatusCode::OUT_OF_RANGE || code == grpc::StatusCode::FAILED_PRECONDITION ||
         code == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

class ErrorPathTest : public ServerBehaviorTest {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StartServer(
        {"--max_message_bytes=65536", "--fetch_chunk_bytes=65536"}, "err"));
    ASSERT_NO_FATAL_FAILURE(Create("s"));
    ASSERT_NO_FATAL_FAILURE(Append("s", Random({kLayers, kHeads, 300, kDim}, 1),
                                   Random({kLayers, kHeads, 300, kDim}, 2)));
    before_ = Take("s");
    ASSERT_EQ(before_.num_tokens, 300);
  }

  Snapshot before_;
};

TEST_F(ErrorPathTest, UnknownSequencesAndDuplicateIds) {
  const std::string missing = "sequence \"missing\" in namespace \"err\" does not exist";
  ExpectStatus(client_->Stats("missing").status(), absl::StatusCode::kNotFound, missing);
  ExpectStatus(client_->FetchDequant("missing").status(), absl::StatusCode::kNotFound, missing);
  AttendQuery query{"missing", Random({1, kQHeads, kDim}, 3), {}, 0, 0};
  absl::Status attend = client_->Attend(0, {query}).status();
  ExpectStatus(attend, absl::StatusCode::kNotFound, "items[0].sequence: " + missing);
  // The same id in another namespace is another sequence.
  ClientOptions other = client_->options();
  other.ns = "other";
  absl::StatusOr<std::unique_ptr<KvqClient>> other_client = KvqClient::Connect(other);
  ASSERT_TRUE(other_client.ok());
  ExpectStatus((*other_client)->Stats("s").status(), absl::StatusCode::kNotFound,
               "sequence \"s\" in namespace \"other\" does not exist");

  CreateOptions again;
  again.sequence_id = "s";
  again.config = Config();
  ExpectStatus(client_->CreateSequence(again).status(), absl::StatusCode::kAlreadyExists,
               "sequence \"s\" in namespace \"err\" already exists");
  ExpectUnchanged("s", before_);
  EXPECT_EQ(ServerStats().sequences(), 1);
}

TEST_F(ErrorPathTest, MalformedCreateNamesTheField) {
  // Through the raw stub: the client checks schemes and layouts locally.
  auto create = [&](const std::string& scheme, int q_heads) {
    v1::CreateSequenceRequest req;
    req.set_namespace_("err");
    req.set_sequence_id("bad");
    req.set_scheme(scheme);
    req.mutable_layout()->set_num_layers(kLayers);
    req.mutable_layout()->set_num_kv_heads(kHeads);
    req.mutable_layout()->set_num_q_heads(q_heads);
    req.mutable_layout()->set_head_dim(kDim);
    grpc::ClientContext ctx;
    v1::CreateSequenceResponse resp;
    return stub_->CreateSequence(&ctx, req, &resp);
  };
  ExpectStatus(create("zstd4", kQHeads), grpc::StatusCode::INVALID_ARGUMENT,
               "unknown base scheme \"zstd4\"");
  ExpectStatus(create(kScheme, 3), grpc::StatusCode::INVALID_ARGUMENT,
               "layout.num_q_heads = 3 must be a multiple of num_kv_heads = 2, at most 64x");
  // The client rejects them too, before any round trip.
  CreateOptions bad;
  bad.sequence_id = "bad";
  bad.config = Config();
  bad.config.scheme = "zstd4";
  EXPECT_EQ(client_->CreateSequence(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerStats().sequences(), 1);
  ExpectStatus(client_->Stats("bad").status(), absl::StatusCode::kNotFound, "does not exist");
}

TEST_F(ErrorPathTest, RejectedAppendsLeaveTheDataUnchanged) {
  const HostTensor good = Random({kLayers, kHeads, 8, kDim}, 4);
  {
    SCOPED_TRACE("wrong kv heads in chunk.k");
    const HostTensor k = Random({kLayers, 3, 8, kDim}, 5);
    ExpectStatus(RawAppend("s", {Chunk(k, k)}), grpc::StatusCode::INVALID_ARGUMENT,
                 "chunk.k.shape = [2, 3, 8, 64], expected [n, 2, n, 64]");
    ExpectUnchanged("s", before_);
  }
  {
    SCOPED_TRACE("a valid chunk, then one whose v does not match k");
    const HostTensor v = Random({kLayers, kHeads, 9, kDim}, 6);
    ExpectStatus(RawAppend("s", {Chunk(good, good), Chunk(good, v)}),
                 grpc::StatusCode::INVALID_ARGUMENT,
                 "chunk.v.shape = [2, 2, 9, 64], expected [2, 2, 8, 64]");
    ExpectUnchanged("s", before_);
  }
  {
    SCOPED_TRACE("unspecified dtype");
    v1::KvChunk c = Chunk(good, good);
    c.mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED);
    ExpectStatus(RawAppend("s", {c}), grpc::StatusCode::INVALID_ARGUMENT,
                 "chunk.k.dtype = 0 is not one of fp32, fp16, bf16");
    ExpectUnchanged("s", before_);
  }
  {
    SCOPED_TRACE("NaN in the last chunk of a multi-chunk append");
    std::vector<float> k = Random({kLayers, kHeads, 200, kDim}, 7).ToFloats();
    k.back() = std::numeric_limits<float>::quiet_NaN();
    const HostTensor kt = *HostTensor::FromFloats(k, {kLayers, kHeads, 200, kDim});
    AppendOptions options;
    options.max_chunk_bytes = 16 << 10;
    absl::StatusOr<AppendResult> r =
        client_->AppendPrompt("s", kt, Random({kLayers, kHeads, 200, kDim}, 8), options);
    ExpectStatus(r.status(), absl::StatusCode::kInvalidArgument, "is not finite");
    ExpectUnchanged("s", before_);
  }
  {
    SCOPED_TRACE("AppendAttend: k with the wrong head_dim");
    AppendAttendItem item{"s", Random({kHeads, 1, 32}, 9), Random({kHeads, 1, 32}, 10),
                          Random({1, kQHeads, kDim}, 11)};
    ExpectStatus(client_->AppendAttend(0, {item}).status(), absl::StatusCode::kInvalidArgument,
                 "items[0].k.shape = [2, 1, 32], expected [2, n, 64]");
    ExpectUnchanged("s", before_);
  }
  {
    SCOPED_TRACE("AppendAttend: q for the wrong number of tokens");
    AppendAttendItem item{"s", Random({kHeads, 2, kDim}, 12), Random({kHeads, 2, kDim}, 13),
                          Random({1, kQHeads, kDim}, 14)};
    ExpectStatus(client_->AppendAttend(1, {item}).status(), absl::StatusCode::kInvalidArgument,
                 "items[0].q.shape = [1, 4, 64], expected [2, 4, 64]");
    ExpectUnchanged("s", before_);
  }
  {
    SCOPED_TRACE("AppendAttend: NaN in k");
    std::vector<float> k = Random({kHeads, 1, kDim}, 15).ToFloats();
    k[3] = std::numeric_limits<float>::quiet_NaN();
    AppendAttendItem item{"s", *HostTensor::FromFloats(k, {kHeads, 1, kDim}),
                          Random({kHeads, 1, kDim}, 16), Random({1, kQHeads, kDim}, 17)};
    ExpectStatus(client_->AppendAttend(0, {item}).status(), absl::StatusCode::kInvalidArgument,
                 "is not finite");
    ExpectUnchanged("s", before_);
  }
  {
    // Found by tests/fuzz/rpc_fuzz: attention refused the query after k and
    // v had been appended.
    SCOPED_TRACE("AppendAttend: NaN in q");
    std::vector<float> q = Random({1, kQHeads, kDim}, 21).ToFloats();
    q[70] = std::numeric_limits<float>::infinity();
    AppendAttendItem item{"s", Random({kHeads, 1, kDim}, 22), Random({kHeads, 1, kDim}, 23),
                          *HostTensor::FromFloats(q, {1, kQHeads, kDim})};
    ExpectStatus(client_->AppendAttend(0, {item}).status(), absl::StatusCode::kInvalidArgument,
                 "items[0].q: element 70 is not finite");
    ExpectUnchanged("s", before_);
  }
  {
    // Found by tests/fuzz/rpc_fuzz: the group sizes were compared after
    // the first item had been appended.
    SCOPED_TRACE("AppendAttend: items of two GQA group sizes");
    CreateOptions create;
    create.sequence_id = "mha";
    create.config = Config();
    create.config.layout.num_q_heads = kHeads;  // Group size 1; "s" has 2.
    ASSERT_TRUE(client_->CreateSequence(create).ok());
    AppendAttendItem first{"s", Random({kHeads, 1, kDim}, 24), Random({kHeads, 1, kDim}, 25),
                           Random({1, kQHeads, kDim}, 26)};
    AppendAttendItem second{"mha", Random({kHeads, 1, kDim}, 27), Random({kHeads, 1, kDim}, 28),
                            Random({1, kHeads, kDim}, 29)};
    ExpectStatus(client_->AppendAttend(0, {first, second}).status(),
                 absl::StatusCode::kInvalidArgument,
                 "items[1]: every item of one call must have the same GQA group size (2), this "
                 "sequence has 1");
    ExpectUnchanged("s", before_);
    EXPECT_EQ(client_->Stats("mha")->num_tokens(), 0);
  }
  {
    SCOPED_TRACE("AppendAttend: a valid item, then one naming a missing sequence");
    AppendAttendItem ok{"s", Random({kHeads, 1, kDim}, 18), Random({kHeads, 1, kDim}, 19),
                        Random({1, kQHeads, kDim}, 20)};
    AppendAttendItem missing = ok;
    missing.sequence_id = "missing";
    ExpectStatus(client_->AppendAttend(0, {ok, missing}).status(), absl::StatusCode::kNotFound,
                 "items[1].sequence: sequence \"missing\" in namespace \"err\" does not exist");
    ExpectUnchanged("s", before_);
  }
}

TEST_F(ErrorPathTest, ReadsOutsideTheStoredRangeAreOutOfRange) {
  AttendQuery query{"s", Random({1, kQHeads, kDim}, 21), {}, 0, 0};
  ExpectStatus(client_->Attend(kLayers, {query}).status(), absl::StatusCode::kOutOfRange,
               "layer = 2 is not in [0, 2)");
  ExpectStatus(client_->Attend(-1, {query}).status(), absl::StatusCode::kOutOfRange,
               "layer = -1 is not in [0, 2)");
  FetchOptions fetch;
  fetch.token_end = 301;
  ExpectStatus(client_->FetchDequant("s", fetch).status(), absl::StatusCode::kOutOfRange,
               "tokens [0, 301) are not inside the 300 tokens stored in layers [0, 2)");
  fetch.token_begin = 200;
  fetch.token_end = 100;
  ExpectStatus(client_->FetchDequant("s", fetch).status(), absl::StatusCode::kOutOfRange,
               "tokens [200, 100) are not inside the 300 tokens stored in layers [0, 2)");
  ExpectUnchanged("s", before_);
}

TEST_F(ErrorPathTest, PackedAttendChecksItsQueries) {
  auto attend = [&](const v1::AttendRequest& req) {
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    const grpc::Status st = stub_->Attend(&ctx, req, &resp);
    EXPECT_FALSE(resp.has_out()) << "a failed call returned a packed output";
    EXPECT_EQ(resp.results_size(), 0);
    return st;
  };
  v1::AttendRequest req;
  for (int i = 0; i < 2; ++i) {
    v1::SequenceRef* ref = req.add_items()->mutable_sequence();
    ref->set_namespace_(ns_);
    ref->set_sequence_id("s");
  }
  ToProto(Random({3, kQHeads, kDim}, 30), req.mutable_q());
  ExpectStatus(attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "q.shape = [3, 4, 64], expected [2, n, n]");
  ToProto(Random({2, kQHeads + 1, kDim}, 31), req.mutable_q());
  ExpectStatus(attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "q.shape = [2, 5, 64] does not fit items[0].sequence: num_q_heads = 4, "
               "head_dim = 64");
  ToProto(Random({2, kQHeads, kDim}, 32), req.mutable_q());
  ToProto(Random({1, kQHeads, kDim}, 33), req.mutable_items(1)->mutable_q());
  ExpectStatus(attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "items[1].q must be empty when q (packed) is set");
  req.mutable_items(1)->clear_q();
  req.mutable_items(1)->add_q_positions(10);
  req.mutable_items(1)->add_q_positions(11);
  ExpectStatus(attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "items[1].q_positions has 2 entries for 1 queries");
  req.mutable_items(1)->clear_q_positions();
  std::vector<float> nan(2 * kQHeads * kDim, 0.5f);
  nan[kQHeads * kDim + 7] = std::nanf("");
  ToProto(HostTensor::FromFloats(nan, {2, kQHeads, kDim}).value(), req.mutable_q());
  ExpectStatus(attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "q: attention task 2: q[0][7] is not finite");
  // Finite, but near float's range: the scores overflow.
  std::vector<float> huge(2 * kQHeads * kDim, 0.5f);
  std::fill_n(huge.begin() + (kQHeads + 1) * kDim, kDim, 3e38f);
  ToProto(HostTensor::FromFloats(huge, {2, kQHeads, kDim}).value(), req.mutable_q());
  ExpectStatus(attend(req), grpc::StatusCode::OUT_OF_RANGE,
               "attention task 2, query 0, head 1: the result overflowed float");
  // Found while writing tests/fuzz/rpc_fuzz: a dimension this large
  // overflowed int64 in the element count (undefined behaviour).
  req.mutable_q()->set_shape(1, int64_t{1} << 62);
  ExpectStatus(attend(req), grpc::StatusCode::INVALID_ARGUMENT, "q.shape is too large");
  // The client library checks the row count before sending.
  ExpectStatus(client_->AttendBatch(0, {"s", "s"}, Random({3, kQHeads, kDim}, 34)).status(),
               absl::StatusCode::kInvalidArgument,
               "q.shape[0] = 3 must equal the 2 sequences (one query row each, at least one)");
  ExpectUnchanged("s", before_);
}

// Valid Append chunks with their fields corrupted at random, as a broken or
// hostile client would send them: a bit of the layer index, of a shape
// entry, of a page count or size, the dtype, the data cut short or grown,
// and bit flips in the data. Two chunk kinds: dense fp16 K/V, and the raw
// quantized pages of "s" (as the server returned them). Every stream gets a
// status from the validation codes (never UNKNOWN or INTERNAL), the server
// keeps answering, a rejected append stores nothing, an accepted one
// stores finite KV, and once every trial's sequence is released the pool is
// back where it started. Under the sanitizer build (docs/DEVELOPING.md) the server's
// parsing and checks also run under ASan and UBSan.
TEST_F(ErrorPathTest, RandomlyCorruptedAppendChunksAreAnsweredAndAtomic) {
  std::vector<v1::KvChunk> raw_chunks;
  {
    FetchOptions raw;
    raw.token_end = 256;  // The quantized part of "s" (two 128-token flushes).
    absl::StatusOr<RawFetch> fetched = client_->FetchRaw("s", raw);
    ASSERT_TRUE(fetched.ok()) << fetched.status();
    for (const v1::FetchResponse& m : fetched->responses) {
      if (!m.has_pages()) continue;
      v1::KvChunk c;
      c.set_layer_begin(m.layer());
      *c.mutable_pages() = m.pages();
      raw_chunks.push_back(std::move(c));
    }
    ASSERT_FALSE(raw_chunks.empty());
  }
  const std::vector<v1::KvChunk> dense_chunks = {
      Chunk(Random({kLayers, kHeads, 40, kDim}, 60).Cast(DType::kFloat16),
            Random({kLayers, kHeads, 40, kDim}, 61).Cast(DType::kFloat16))};
  Corrupter corrupt(20261202);
  auto corrupt_chunk = [&](v1::KvChunk* c) {
    const int field = static_cast<int>(corrupt.Next() % 4);
    if (field == 0) {
      c->set_layer_begin(corrupt.Flip(c->layer_begin()));
    } else if (!c->has_pages()) {
      corrupt.Tensor(field == 1 ? c->mutable_k() : c->mutable_v());
    } else {
      v1::QuantizedPages* p = c->mutable_pages();
      switch (corrupt.Next() % 6) {
        case 0: p->set_layers(corrupt.Flip(p->layers())); break;
        case 1: p->set_tokens(corrupt.Flip(p->tokens())); break;
        case 2: p->set_page_bytes(corrupt.Flip(p->page_bytes())); break;
        case 3: p->set_page_tokens(corrupt.Flip(p->page_tokens())); break;
        case 4: corrupt.Resize(p->mutable_page_data()); break;
        default: corrupt.FlipBits(p->mutable_page_data()); break;
      }
    }
  };
  const int64_t pages_before = ServerStats().pages_used();
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const bool pages = trial % 2 == 1;
    std::vector<v1::KvChunk> chunks = pages ? raw_chunks : dense_chunks;
    if (trial >= 2) {  // Trials 0 and 1 send the chunks as they are.
      for (int m = 1 + static_cast<int>(corrupt.Next() % 2); m > 0; --m) {
        corrupt_chunk(&chunks[corrupt.Next() % chunks.size()]);
      }
    }
    const std::string id = absl::StrCat("fuzz", trial);
    ASSERT_NO_FATAL_FAILURE(Create(id));
    const grpc::Status st = RawAppend(id, chunks);
    EXPECT_TRUE(IsValidationOutcome(st.error_code()))
        << "trial " << trial << ": " << st.error_code() << " " << st.error_message();
    if (trial < 2) EXPECT_TRUE(st.ok()) << "trial " << trial << ": " << st.error_message();
    absl::StatusOr<v1::StatsResponse> stats = client_->Stats(id);
    ASSERT_TRUE(stats.ok()) << "trial " << trial << ": " << stats.status();
    if (!st.ok()) {
      ++rejected;
      EXPECT_EQ(stats->num_tokens(), 0) << "trial " << trial << ": " << st.error_message();
    } else {
      ++accepted;
      FetchOptions all;
      all.dtype = DType::kFloat32;
      absl::StatusOr<FetchedKv> kv = client_->FetchDequant(id, all);
      ASSERT_TRUE(kv.ok()) << "trial " << trial << ": " << kv.status();
      for (const HostTensor* t : {&kv->k, &kv->v}) {
        for (float x : t->ToFloats()) ASSERT_TRUE(std::isfinite(x)) << "trial " << trial;
      }
    }
    ASSERT_TRUE(client_->Release(id).ok());
  }
  EXPECT_GE(accepted, 2);
  EXPECT_GE(rejected, 20);
  EXPECT_EQ(ServerStats().pages_used(), pages_before);
  ExpectUnchanged("s", before_);
}

// Valid CreateSequence, Attend, FetchDequant, Fork and AppendAttend requests
// with a field set at random (integers with a bit flipped, floats from a
// list that has NaN, inf and negatives, enums past their values, tensors
// with a shape entry, dtype or byte count changed): every call gets a
// status from the validation codes, the server keeps answering, a failed
// AppendAttend stores nothing, and "s" and the pool are unchanged once what
// was created or forked is released.
TEST_F(ErrorPathTest, RandomlyCorruptedRequestsAreAnsweredAndChangeNothing) {
  Corrupter corrupt(20261203);
  const int64_t pages_before = ServerStats().pages_used();
  std::vector<std::string> made;  // Created or forked: released at the end.
  // AppendAttend stores a step when it succeeds: its own sequence.
  ASSERT_NO_FATAL_FAILURE(Create("aa"));
  ASSERT_NO_FATAL_FAILURE(Append("aa", Random({kLayers, kHeads, 40, kDim}, 71),
                                 Random({kLayers, kHeads, 40, kDim}, 72)));
  made.push_back("aa");
  int failed = 0;
  for (int trial = 0; trial < 250; ++trial) {
    grpc::ClientContext ctx;
    grpc::Status st;
    const int rpc = trial % 5;
    if (rpc == 4) {
      v1::AppendAttendRequest req;
      req.set_layer(static_cast<int32_t>(corrupt.Next() % kLayers));
      v1::AppendAttendItem* it = req.add_items();
      it->mutable_sequence()->set_namespace_(ns_);
      it->mutable_sequence()->set_sequence_id("aa");
      ToProto(Random({1, kHeads, kDim}, 80 + trial).Cast(DType::kFloat16), req.mutable_k());
      ToProto(Random({1, kHeads, kDim}, 81 + trial).Cast(DType::kFloat16), req.mutable_v());
      ToProto(Random({1, kQHeads, kDim}, 82 + trial), req.mutable_q());
      switch (corrupt.Next() % 5) {
        case 0: req.set_layer(corrupt.Flip(req.layer())); break;
        case 1: req.set_softmax_scale(corrupt.AnyFloat()); break;
        case 2: corrupt.Tensor(req.mutable_k()); break;
        case 3: corrupt.Tensor(req.mutable_v()); break;
        default: corrupt.Tensor(req.mutable_q());
      }
      const Snapshot before = Take("aa");
      v1::AttendResponse resp;
      st = stub_->AppendAttend(&ctx, req, &resp);
      // The one failure that keeps its step: attention that overflowed.
      if (!st.ok() && !absl::StrContains(st.error_message(), "overflowed float")) {
        ExpectUnchanged("aa", before);
      }
    } else if (rpc == 0) {
      v1::CreateSequenceRequest req;
      req.set_namespace_(ns_);
      req.set_sequence_id(absl::StrCat("rand", trial));
      req.set_scheme(kScheme);
      v1::ModelLayout* l = req.mutable_layout();
      l->set_num_layers(kLayers);
      l->set_num_kv_heads(kHeads);
      l->set_num_q_heads(kQHeads);
      l->set_head_dim(kDim);
      switch (corrupt.Next() % 9) {
        case 0: l->set_num_layers(corrupt.Flip(l->num_layers())); break;
        case 1: l->set_num_kv_heads(corrupt.Flip(l->num_kv_heads())); break;
        case 2: l->set_num_q_heads(corrupt.Flip(l->num_q_heads())); break;
        case 3: l->set_head_dim(corrupt.Flip(l->head_dim())); break;
        case 4: l->mutable_rope()->set_theta(corrupt.AnyFloat()); break;
        case 5: l->mutable_rope()->set_rotary_dim(corrupt.Flip(int32_t{0})); break;
        case 6: l->mutable_rope()->set_factor(corrupt.AnyFloat()); break;
        case 7:
          req.set_scheme(std::vector<std::string>{"kivi2:pre_rope", "kivi3:nuq", "kivi4:g7",
                                                  "kivi2:r8", "int8:sink=70000", ""}[corrupt.Next() % 6]);
          break;
        default:
          l->mutable_rope()->set_pairing(static_cast<v1::RopeParams::Pairing>(corrupt.Next() % 5));
          l->mutable_rope()->set_scaling(static_cast<v1::RopeParams::Scaling>(corrupt.Next() % 5));
          req.set_scheme("kivi2:pre_rope");
      }
      v1::CreateSequenceResponse resp;
      st = stub_->CreateSequence(&ctx, req, &resp);
      if (st.ok()) made.push_back(resp.sequence_id());
    } else if (rpc == 1) {
      v1::AttendRequest req;
      req.set_layer(static_cast<int32_t>(corrupt.Next() % kLayers));
      v1::AttendItem* it = req.add_items();
      it->mutable_sequence()->set_namespace_(ns_);
      it->mutable_sequence()->set_sequence_id("s");
      ToProto(Random({1, kQHeads, kDim}, 70 + trial), it->mutable_q());
      switch (corrupt.Next() % 6) {
        case 0: req.set_layer(corrupt.Flip(req.layer())); break;
        case 1: req.set_softmax_scale(corrupt.AnyFloat()); break;
        case 2: it->add_q_positions(corrupt.Flip(int32_t{0})); break;
        case 3: it->set_key_begin(corrupt.Flip(int32_t{0})); break;
        case 4: it->set_key_end(corrupt.Flip(int32_t{0})); break;
        default: corrupt.Tensor(it->mutable_q());
      }
      v1::AttendResponse resp;
      st = stub_->Attend(&ctx, req, &resp);
    } else if (rpc == 2) {
      v1::FetchRequest req;
      req.mutable_sequence()->set_namespace_(ns_);
      req.mutable_sequence()->set_sequence_id("s");
      req.set_raw(corrupt.Next() % 2 == 0);
      req.set_apply_rope(corrupt.Next() % 2 == 0);
      switch (corrupt.Next() % 6) {
        case 0: req.set_layer_begin(corrupt.Flip(int32_t{0})); break;
        case 1: req.set_layer_end(corrupt.Flip(int32_t{kLayers})); break;
        case 2: req.set_token_begin(corrupt.Flip(int32_t{0})); break;
        case 3: req.set_token_end(corrupt.Flip(int32_t{300})); break;
        case 4: req.set_dtype(static_cast<v1::DType>(corrupt.Next() % 6)); break;
        default: req.set_max_chunk_bytes(corrupt.Flip(int32_t{0}));
      }
      std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> reader =
          stub_->FetchDequant(&ctx, req);
      v1::FetchResponse m;
      while (reader->Read(&m)) {
      }
      st = reader->Finish();
    } else {
      v1::ForkRequest req;
      req.mutable_source()->set_namespace_(ns_);
      req.mutable_source()->set_sequence_id("s");
      req.set_new_sequence_id(absl::StrCat("rand", trial));
      req.set_num_tokens(corrupt.Flip(int32_t{0}));
      if (corrupt.Next() % 2 == 0) req.set_ttl_seconds(static_cast<uint32_t>(corrupt.Flip(int32_t{0})));
      v1::ForkResponse resp;
      st = stub_->Fork(&ctx, req, &resp);
      if (st.ok()) made.push_back(resp.sequence_id());
    }
    EXPECT_TRUE(IsValidationOutcome(st.error_code()))
        << "trial " << trial << " rpc " << rpc << ": " << st.error_code() << " " << st.error_message();
    if (!st.ok()) ++failed;
  }
  for (const std::string& id : made) EXPECT_TRUE(client_->Release(id).ok()) << id;
  EXPECT_GE(failed, 75);
  EXPECT_EQ(ServerStats().pages_used(), pages_before);
  ExpectUnchanged("s", before_);
}

TEST_F(ErrorPathTest, PackedDecodeStepsCheckTheirTensors) {
  auto append_attend = [&](const v1::AppendAttendRequest& req) {
    grpc::ClientContext ctx;
    v1::AttendResponse resp;
    const grpc::Status st = stub_->AppendAttend(&ctx, req, &resp);
    EXPECT_FALSE(resp.has_out()) << "a failed call returned a packed output";
    return st;
  };
  v1::AppendAttendRequest req;
  v1::SequenceRef* ref = req.add_items()->mutable_sequence();
  ref->set_namespace_(ns_);
  ref->set_sequence_id("s");
  ToProto(Random({1, kHeads, kDim}, 40), req.mutable_k());
  ToProto(Random({1, kHeads, kDim}, 41), req.mutable_v());
  ExpectStatus(append_attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "k, v and q (packed) must be set together");
  ToProto(Random({1, kQHeads, kDim}, 42), req.mutable_q());
  ToProto(Random({2, kHeads, kDim}, 43), req.mutable_k());
  ExpectStatus(append_attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "k.shape = [2, 2, 64], expected [1, n, n]");
  ToProto(Random({1, kHeads + 1, kDim}, 44), req.mutable_k());
  ToProto(Random({1, kHeads + 1, kDim}, 45), req.mutable_v());
  ExpectStatus(append_attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "k.shape = [1, 3, 64] and q.shape = [1, 4, 64] do not fit items[0].sequence: "
               "kv_heads = 2, num_q_heads = 4, head_dim = 64");
  ToProto(Random({1, kHeads, kDim}, 46), req.mutable_k());
  ToProto(Random({1, kHeads, kDim}, 47), req.mutable_v());
  ToProto(Random({kHeads, 1, kDim}, 48), req.mutable_items(0)->mutable_k());
  ExpectStatus(append_attend(req), grpc::StatusCode::INVALID_ARGUMENT,
               "items[0].k, .v and .q must be empty when k, v and q (packed) are set");
  // The client library checks the row counts before sending.
  DecodeBatch batch{{"s", "s"}, Random({2, kHeads, kDim}, 49), Random({2, kHeads, kDim}, 50),
                    Random({1, kQHeads, kDim}, 51)};
  ExpectStatus(client_->AppendAttendBatch(0, batch).status(), absl::StatusCode::kInvalidArgument,
               "q.shape[0] = 1 must equal the 2 sequences (one row each, at least one)");
  ExpectUnchanged("s", before_);
}

TEST_F(ErrorPathTest, OversizedMessagesNameTheLimit) {
  absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->max_message_bytes(), 65536);
  // 80 fp32 queries of 4 x 64: 81920 bytes of q.
  AttendQuery query{"s", Random({80, kQHeads, kDim}, 22), {}, 0, 0};
  absl::Status attend = client_->Attend(0, {query}).status();
  ExpectStatus(attend, absl::StatusCode::kInvalidArgument, "exceeds max_message_bytes = 65536");
  EXPECT_TRUE(absl::StartsWith(attend.message(), "message of ")) << attend;
  // 40 tokens: k and v 20480 bytes each, q 40960.
  AppendAttendItem item{"s", Random({kHeads, 40, kDim}, 23), Random({kHeads, 40, kDim}, 24),
                        Random({40, kQHeads, kDim}, 25)};
  ExpectStatus(client_->AppendAttend(1, {item}).status(), absl::StatusCode::kInvalidArgument,
               "exceeds max_message_bytes = 65536");
  // A fetch may not ask for messages over the limit (the transport would
  // refuse to send them half-way through the stream).
  for (int chunk : {65537, -1}) {
    FetchOptions fetch;
    fetch.max_chunk_bytes = chunk;
    ExpectStatus(client_->FetchDequant("s", fetch).status(), absl::StatusCode::kInvalidArgument,
                 absl::StrCat("max_chunk_bytes = ", chunk,
                              " must be in [0, max_message_bytes = 65536] (0: the server's default)"));
  }
  ExpectUnchanged("s", before_);
  // Below the limit the same calls succeed.
  query.q = Random({8, kQHeads, kDim}, 26);
  EXPECT_TRUE(client_->Attend(0, {query}).ok());
  FetchOptions fetch;
  fetch.max_chunk_bytes = 65536;
  EXPECT_TRUE(client_->FetchDequant("s", fetch).ok());
}

// ------------------------------------------------------------ concurrency

TEST_F(ServerBehaviorTest, ConcurrentAppendsKeepEverySequenceExact) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}, "conc"));
  constexpr int kOwnThreads = 4, kRounds = 5, kRoundTokens = 64;
  constexpr int kSharedThreads = 2, kSharedSteps = 24;
  for (int t = 0; t < kOwnThreads; ++t) ASSERT_NO_FATAL_FAILURE(Create(absl::StrCat("own", t)));
  ASSERT_NO_FATAL_FAILURE(Create("shared"));

  std::vector<std::vector<std::pair<HostTensor, HostTensor>>> own(kOwnThreads);
  for (int t = 0; t < kOwnThreads; ++t) {
    for (int r = 0; r < kRounds; ++r) {
      own[t].emplace_back(Random({kLayers, kHeads, kRoundTokens, kDim}, 1000 + 10 * t + r),
                          Random({kLayers, kHeads, kRoundTokens, kDim}, 2000 + 10 * t + r));
    }
  }
  // Shared-sequence tokens are fp16 and stay in the fp16 residual window
  // (48 < 128 tokens): the server stores them exactly.
  // shared[t][step] = (k, v) of one token, [kv_heads, 1, head_dim].
  std::vector<std::vector<std::pair<HostTensor, HostTensor>>> shared(kSharedThreads);
  for (int t = 0; t < kSharedThreads; ++t) {
    for (int s = 0; s < kSharedSteps; ++s) {
      shared[t].emplace_back(Random({kHeads, 1, kDim}, 3000 + 100 * t + s).Cast(DType::kFloat16),
                             Random({kHeads, 1, kDim}, 4000 + 100 * t + s).Cast(DType::kFloat16));
    }
  }

  std::vector<absl::Status> results(kOwnThreads + kSharedThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kOwnThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string id = absl::StrCat("own", t);
      for (int r = 0; r < kRounds; ++r) {
        AppendOptions options;
        options.max_chunk_bytes = 16 << 10;
        absl::StatusOr<AppendResult> a =
            client_->AppendPrompt(id, own[t][r].first, own[t][r].second, options);
        if (!a.ok()) return void(results[t] = a.status());
        if (a->num_tokens != (r + 1) * kRoundTokens) {
          return void(results[t] = absl::InternalError(
                          absl::StrCat(id, " holds ", a->num_tokens, " tokens after round ", r)));
        }
        AttendQuery query{id, Random({2, kQHeads, kDim}, 5000 + t), {}, 0, 0};
        absl::StatusOr<std::vector<AttendOutput>> out = client_->Attend(r % kLayers, {query});
        if (!out.ok()) return void(results[t] = out.status());
        for (float l : (*out)[0].lse.ToFloats()) {
          if (!std::isfinite(l)) return void(results[t] = absl::InternalError("lse not finite"));
        }
      }
    });
  }
  for (int t = 0; t < kSharedThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int s = 0; s < kSharedSteps; ++s) {
        for (int layer = 0; layer < kLayers; ++layer) {
          AppendAttendItem item{"shared", shared[t][s].first, shared[t][s].second,
                                Random({1, kQHeads, kDim}, 6000 + s)};
          absl::StatusOr<std::vector<AttendOutput>> out = client_->AppendAttend(layer, {item});
          if (!out.ok()) return void(results[kOwnThreads + t] = out.status());
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (size_t i = 0; i < results.size(); ++i) ASSERT_TRUE(results[i].ok()) << i << ": " << results[i];

  FetchOptions fetch;
  fetch.dtype = DType::kFloat32;
  for (int t = 0; t < kOwnThreads; ++t) {
    SCOPED_TRACE(absl::StrCat("own", t));
    const std::string id = absl::StrCat("own", t);
    absl::StatusOr<v1::StatsResponse> stats = client_->Stats(id);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->num_tokens(), kRounds * kRoundTokens);
    absl::StatusOr<FetchedKv> got = client_->FetchDequant(id, fetch);
    ASSERT_TRUE(got.ok()) << got.status();
    const FetchedKv want = LocalDequant(Config(), own[t]);
    EXPECT_EQ(got->k.shape, (std::vector<int64_t>{kLayers, kHeads, kRounds * kRoundTokens, kDim}));
    EXPECT_TRUE(got->k == want.k);
    EXPECT_TRUE(got->v == want.v);
  }

  // The shared sequence: every layer holds each thread's tokens exactly
  // once, each thread's in the order it sent them.
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats("shared");
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->num_tokens(), kSharedThreads * kSharedSteps);
  std::map<std::vector<float>, std::pair<int, int>> owner;  // k and v floats -> (thread, step)
  auto row = [](const std::vector<float>& k, const std::vector<float>& v, int64_t tokens,
                int64_t t) {
    std::vector<float> r;
    for (const std::vector<float>* x : {&k, &v}) {
      for (int h = 0; h < kHeads; ++h) {
        const float* p = x->data() + (h * tokens + t) * kDim;
        r.insert(r.end(), p, p + kDim);
      }
    }
    return r;
  };
  for (int t = 0; t < kSharedThreads; ++t) {
    for (int s = 0; s < kSharedSteps; ++s) {
      owner[row(shared[t][s].first.ToFloats(), shared[t][s].second.ToFloats(), 1, 0)] = {t, s};
    }
  }
  for (int layer = 0; layer < kLayers; ++layer) {
    SCOPED_TRACE(absl::StrCat("shared, layer ", layer));
    fetch.layer_begin = layer;
    fetch.layer_end = layer + 1;
    absl::StatusOr<FetchedKv> got = client_->FetchDequant("shared", fetch);
    ASSERT_TRUE(got.ok()) << got.status();
    const int64_t tokens = got->k.shape[2];
    ASSERT_EQ(tokens, kSharedThreads * kSharedSteps);
    const std::vector<float> k = got->k.ToFloats(), v = got->v.ToFloats();
    std::vector<int> next(kSharedThreads, 0);
    for (int64_t i = 0; i < tokens; ++i) {
      auto it = owner.find(row(k, v, tokens, i));
      ASSERT_NE(it, owner.end()) << "token " << i << " is none of the appended tokens";
      const auto [t, s] = it->second;
      ASSERT_EQ(s, next[t]) << "token " << i << ": thread " << t << " step out of order";
      ++next[t];
    }
  }
}

// ------------------------------------------------------------ cancellation

TEST_F(ServerBehaviorTest, CancelledAppendStreamStoresNothingAndFreesItsPages) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}, "cancel"));
  ASSERT_NO_FATAL_FAILURE(Create("c"));
  ASSERT_NO_FATAL_FAILURE(Append("c", Random({kLayers, kHeads, 100, kDim}, 30),
                                 Random({kLayers, kHeads, 100, kDim}, 31)));
  const Snapshot before = Take("c");
  ASSERT_EQ(before.num_tokens, 100);
  const int64_t used_before = ServerStats().used_bytes();

  {
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w = stub_->Append(&ctx, &resp);
    v1::AppendRequest first;
    first.mutable_sequence()->set_namespace_("cancel");
    first.mutable_sequence()->set_sequence_id("c");
    *first.mutable_chunk() = Chunk(Random({kLayers, kHeads, 192, kDim}, 32),
                                   Random({kLayers, kHeads, 192, kDim}, 33));
    ASSERT_TRUE(w->Write(first));
    v1::AppendRequest second;
    *second.mutable_chunk() = Chunk(Random({kLayers, kHeads, 64, kDim}, 34),
                                    Random({kLayers, kHeads, 64, kDim}, 35));
    ASSERT_TRUE(w->Write(second));
    // The uncommitted tokens hold pages while the stream is open.
    EXPECT_TRUE(PollUntil([&] { return ServerStats().used_bytes() > used_before; }))
        << "the open stream never took pages";
    ctx.TryCancel();
    const grpc::Status st = w->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  }
  int64_t used_now = -1;
  EXPECT_TRUE(PollUntil([&] { return (used_now = ServerStats().used_bytes()) == used_before; }))
      << "used_bytes " << used_now << ", " << used_before << " before the stream";
  ExpectUnchanged("c", before);
  // The sequence takes appends again (the cancelled transaction is over).
  ASSERT_NO_FATAL_FAILURE(Append("c", Random({kLayers, kHeads, 10, kDim}, 36),
                                 Random({kLayers, kHeads, 10, kDim}, 37)));
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats("c");
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->num_tokens(), 110);
}

// ------------------------------------------------------------ leases

TEST_F(ServerBehaviorTest, ExpiredLeaseReturnsThePages) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--default_ttl_seconds=1"}, "ttl"));
  const v1::StatsResponse before = ServerStats();
  ASSERT_NO_FATAL_FAILURE(Create("t"));
  ASSERT_NO_FATAL_FAILURE(Append("t", Random({kLayers, kHeads, 200, kDim}, 40),
                                 Random({kLayers, kHeads, 200, kDim}, 41)));
  // Server-wide Stats does not touch the sequence's lease.
  EXPECT_GT(ServerStats().used_bytes(), before.used_bytes());
  v1::StatsResponse now;
  EXPECT_TRUE(PollUntil([&] {
    now = ServerStats();
    return now.sequences() == 0 && now.used_bytes() == before.used_bytes();
  })) << "after the lease: " << now.sequences() << " sequences, used_bytes "
      << now.used_bytes() << " (" << before.used_bytes() << " before)";
  EXPECT_EQ(now.bytes().total(), 0);
  ExpectStatus(client_->Stats("t").status(), absl::StatusCode::kNotFound,
               "sequence \"t\" in namespace \"ttl\" expired: its lease ran out while idle");
  ExpectStatus(client_->FetchDequant("t").status(), absl::StatusCode::kNotFound, "expired");
}

// ------------------------------------------------------------ eviction

TEST_F(ServerBehaviorTest, EvictionNeverReturnsStaleData) {
  ASSERT_NO_FATAL_FAILURE(StartServer(
      {"--evict", "--capacity_bytes=8388608", "--slab_bytes=65536"}, "evict"));
  constexpr int kTokens = 384;
  auto data = [](int i) {
    return std::make_pair(Random({kLayers, kHeads, kTokens, kDim}, 7000 + 2 * i),
                          Random({kLayers, kHeads, kTokens, kDim}, 7001 + 2 * i));
  };
  // Enough sequences to need about three times the pool.
  int count = 0;
  int64_t stored = 0;
  for (int i = 0; i < 400 && stored < 3 * int64_t{8 << 20}; ++i) {
    const std::string id = absl::StrCat("e", i);
    ASSERT_NO_FATAL_FAILURE(Create(id));
    const auto [k, v] = data(i);
    AppendOptions options;
    options.max_chunk_bytes = 64 << 10;
    absl::StatusOr<AppendResult> r = client_->AppendPrompt(id, k, v, options);
    ASSERT_TRUE(r.ok()) << id << ": " << r.status();
    stored += r->bytes_stored;
    count = i + 1;
  }
  int alive = 0, evicted = 0;
  FetchOptions fetch;
  fetch.dtype = DType::kFloat32;
  for (int i = 0; i < count; ++i) {
    const std::string id = absl::StrCat("e", i);
    SCOPED_TRACE(id);
    absl::StatusOr<FetchedKv> got = client_->FetchDequant(id, fetch);
    if (!got.ok()) {
      ExpectStatus(got.status(), absl::StatusCode::kNotFound,
                   absl::StrCat("sequence \"", id,
                                "\" in namespace \"evict\" was evicted to free memory; "
                                "recompute it"));
      ++evicted;
      continue;
    }
    ++alive;
    const auto [k, v] = data(i);
    const FetchedKv want = LocalDequant(Config(), {{k, v}});
    ASSERT_EQ(got->k.shape, want.k.shape);
    EXPECT_TRUE(got->k == want.k);
    EXPECT_TRUE(got->v == want.v);
  }
  EXPECT_GT(evicted, 0);
  EXPECT_GT(alive, 0);
  // The newest sequence was never the one to go.
  EXPECT_TRUE(client_->Stats(absl::StrCat("e", count - 1)).ok());
  const v1::StatsResponse stats = ServerStats();
  EXPECT_EQ(stats.sequences(), alive);
  EXPECT_LE(stats.used_bytes(), stats.capacity_bytes());
}

// ------------------------------------------------------------ metrics

TEST_F(ServerBehaviorTest, MetricsAgreeWithStats) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}, "met"));
  absl::StatusOr<std::string> metrics_address = server_->MetricsAddress();
  ASSERT_TRUE(metrics_address.ok()) << metrics_address.status();
  for (int i = 0; i < 3; ++i) {
    const std::string id = absl::StrCat("m", i);
    ASSERT_NO_FATAL_FAILURE(Create(id));
    ASSERT_NO_FATAL_FAILURE(Append(id, Random({kLayers, kHeads, 150 + 50 * i, kDim}, 50 + i),
                                   Random({kLayers, kHeads, 150 + 50 * i, kDim}, 60 + i)));
  }
  ASSERT_TRUE(client_->Release("m1").ok());
  constexpr int kRejected = 3;
  for (int i = 0; i < kRejected; ++i) {
    AttendQuery query{"m0", Random({1, 3, kDim}, 70 + i), {}, 0, 0};
    ExpectStatus(client_->Attend(0, {query}).status(), absl::StatusCode::kInvalidArgument,
                 "items[0].q.shape = [1, 3, 64], expected [n, 4, 64]");
  }
  AttendQuery good{"m0", Random({1, kQHeads, kDim}, 80), {}, 0, 0};
  ASSERT_TRUE(client_->Attend(1, {good}).ok());

  const v1::StatsResponse stats = ServerStats();
  absl::StatusOr<std::string> body = HttpGetMetrics(*metrics_address);
  ASSERT_TRUE(body.ok()) << body.status();
  const std::vector<Sample> samples = ParseMetrics(*body);
  ASSERT_FALSE(samples.empty()) << *body;

  EXPECT_EQ(MetricValue(samples, "kvq_used_bytes", {{"tier", "host"}}),
            static_cast<double>(stats.used_bytes()));
  EXPECT_GT(stats.used_bytes(), 0);
  EXPECT_EQ(MetricValue(samples, "kvq_kv_bytes", {{"tier", "host"}}),
            static_cast<double>(stats.bytes().total()));
  EXPECT_GT(stats.bytes().total(), 0);
  EXPECT_EQ(stats.sequences(), 2);
  EXPECT_EQ(MetricValue(samples, "kvq_sequences", {{"state", "active"}}), 2.0);
  // The server holds two sequences' streams and its gRPC state on the heap
  // (zero only in a sanitizer build, whose allocator is not glibc's).
  if (kMallocIsGlibc) {
    EXPECT_GT(MetricValue(samples, "kvq_heap_bytes", {{"state", "in_use"}}), 1 << 20);
  }
  EXPECT_GE(MetricValue(samples, "kvq_heap_bytes", {{"state", "free"}}), 0.0);
  EXPECT_EQ(MetricValue(samples, "kvq_rpc_requests_total",
                        {{"method", "Attend"}, {"code", "INVALID_ARGUMENT"}}),
            static_cast<double>(kRejected));
  EXPECT_EQ(MetricValue(samples, "kvq_rpc_requests_total", {{"method", "Attend"}, {"code", "OK"}}),
            1.0);
  // Only the accepted Attend reached the kernels, inside its RPC's time.
  EXPECT_EQ(MetricValue(samples, "kvq_attention_kernel_seconds_count", {{"method", "Attend"}}),
            1.0);
  EXPECT_EQ(
      MetricValue(samples, "kvq_attention_kernel_seconds_count", {{"method", "DecodeStream"}}),
      0.0);
  const double kernel =
      MetricValue(samples, "kvq_attention_kernel_seconds_sum", {{"method", "Attend"}});
  EXPECT_GT(kernel, 0.0);
  EXPECT_LT(kernel, MetricValue(samples, "kvq_rpc_duration_seconds_sum", {{"method", "Attend"}}));
}

// ------------------------------------------------------------ shutdown

TEST_F(ServerBehaviorTest, SigtermShutsDownCleanly) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}, "down"));
  ASSERT_TRUE(client_->GetServerInfo().ok());
  // Wait for the start-up lines, so the signal handler is installed.
  ASSERT_TRUE(server_->MetricsAddress().ok()) << server_->Stdout();
  absl::StatusOr<int> status = server_->Terminate();
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_TRUE(WIFEXITED(*status)) << "status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 0);
  EXPECT_TRUE(absl::StrContains(server_->Stdout(), "kvq-server: shutting down"))
      << server_->Stdout();
}

}  // namespace
}  // namespace kvq
