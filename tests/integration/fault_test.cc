// Faults against the real kvq-server through the real C++ client (and a raw
// stub where a stream must be left half done): storms of cancelled and
// abandoned streams, clients killed without releasing, the server killed
// with SIGKILL under load and restarted, and a full pool under concurrent
// appends. docs/RELIABILITY.md ("Faults") says what each shows.
//
// The binary is its own killable client: run with --fault_child it opens
// streams against a server and waits to be killed (FaultChildMain).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "client/local_sequence.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/integration/server_client_fixture.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_helpers.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64;
constexpr char kScheme[] = "kivi2:g32:r128";
// The sequence every killed child streams from: big enough (8 MiB as fp32)
// that a fetch is still in flight when the child dies.
constexpr int kBigTokens = 2048;

SequenceConfig Config() {
  SequenceConfig c;
  c.layout = {kLayers, kHeads, kQHeads, kDim, {}};
  c.scheme = kScheme;
  return c;
}

v1::KvChunk Chunk(const HostTensor& k, const HostTensor& v) {
  v1::KvChunk c;
  ToProto(k, c.mutable_k());
  ToProto(v, c.mutable_v());
  return c;
}

// The pool's figures a fault must leave as they were: the bytes in use and
// the sequences, exactly. The slabs they sit in are reported but not
// compared: an append that is undone gives its sequence back its
// copy-on-write snapshot, whose blocks were allocated during the storm and
// may sit in another slab (same bytes, one more slab: seen once under load).
struct Figure {
  int64_t used_bytes = -1;
  int64_t slabs_used = -1;
  int64_t sequences = -1;
  bool operator==(const Figure& o) const {
    return used_bytes == o.used_bytes && sequences == o.sequences;
  }
};

std::string Describe(const Figure& f) {
  return absl::StrCat(f.used_bytes, " bytes in ", f.slabs_used, " slabs, ", f.sequences,
                      " sequences");
}

// ------------------------------------------------------------ the child

// --fault_child ADDRESS NAMESPACE BIG_ID PREFIX TTL_SECONDS: creates
// PREFIX_own0 and PREFIX_own1 (TTL_SECONDS leases, 200 tokens each), then
// leaves three streams open: an uncommitted Append to PREFIX_own0, a fetch
// of BIG_ID with one message read, a DecodeStream on PREFIX_own1 with a
// step written and not read. Prints "ready" and waits (at most two
// minutes) to be killed.
int FaultChildMain(int argc, char** argv) {
  if (argc != 7) {
    std::printf("error: usage: --fault_child ADDRESS NAMESPACE BIG_ID PREFIX TTL_SECONDS\n");
    return 2;
  }
  const std::string address = argv[2], ns = argv[3], big = argv[4], prefix = argv[5];
  uint32_t ttl = 0;
  if (!absl::SimpleAtoi(argv[6], &ttl)) return 2;
  auto fail = [](const std::string& what, const absl::Status& st) {
    std::printf("error: %s: %s\n", what.c_str(), st.ToString().c_str());
    std::fflush(stdout);
    return 1;
  };
  ClientOptions options;
  options.target = address;
  options.ns = ns;
  absl::StatusOr<std::unique_ptr<KvqClient>> client = KvqClient::Connect(options);
  if (!client.ok()) return fail("connect", client.status());
  for (int i = 0; i < 2; ++i) {
    CreateOptions create;
    create.sequence_id = absl::StrCat(prefix, "_own", i);
    create.config = Config();
    create.ttl_seconds = ttl;
    absl::StatusOr<SequenceInfo> info = (*client)->CreateSequence(create);
    if (!info.ok()) return fail("create", info.status());
    absl::StatusOr<AppendResult> appended =
        (*client)->AppendPrompt(create.sequence_id, Random({kLayers, kHeads, 200, kDim}, 900 + i),
                                Random({kLayers, kHeads, 200, kDim}, 910 + i));
    if (!appended.ok()) return fail("append", appended.status());
  }
  std::unique_ptr<v1::KvCache::Stub> stub =
      v1::KvCache::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));

  grpc::ClientContext append_ctx;
  v1::AppendResponse append_resp;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer =
      stub->Append(&append_ctx, &append_resp);
  v1::AppendRequest request;
  request.mutable_sequence()->set_namespace_(ns);
  request.mutable_sequence()->set_sequence_id(absl::StrCat(prefix, "_own0"));
  *request.mutable_chunk() =
      Chunk(Random({kLayers, kHeads, 64, kDim}, 920), Random({kLayers, kHeads, 64, kDim}, 921));
  if (!writer->Write(request)) return fail("append stream", absl::UnavailableError("write"));

  grpc::ClientContext fetch_ctx;
  v1::FetchRequest fetch;
  fetch.mutable_sequence()->set_namespace_(ns);
  fetch.mutable_sequence()->set_sequence_id(big);
  fetch.set_dtype(v1::DTYPE_FP32);
  fetch.set_max_chunk_bytes(64 << 10);
  std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> reader =
      stub->FetchDequant(&fetch_ctx, fetch);
  v1::FetchResponse first;
  if (!reader->Read(&first)) return fail("fetch stream", absl::UnavailableError("read"));

  absl::StatusOr<std::unique_ptr<DecodeSession>> session = (*client)->OpenDecodeSession();
  if (!session.ok()) return fail("decode stream", session.status());
  AppendAttendItem item{
      absl::StrCat(prefix, "_own1"), Random({kHeads, 1, kDim}, 930).Cast(DType::kFloat16),
      Random({kHeads, 1, kDim}, 931).Cast(DType::kFloat16), Random({1, kQHeads, kDim}, 932)};
  absl::StatusOr<std::vector<AttendOutput>> step = (*session)->Step(0, {item});
  if (!step.ok()) return fail("decode step", step.status());
  absl::Status written = (*session)->Write(1, {item});
  if (!written.ok()) return fail("decode write", written);

  std::printf("ready\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Minutes(2));
  std::printf("error: not killed within two minutes\n");
  return 3;
}

