#include "tests/integration/history/workload.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "tests/integration/history/tcp_relay.h"

namespace kvq::history {
namespace {

// A failed call's effect: codes the server answers only when it refused or
// undid the call mean none; a deadline, a cancellation or a lost
// connection after the request was complete leaves it unknown.
Outcome OutcomeOf(const grpc::Status& st, bool request_complete) {
  if (st.ok()) return Outcome::kOk;
  switch (st.error_code()) {
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
      return request_complete ? Outcome::kIndeterminate : Outcome::kFailed;
    default:
      return Outcome::kFailed;
  }
}

uint64_t Fnv1a(const std::string& bytes, uint64_t h) {
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::vector<float> Floats(const v1::Tensor& t) {
  std::vector<float> out(t.data().size() / sizeof(float));
  if (t.dtype() == v1::DTYPE_FP32) std::memcpy(out.data(), t.data().data(), out.size() * 4);
  return out;
}

void SetQuery(const std::vector<float>& q, v1::Tensor* t) {
  t->set_dtype(v1::DTYPE_FP32);
  for (int64_t d : {int64_t{1}, int64_t{kQHeads}, int64_t{kHeadDim}}) t->add_shape(d);
  t->set_data(q.data(), q.size() * sizeof(float));
}

class Client {
 public:
  Client(const WorkloadOptions& o, int thread, History* h)
      : o_(o),
        thread_(thread),
        h_(h),
        rng_(o.seed * 1000003 + thread),
        stub_(v1::KvCache::NewStub(
            grpc::CreateChannel(o.target, grpc::InsecureChannelCredentials()))) {}

  void Run(absl::Time until) {
    while (absl::Now() < until) {
      if (Pick(100) < o_.pause_percent) {
        absl::SleepFor(o_.max_pause * (Pick(1000) / 1000.0));
        continue;
      }
      const std::string seq = Id(Pick(o_.sequences));
      const int r = Pick(97);
      if (r < 10) {
        Create(seq);
      } else if (r < 36) {
        Append(seq);
      } else if (r < 48) {
        AppendAttend(seq);
      } else if (r < 55) {
        Decode(seq);
      } else if (r < 62) {
        Fork(seq, Id(Pick(o_.sequences)));
      } else if (r < 68) {
        Release(seq);
      } else if (r < 82) {
        Fetch(seq);
      } else if (r < 94) {
        Attend(seq);
      } else {
        Stats();
      }
    }
  }

 private:
  int Pick(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }
  std::string Id(int i) const { return absl::StrCat("s", i); }
  v1::SequenceRef Ref(const std::string& id) const {
    v1::SequenceRef r;
    r.set_namespace_(o_.ns);
    r.set_sequence_id(id);
    return r;
  }
  void Deadline(grpc::ClientContext* ctx, absl::Duration d) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::microseconds(absl::ToInt64Microseconds(d)));
  }
  int64_t Begin(OpKind kind, const std::string& seq) {
    Op op;
    op.thread = thread_;
    op.kind = kind;
    op.seq = seq;
    return h_->Invoke(std::move(op));
  }

  void Create(const std::string& seq) {
    const int64_t id = Begin(OpKind::kCreate, seq);
    grpc::ClientContext ctx;
    Deadline(&ctx, o_.deadline);
    v1::CreateSequenceRequest req;
    req.set_namespace_(o_.ns);
    req.set_sequence_id(seq);
    *req.mutable_layout() = Layout();
    req.set_scheme("fp16");
    v1::CreateSequenceResponse resp;
    const grpc::Status st = stub_->CreateSequence(&ctx, req, &resp);
    h_->Answer(id, OutcomeOf(st, true), st.error_code(), st.error_message());
  }

  // A streamed Append of 1..3 chunks; sometimes cancelled mid-stream,
  // stalled past its deadline or cut off with its connection before the
  // half-close.
  void Append(const std::string& seq) {
    const int chunks = 1 + Pick(3);
    std::vector<int> sizes;
    int total = 0;
    for (int c = 0; c < chunks; ++c) total += sizes.emplace_back(1 + Pick(24));
    const int fate = Pick(100);  // < 12: cancel; < 20: deadline; < 26: drop; else commit.
    Op op;
    op.thread = thread_;
    op.kind = OpKind::kAppend;
    op.seq = seq;
    op.tokens = total;
    const int64_t id = h_->Invoke(std::move(op));
    grpc::ClientContext ctx;
    const bool stall = fate >= 12 && fate < 20;
    Deadline(&ctx, stall ? absl::Milliseconds(100) : o_.deadline);
    v1::AppendResponse resp;
    // A dropped connection: this call alone goes through a relay that is
    // then cut.
    std::unique_ptr<TcpRelay> relay;
    std::unique_ptr<v1::KvCache::Stub> relayed;
    if (fate >= 20 && fate < 26) {
      absl::StatusOr<std::unique_ptr<TcpRelay>> r = TcpRelay::Start(o_.target);
      if (r.ok()) {
        relay = std::move(*r);
        relayed = v1::KvCache::NewStub(
            grpc::CreateChannel(relay->address(), grpc::InsecureChannelCredentials()));
      }
    }
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w =
        (relayed ? relayed : stub_)->Append(&ctx, &resp);
    int first = 0;
    bool sent = true;
    for (int c = 0; c < chunks && sent; ++c) {
      v1::AppendRequest req;
      if (c == 0) *req.mutable_sequence() = Ref(seq);
      FillChunk(id, first, sizes[c], req.mutable_chunk());
      first += sizes[c];
      sent = w->Write(req);
      if (Pick(3) == 0) absl::SleepFor(absl::Microseconds(Pick(3000)));
    }
    bool complete = false;
    if (fate < 12) {
      ctx.TryCancel();
    } else if (relay != nullptr) {
      absl::SleepFor(absl::Milliseconds(2));  // Let some chunks reach the server.
      relay->Cut();
    } else {
      if (stall) absl::SleepFor(absl::Milliseconds(200));
      complete = sent && w->WritesDone();
    }
    const grpc::Status st = w->Finish();
    h_->Answer(id, OutcomeOf(st, complete), st.error_code(), st.error_message(),
               [&](Op& o) { o.answered_tokens = st.ok() ? resp.num_tokens() : -1; });
  }

  void AppendAttend(const std::string& seq) {
    Op op;
    op.thread = thread_;
    op.kind = OpKind::kAppendAttend;
    op.seq = seq;
    op.tokens = 1;
    const int64_t id = h_->Invoke(std::move(op));
    const std::vector<float> q = Query(id);
    v1::AppendAttendRequest req;
    v1::AppendAttendItem* item = req.add_items();
    *item->mutable_sequence() = Ref(seq);
    FillStep(id, item->mutable_k(), item->mutable_v());
    SetQuery(q, item->mutable_q());
    grpc::ClientContext ctx;
    Deadline(&ctx, o_.deadline);
    v1::AttendResponse resp;
    const grpc::Status st = stub_->AppendAttend(&ctx, req, &resp);
    h_->Answer(id, OutcomeOf(st, true), st.error_code(), st.error_message(), [&](Op& o) {
      o.q = q;
      if (st.ok() && resp.results_size() == 1) o.out = Floats(resp.results(0).out());
    });
  }

  // A DecodeStream of 1..4 steps, each one token on `seq`.
  void Decode(const std::string& seq) {
    grpc::ClientContext ctx;
    Deadline(&ctx, o_.deadline);
    std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> rw =
        stub_->DecodeStream(&ctx);
    const int steps = 1 + Pick(4);
    int64_t open = -1;  // A step written but not answered.
    std::vector<float> open_q;
    bool broken = false;
    for (int s = 0; s < steps && !broken; ++s) {
      Op op;
      op.thread = thread_;
      op.kind = OpKind::kDecodeStep;
      op.seq = seq;
      op.tokens = 1;
      open = h_->Invoke(std::move(op));
      open_q = Query(open);
      v1::DecodeRequest req;
      v1::AppendAttendItem* item = req.mutable_step()->add_items();
      *item->mutable_sequence() = Ref(seq);
      FillStep(open, item->mutable_k(), item->mutable_v());
      SetQuery(open_q, item->mutable_q());
      v1::DecodeResponse resp;
      if (!rw->Write(req) || !rw->Read(&resp)) {
        broken = true;
        break;
      }
      h_->Answer(open, Outcome::kOk, 0, "", [&](Op& o) {
        o.q = open_q;
        if (resp.result().results_size() == 1) o.out = Floats(resp.result().results(0).out());
      });
      open = -1;
    }
    rw->WritesDone();
    const grpc::Status st = rw->Finish();
    if (open >= 0) {
      // The step's request was written; a refusal (ABORTED, NOT_FOUND, ...)
      // ends the stream with that code.
      h_->Answer(open, st.ok() ? Outcome::kIndeterminate : OutcomeOf(st, true), st.error_code(),
                 st.error_message());
    }
  }

  void Fork(const std::string& source, const std::string& target) {
    Op op;
    op.thread = thread_;
    op.kind = OpKind::kFork;
    op.seq = source;
    op.fork_id = target;
    const int64_t id = h_->Invoke(std::move(op));
    grpc::ClientContext ctx;
    Deadline(&ctx, o_.deadline);
    v1::ForkRequest req;
    *req.mutable_source() = Ref(source);
    req.set_new_sequence_id(target);
    v1::ForkResponse resp;
    const grpc::Status st = stub_->Fork(&ctx, req, &resp);
    h_->Answer(id, OutcomeOf(st, true), st.error_code(), st.error_message(),
               [&](Op& o) { o.answered_tokens = st.ok() ? resp.num_tokens() : -1; });
  }

  void Release(const std::string& seq) {
    const int64_t id = Begin(OpKind::kRelease, seq);
    grpc::ClientContext ctx;
    Deadline(&ctx, o_.deadline);
    v1::ReleaseRequest req;
    *req.mutable_sequence() = Ref(seq);
    v1::ReleaseResponse resp;
    const grpc::Status st = stub_->Release(&ctx, req, &resp);
    h_->Answer(id, OutcomeOf(st, true), st.error_code(), st.error_message());
  }