// A --fault_child process of this binary, its stdout on a pipe.
class FaultChild {
 public:
  ~FaultChild() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }

  absl::Status Start(const std::vector<std::string>& args) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
    std::vector<std::string> argv = {"/proc/self/exe", "--fault_child"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (std::string& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    pid_ = fork();
    if (pid_ < 0) return absl::InternalError("fork failed");
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      execv(cargv[0], cargv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fds[0];
    return absl::OkStatus();
  }

  // Reads the child's output until its "ready" line (bounded).
  absl::Status WaitReady() {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (!absl::StrContains(output_, "ready\n")) {
      const int left = static_cast<int>(absl::ToInt64Milliseconds(give_up - absl::Now()));
      if (left <= 0) return absl::DeadlineExceededError("the child never got ready: " + output_);
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, left) <= 0) continue;
      char buf[512];
      const ssize_t n = read(out_, buf, sizeof(buf));
      if (n <= 0) return absl::InternalError("the child exited: " + output_);
      output_.append(buf, n);
    }
    return absl::OkStatus();
  }

  // SIGKILL and reap; true when it died of that signal.
  bool Kill() {
    kill(pid_, SIGKILL);
    int status = 0;
    const bool reaped = waitpid(pid_, &status, 0) == pid_;
    pid_ = -1;
    return reaped && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  std::string output_;
};

// ------------------------------------------------------------ fixture

class FaultTest : public ServerClientFixture {
 protected:
  void CreateAndAppend(const std::string& id, const HostTensor& k, const HostTensor& v) {
    CreateOptions create;
    create.sequence_id = id;
    create.config = Config();
    absl::StatusOr<SequenceInfo> info = client_->CreateSequence(create);
    ASSERT_TRUE(info.ok()) << id << ": " << info.status();
    AppendOptions options;
    options.max_chunk_bytes = 64 << 10;
    absl::StatusOr<AppendResult> r = client_->AppendPrompt(id, k, v, options);
    ASSERT_TRUE(r.ok()) << id << ": " << r.status();
  }

  Figure Now() {
    absl::StatusOr<v1::StatsResponse> stats = client_->Stats("");
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!stats.ok()) return {};
    return {stats->used_bytes(), stats->pages_used(), stats->sequences()};
  }

  // Polls until the pool shows `want` again (bounded) and expects it.
  void ExpectBackTo(const Figure& want, absl::Duration bound = absl::Seconds(20)) {
    Figure now;
    EXPECT_TRUE(PollUntil([&] { return (now = Now()) == want; }, bound))
        << "now " << Describe(now) << "; at the start " << Describe(want);
  }

  FetchedKv Fetch(const std::string& id) {
    FetchOptions fetch;
    fetch.dtype = DType::kFloat32;
    absl::StatusOr<FetchedKv> got = client_->FetchDequant(id, fetch);
    EXPECT_TRUE(got.ok()) << id << ": " << got.status();
    return got.ok() ? *got : FetchedKv();
  }

  void ExpectHolds(const std::string& id, const FetchedKv& want) {
    const FetchedKv got = Fetch(id);
    EXPECT_EQ(got.k.shape, want.k.shape) << id;
    EXPECT_TRUE(got.k == want.k) << id << ": keys differ";
    EXPECT_TRUE(got.v == want.v) << id << ": values differ";
  }
};

// ------------------------------------------------------------ storms