  struct Fetched {
    int64_t id = -1;
    bool ok = false;
    int tokens = 0;
  };

  Fetched Fetch(const std::string& seq) {
    Fetched out;
    out.id = Begin(OpKind::kFetch, seq);
    grpc::ClientContext ctx;
    Deadline(&ctx, o_.deadline);
    v1::FetchRequest req;
    *req.mutable_sequence() = Ref(seq);
    req.set_dtype(v1::DTYPE_FP16);
    std::unique_ptr<grpc::ClientReader<v1::FetchResponse>> r = stub_->FetchDequant(&ctx, req);
    std::vector<std::optional<TokenRef>> tokens;
    uint64_t digest = 1469598103934665603ull;
    v1::FetchResponse msg;
    while (r->Read(&msg)) {
      std::vector<std::optional<TokenRef>> part = Attribute(msg.k(), msg.v());
      // A message not shaped [kv_heads, n, head_dim] fp16: one
      // unattributable token stands for it.
      if (msg.k().shape_size() != 3 || static_cast<int64_t>(part.size()) != msg.k().shape(1)) {
        part.assign(1, std::nullopt);
      }
      tokens.insert(tokens.end(), part.begin(), part.end());
      digest = Fnv1a(msg.v().data(), Fnv1a(msg.k().data(), digest));
    }
    const grpc::Status st = r->Finish();
    out.ok = st.ok();
    out.tokens = static_cast<int>(tokens.size());
    h_->Answer(out.id, OutcomeOf(st, true), st.error_code(), st.error_message(), [&](Op& o) {
      o.read = std::move(tokens);
      o.digest = digest;
    });
    return out;
  }

  // A fetch, then attention over the first 1..n tokens it returned.
  void Attend(const std::string& seq) {
    const Fetched f = Fetch(seq);
    if (!f.ok || f.tokens == 0) return;
    Op op;
    op.thread = thread_;
    op.kind = OpKind::kAttend;
    op.seq = seq;
    op.read_op = f.id;
    op.key_end = 1 + Pick(f.tokens);
    const int key_end = op.key_end;
    const int64_t id = h_->Invoke(std::move(op));
    const std::vector<float> q = Query(id);
    v1::AttendRequest req;
    req.set_layer(0);
    v1::AttendItem* item = req.add_items();
    *item->mutable_sequence() = Ref(seq);
    SetQuery(q, item->mutable_q());
    item->set_key_end(key_end);
    grpc::ClientContext ctx;
    Deadline(&ctx, o_.deadline);
    v1::AttendResponse resp;
    const grpc::Status st = stub_->Attend(&ctx, req, &resp);
    h_->Answer(id, OutcomeOf(st, true), st.error_code(), st.error_message(), [&](Op& o) {
      o.q = q;
      if (st.ok() && resp.results_size() == 1) o.out = Floats(resp.results(0).out());
    });
  }

  void Stats() {
    const int64_t id = Begin(OpKind::kStats, "");
    grpc::ClientContext ctx;
    Deadline(&ctx, o_.deadline);
    v1::StatsRequest req;
    v1::StatsResponse resp;
    const grpc::Status st = stub_->Stats(&ctx, req, &resp);
    h_->Answer(id, OutcomeOf(st, true), st.error_code(), st.error_message(),
               [&](Op& o) { o.used_bytes = st.ok() ? resp.used_bytes() : -1; });
  }

  const WorkloadOptions& o_;
  const int thread_;
  History* h_;
  std::mt19937_64 rng_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
};

int64_t UsedBytes(v1::KvCache::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::StatsRequest req;
  v1::StatsResponse resp;
  return stub.Stats(&ctx, req, &resp).ok() ? resp.used_bytes() : -1;
}

}  // namespace

absl::Status RunWorkload(const WorkloadOptions& options, History* history) {
  std::unique_ptr<v1::KvCache::Stub> admin = v1::KvCache::NewStub(
      grpc::CreateChannel(options.target, grpc::InsecureChannelCredentials()));
  const int64_t baseline = UsedBytes(*admin);
  if (baseline < 0) return absl::UnavailableError("Stats failed before the workload");
  history->set_baseline_used_bytes(baseline);
  const absl::Time until = absl::Now() + options.duration;
  std::vector<std::thread> threads;
  for (int t = 0; t < options.threads; ++t) {
    threads.emplace_back([&, t] { Client(options, t, history).Run(until); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < options.sequences; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ReleaseRequest req;
    req.mutable_sequence()->set_namespace_(options.ns);
    req.mutable_sequence()->set_sequence_id(absl::StrCat("s", i));
    v1::ReleaseResponse resp;
    admin->Release(&ctx, req, &resp);  // NOT_FOUND for an id not live now.
  }
  // Pages of calls the server is still finishing (a cancelled stream's
  // last reference) come back shortly after: wait for them, bounded.
  int64_t used = UsedBytes(*admin);
  for (const absl::Time give_up = absl::Now() + absl::Seconds(10);
       used != baseline && absl::Now() < give_up; used = UsedBytes(*admin)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  history->set_final_used_bytes(used);
  return absl::OkStatus();
}

}  // namespace kvq::history