// Four threads abandon streams every way a client can: Append streams
// cancelled or past their deadline with chunks uncommitted, fetches (dense
// and raw pages) cancelled after one message or past their deadline,
// DecodeStreams dropped with a step unread; then a child process dies with
// one of each open. The pool comes back to its figure before the storm
// exactly, and the sequences the storm appended to hold what they held.
TEST_F(FaultTest, CancelAndDisconnectStormsReturnThePoolToItsStartingFigure) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}, "storm"));
  const HostTensor big_k = Random({kLayers, kHeads, kBigTokens, kDim}, 1);
  const HostTensor big_v = Random({kLayers, kHeads, kBigTokens, kDim}, 2);
  ASSERT_NO_FATAL_FAILURE(CreateAndAppend("big", big_k, big_v));
  const FetchedKv big_before = Fetch("big");
  constexpr int kThreads = 4, kRounds = 10, kKinds = 6;
  std::vector<FetchedKv> before(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    const std::string id = absl::StrCat("a", t);
    ASSERT_NO_FATAL_FAILURE(CreateAndAppend(id, Random({kLayers, kHeads, 100, kDim}, 10 + t),
                                            Random({kLayers, kHeads, 100, kDim}, 20 + t)));
    before[t] = Fetch(id);
  }
  const Figure start = Now();

  // What each abandoned call ended with: kind -> (expected code, got).
  std::vector<std::vector<std::string>> problems(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto expect = [&](int kind, grpc::StatusCode want, const grpc::Status& got) {
        if (got.error_code() != want) {
          problems[t].push_back(absl::StrCat("kind ", kind, ": code ", got.error_code(), " (",
                                             got.error_message(), "), expected ", want));
        }
      };
      const std::string own = absl::StrCat("a", t);
      for (int r = 0; r < kRounds; ++r) {
        const int kind = (t + r) % kKinds;
        grpc::ClientContext ctx;
        if (kind == 0 || kind == 1) {
          // Append: two chunks, then cancelled (0) or left past a deadline (1).
          if (kind == 1)
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
          v1::AppendResponse resp;
          std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w = stub_->Append(&ctx, &resp);
          for (int c = 0; c < 2; ++c) {
            v1::AppendRequest req;
            req.mutable_sequence()->set_namespace_("storm");
            req.mutable_sequence()->set_sequence_id(own);
            *req.mutable_chunk() = Chunk(Random({kLayers, kHeads, 96, kDim}, 100 * t + 2 * r + c),
                                         Random({kLayers, kHeads, 96, kDim}, 50 + r));
            w->Write(req);
          }
          if (kind == 0) {
            ctx.TryCancel();
          } else {
            absl::SleepFor(absl::Milliseconds(500));
          }
          expect(kind,
                 kind == 0 ? grpc::StatusCode::CANCELLED : grpc::StatusCode::DEADLINE_EXCEEDED,
                 w->Finish());
        } else if (kind == 2 || kind == 3) {
          // Fetch of the big sequence, cancelled after one message: dense
          // (2) or raw pages (3), which the server references until sent.
          v1::FetchRequest req;
          req.mutable_sequence()->set_namespace_("storm");
          req.mutable_sequence()->set_sequence_id("big");
          req.set_max_chunk_bytes(16 << 10);
          if (kind == 2) {
            req.set_dtype(v1::DTYPE_FP32);
          } else {
            req.set_raw(true);
            req.set_token_end(kBigTokens - 128);  // The quantized part (r128).
          }
          std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> reader =
              stub_->FetchDequant(&ctx, req);
          v1::FetchResponse msg;
          if (!reader->Read(&msg)) {
            problems[t].push_back(absl::StrCat("kind ", kind, ": no first message"));
          }
          ctx.TryCancel();
          while (reader->Read(&msg)) {
          }
          expect(kind, grpc::StatusCode::CANCELLED, reader->Finish());
        } else if (kind == 4) {
          // The client library's fetch with a 1 ms deadline (retried, each
          // attempt as short): DEADLINE_EXCEEDED, or, when the 8 MiB did
          // arrive in time (gRPC's deadline timer may fire late), the whole
          // range, never part of it.
          FetchOptions fetch;
          fetch.dtype = DType::kFloat32;
          fetch.call.deadline = absl::Milliseconds(1);
          const absl::StatusOr<FetchedKv> got = client_->FetchDequant("big", fetch);
          if (got.ok()) {
            if (!(got->k == big_before.k && got->v == big_before.v)) {
              problems[t].push_back("kind 4: OK with other than the stored values");
            }
          } else if (got.status().code() != absl::StatusCode::kDeadlineExceeded) {
            problems[t].push_back(absl::StrCat("kind 4: ", got.status().ToString()));
          }
        } else {
          // A DecodeStream dropped with a step written and not read, on a
          // sequence of its own, which is then released.
          const std::string id = absl::StrCat("d", t, "_", r);
          CreateOptions create;
          create.sequence_id = id;
          create.config = Config();
          absl::Status st = client_->CreateSequence(create).status();
          if (st.ok()) {
            st = client_
                     ->AppendPrompt(id, Random({kLayers, kHeads, 40, kDim}, 60 + r),
                                    Random({kLayers, kHeads, 40, kDim}, 70 + r))
                     .status();
          }
          absl::StatusOr<std::unique_ptr<DecodeSession>> session = client_->OpenDecodeSession();
          if (st.ok()) st = session.status();
          if (st.ok()) {
            AppendAttendItem item{id, Random({kHeads, 1, kDim}, 80 + r).Cast(DType::kFloat16),
                                  Random({kHeads, 1, kDim}, 90 + r).Cast(DType::kFloat16),
                                  Random({1, kQHeads, kDim}, 95 + r)};
            st = (*session)->Step(0, {item}).status();
            if (st.ok()) st = (*session)->Write(1, {item});
            session->reset();  // Cancels the stream.
          }
          if (st.ok()) st = client_->Release(id).status();
          if (!st.ok()) problems[t].push_back(absl::StrCat("kind 5: ", st.ToString()));
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    for (const std::string& p : problems[t]) ADD_FAILURE() << "thread " << t << ": " << p;
  }

  // A client process dies with an append, a fetch and a decode stream open.
  FaultChild child;
  ASSERT_TRUE(child.Start({server_->address(), "storm", "big", "child", "600"}).ok());
  absl::Status ready = child.WaitReady();
  ASSERT_TRUE(ready.ok()) << ready;
  EXPECT_EQ(Now().sequences, start.sequences + 2);
  ASSERT_TRUE(child.Kill());
  // Its two sequences are the parent's to release now (the next test leaves
  // them to their leases).
  for (const char* id : {"child_own0", "child_own1"}) {
    absl::StatusOr<int64_t> freed = client_->Release(id);
    EXPECT_TRUE(freed.ok()) << id << ": " << freed.status();
  }

  ExpectBackTo(start);
  std::printf(
      "storm: %d streams abandoned by %d threads and one killed client process; pool "
      "back to %s\n",
      kThreads * kRounds, kThreads, Describe(Now()).c_str());
  for (int t = 0; t < kThreads; ++t) ExpectHolds(absl::StrCat("a", t), before[t]);
  absl::StatusOr<v1::StatsResponse> big = client_->Stats("big");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->num_tokens(), kBigTokens);
  // And the storm's sequences take appends again.
  AppendOptions options;
  EXPECT_TRUE(client_
                  ->AppendPrompt("a0", Random({kLayers, kHeads, 8, kDim}, 5),
                                 Random({kLayers, kHeads, 8, kDim}, 6), options)
                  .ok());
}

// ------------------------------------------------------------ leases

// A client process creates two sequences with a 1-second lease, opens an
// append, a fetch and a decode stream, and is killed without releasing
// anything: once the server has seen the connections go, the leases expire
// and the reaper (every second) returns every page.
TEST_F(FaultTest, ClientsKilledWithoutReleaseAreFreedByTheirLeases) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}, "lease"));
  ASSERT_NO_FATAL_FAILURE(CreateAndAppend("big", Random({kLayers, kHeads, kBigTokens, kDim}, 3),
                                          Random({kLayers, kHeads, kBigTokens, kDim}, 4)));
  const Figure start = Now();
  FaultChild child;
  ASSERT_TRUE(child.Start({server_->address(), "lease", "big", "dead", "1"}).ok());
  absl::Status ready = child.WaitReady();
  ASSERT_TRUE(ready.ok()) << ready;
  const Figure held = Now();
  EXPECT_EQ(held.sequences, start.sequences + 2);
  EXPECT_GT(held.used_bytes, start.used_bytes);
  ASSERT_TRUE(child.Kill());
  const absl::Time killed = absl::Now();
  // Lease 1 s + reaper 1 s; the bound only keeps a broken server from
  // hanging the test.
  ExpectBackTo(start, absl::Seconds(30));
  std::printf("leases: the killed client's %lld bytes back %.1f s after the kill\n",
              static_cast<long long>(held.used_bytes - start.used_bytes),
              absl::ToDoubleSeconds(absl::Now() - killed));
  for (const char* id : {"dead_own0", "dead_own1"}) {
    const absl::Status st = client_->Stats(id).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
    EXPECT_TRUE(absl::StrContains(
        st.message(),
        absl::StrCat("sequence \"", id,
                     "\" in namespace \"lease\" expired: its lease ran out while idle")))
        << st;
  }
  absl::StatusOr<v1::StatsResponse> big = client_->Stats("big");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->num_tokens(), kBigTokens);
}

// ------------------------------------------------------------ kill -9

// Four client threads call (Attend, AppendAttend, FetchDequant, Stats, and
// one DecodeStream held open) with a 3-second deadline while the server is
// killed with SIGKILL. Every call that starts after the kill fails with
// UNAVAILABLE, a call in flight at the kill ends OK (answered before it) or
// UNAVAILABLE, and each ends before its deadline plus a margin: nobody
// waits for a dead server. A server restarted on the same port serves new
// sequences to the same client.
TEST_F(FaultTest, KilledServerFailsEveryCallWithUnavailableAndARestartServes) {
  const absl::Duration deadline = absl::Seconds(3), margin = absl::Seconds(1);
  ASSERT_NO_FATAL_FAILURE(StartServer({}, "kill", deadline));
  constexpr int kThreads = 4;
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_NO_FATAL_FAILURE(CreateAndAppend(absl::StrCat("s", t),
                                            Random({kLayers, kHeads, 300, kDim}, 200 + t),
                                            Random({kLayers, kHeads, 300, kDim}, 210 + t)));
  }
  struct CallRecord {
    absl::Time start, end;
    absl::StatusCode code;
    std::string what;
  };
  std::vector<std::vector<CallRecord>> records(kThreads);
  std::atomic<bool> stop{false};
  std::vector<std::atomic<int>> ok_calls(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string id = absl::StrCat("s", t);
      std::unique_ptr<DecodeSession> session;
      if (t == 0) session = *client_->OpenDecodeSession(absl::Seconds(120));
      const AppendAttendItem item{id, Random({kHeads, 1, kDim}, 300 + t).Cast(DType::kFloat16),
                                  Random({kHeads, 1, kDim}, 310 + t).Cast(DType::kFloat16),
                                  Random({1, kQHeads, kDim}, 320 + t)};
      // Bounded in count as well as by `stop`.
      for (int i = 0; i < 100000 && !stop.load(); ++i) {
        const absl::Time begin = absl::Now();
        absl::Status st;
        std::string what;
        switch ((t + i) % 4) {
          case 0:
            if (session != nullptr) {
              what = "DecodeStream step";
              st = session->Step(i % kLayers, {item}).status();
            } else {
              what = "AppendAttend";
              st = client_->AppendAttend(i % kLayers, {item}).status();
            }
            break;
          case 1:
            what = "Attend";
            st = client_->Attend(i % kLayers, {AttendQuery{id, item.q, {}, 0, 0}}).status();
            break;
          case 2: {
            what = "FetchDequant";
            FetchOptions fetch;
            fetch.layer_begin = i % kLayers;
            fetch.layer_end = fetch.layer_begin + 1;
            st = client_->FetchDequant(id, fetch).status();
            break;
          }
          default:
            what = "Stats";
            st = client_->Stats(id).status();
        }
        records[t].push_back({begin, absl::Now(), st.code(), what + ": " + st.ToString()});
        if (st.ok()) ++ok_calls[t];
      }
    });
  }
  EXPECT_TRUE(PollUntil([&] {
    for (int t = 0; t < kThreads; ++t) {
      if (ok_calls[t].load() < 5) return false;
    }
    return true;
  }, absl::Seconds(20))) << "the clients never got going";
  const absl::Time killed = absl::Now();
  absl::StatusOr<int> status = server_->Kill(SIGKILL);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL) << *status;
  absl::SleepFor(absl::Seconds(2));
  stop = true;
  for (std::thread& th : threads) th.join();

  int after_all = 0, in_flight = 0;
  absl::Duration slowest = absl::ZeroDuration();
  for (int t = 0; t < kThreads; ++t) {
    int after = 0;
    for (const CallRecord& c : records[t]) {
      if (c.end < killed) continue;
      slowest = std::max(slowest, c.end - c.start);
      if (c.start < killed) ++in_flight;
      SCOPED_TRACE(absl::StrCat("thread ", t, ", ", c.what, ", started ",
                                absl::FormatDuration(c.start - killed), " after the kill"));
      if (c.start >= killed) {
        ++after;
        EXPECT_EQ(c.code, absl::StatusCode::kUnavailable);
      } else {
        EXPECT_TRUE(c.code == absl::StatusCode::kOk || c.code == absl::StatusCode::kUnavailable);
      }
      EXPECT_LT(c.end - c.start, deadline + margin);
    }
    EXPECT_GT(after, 0) << "thread " << t << " made no call after the kill";
    after_all += after;
  }
  std::printf(
      "kill -9: %d calls in flight at the kill and %d after it; the slowest took %.0f ms "
      "(deadline %.0f ms)\n",
      in_flight, after_all, absl::ToDoubleMilliseconds(slowest),
      absl::ToDoubleMilliseconds(deadline));

  // The same port, the same client: the channel reconnects (bounded wait).
  const std::string old_address = server_->address();
  const std::string port = old_address.substr(old_address.rfind(':') + 1);
  absl::Status restarted = server_->Start({absl::StrCat("--address=127.0.0.1:", port)});
  ASSERT_TRUE(restarted.ok()) << restarted;
  ASSERT_EQ(server_->address(), old_address);
  const absl::Time restarted_at = absl::Now();
  EXPECT_TRUE(PollUntil([&] { return client_->GetServerInfo().ok(); }, absl::Seconds(60)));
  const absl::Duration reconnect = absl::Now() - restarted_at;
  std::printf("kill -9: the restarted server answered the old client %.1f s after its start\n",
              absl::ToDoubleSeconds(reconnect));
  // ClientOptions::max_reconnect_backoff (1 s) bounds the channel's waits
  // (reconnection and re-resolution): about 3 s here; with gRPC's defaults
  // this took 8-13 s.
  EXPECT_LT(reconnect, absl::Seconds(6));
  // What the killed server held is gone; new sequences are served.
  EXPECT_EQ(client_->Stats("s0").status().code(), absl::StatusCode::kNotFound);
  const HostTensor k = Random({kLayers, kHeads, 200, kDim}, 400);
  const HostTensor v = Random({kLayers, kHeads, 200, kDim}, 401);
  ASSERT_NO_FATAL_FAILURE(CreateAndAppend("fresh", k, v));
  ExpectHolds("fresh", LocalDequant(Config(), {{k, v}}));
}

// ------------------------------------------------------------ full pool

// 24 sequences of 64 tokens each get 2048 more from 6 threads at once, half
// quantized by the client and half dense, in 64 KiB chunks, into a 6 MiB
// pool that holds about a third of them. Each append either stores all its tokens (fetched
// back exactly) or fails with RESOURCE_EXHAUSTED and leaves the sequence as
// it was; releasing everything empties the pool, which then takes a full
// sequence again.
TEST_F(FaultTest, FullPoolUnderConcurrentAppendsIsAllOrNothing) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--capacity_bytes=6291456"}, "full"));
  const Figure empty = Now();
  constexpr int kSeqs = 24, kThreads = 6, kFirst = 64, kMore = 2048;
  std::vector<std::pair<HostTensor, HostTensor>> first, more;
  for (int i = 0; i < kSeqs; ++i) {
    first.emplace_back(Random({kLayers, kHeads, kFirst, kDim}, 500 + i),
                       Random({kLayers, kHeads, kFirst, kDim}, 600 + i));
    more.emplace_back(Random({kLayers, kHeads, kMore, kDim}, 700 + i),
                      Random({kLayers, kHeads, kMore, kDim}, 800 + i));
    ASSERT_NO_FATAL_FAILURE(
        CreateAndAppend(absl::StrCat("f", i), first.back().first, first.back().second));
  }
  std::vector<absl::Status> results(kSeqs);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kSeqs; i += kThreads) {
        const std::string id = absl::StrCat("f", i);
        AppendOptions options;
        options.max_chunk_bytes = 64 << 10;
        options.start_tokens = kFirst;
        options.quantize_threads = 1;
        results[i] =
            i % 2 == 0
                ? client_->AppendPrompt(id, more[i].first, more[i].second, options).status()
                : client_
                      ->AppendPromptQuantized(id, Config(), more[i].first, more[i].second, options)
                      .status();
      }
    });
  }
  for (std::thread& th : threads) th.join();

  int stored = 0, rejected = 0;
  for (int i = 0; i < kSeqs; ++i) {
    const std::string id = absl::StrCat("f", i);
    SCOPED_TRACE(id);
    absl::StatusOr<v1::StatsResponse> stats = client_->Stats(id);
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (results[i].ok()) {
      ++stored;
      EXPECT_EQ(stats->num_tokens(), kFirst + kMore);
      ExpectHolds(id, LocalDequant(Config(), {first[i], more[i]}));
    } else {
      ++rejected;
      EXPECT_EQ(results[i].code(), absl::StatusCode::kResourceExhausted) << results[i];
      EXPECT_TRUE(absl::StrContains(results[i].message(), "page pool exhausted: a block of "))
          << results[i];
      EXPECT_EQ(stats->num_tokens(), kFirst);
      ExpectHolds(id, LocalDequant(Config(), {first[i]}));
    }
  }
  EXPECT_GT(stored, 0);
  EXPECT_GT(rejected, 0);
  std::printf("full pool: %d appends stored whole, %d rejected with nothing stored\n", stored,
              rejected);
  const Figure full = Now();
  EXPECT_EQ(full.sequences, kSeqs);
  EXPECT_LE(full.used_bytes, int64_t{6} << 20);

  for (int i = 0; i < kSeqs; ++i) EXPECT_TRUE(client_->Release(absl::StrCat("f", i)).ok());
  ExpectBackTo(empty);
  ASSERT_NO_FATAL_FAILURE(CreateAndAppend("again", more[0].first, more[0].second));
}

}  // namespace
}  // namespace kvq

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--fault_child") return kvq::FaultChildMain(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
