// Calibrations through the real kvq-server: --calibration_dir loading and
// its refusals, SIGHUP reloads, CreateSequenceRequest.calibration and
// MatchPrefixRequest.calibration with their error contract, a crq sequence
// keeping the version it was created with, and prefix reuse only under the
// same calibration name and version.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kvq_client.h"
#include "gtest/gtest.h"
#include "kernels/calibration_file.h"
#include "kvq/v1/kvq.grpc.pb.h"
#include "tests/integration/server_client_fixture.h"
#include "tests/integration/server_process.h"
#include "tests/service/test_temp_dir.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kQHeads = 4, kDim = 64;
constexpr char kCrq[] = "crq3:pre_rope";

// A calibration of kLayers x kHeads x kDim; `seed` varies every value. Key
// scales are equal on both channels of each half-split RoPE pair (the
// layout's default pairing).
ModelCalibration Calibration(const std::string& name, int seed, int layers = kLayers) {
  ModelCalibration c;
  c.name = name;
  c.num_layers = layers;
  c.num_kv_heads = kHeads;
  c.head_dim = kDim;
  for (int i = 0; i < layers * kHeads; ++i) {
    HeadCalibration h = HeadCalibration::Identity(kDim);
    for (int ch = 0; ch < kDim; ++ch) {
      h.key_mean[ch] = 0.01f * (seed + i) - 0.002f * ch;
      h.key_scale[ch] = 0.5f + 0.03f * (ch % (kDim / 2)) + 0.01f * seed;
      h.value_mean[ch] = 0.005f * ch - 0.01f * seed;
      h.value_scale[ch] = 0.8f + 0.01f * ch + 0.02f * i;
    }
    c.heads.push_back(h);
  }
  return c;
}

void SetLayout(v1::ModelLayout* l) {
  l->set_num_layers(kLayers);
  l->set_num_kv_heads(kHeads);
  l->set_num_q_heads(kQHeads);
  l->set_head_dim(kDim);
}

// The value of the unlabelled sample `name` in a /metrics body; -1 if absent.
double Sample(const std::string& body, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(body, m, std::regex("\n" + name + " ([-+.0-9eE]+)\n"))) return -1;
  return std::stod(m[1].str());
}

class CalibrationServerTest : public ServerClientFixture {
 protected:

  void Write(const std::string& file, const ModelCalibration& c) {
    absl::Status st = WriteCalibrationFile(dir_ + "/" + file, c, "test model");
    ASSERT_TRUE(st.ok()) << st;
  }
  void WriteBytes(const std::string& file, const std::string& bytes) {
    std::ofstream(dir_ + "/" + file, std::ios::binary) << bytes;
  }
  // Starts the server on dir_, reloading on SIGHUP only.
  void Start() {
    ASSERT_NO_FATAL_FAILURE(StartServer(
        {absl::StrCat("--calibration_dir=", dir_), "--calibration_reload_seconds=0"}, "cal"));
  }
  std::vector<std::string> Loaded() {
    absl::StatusOr<v1::ServerInfo> info = client_->GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return {};
    return {info->calibrations().begin(), info->calibrations().end()};
  }
  // SIGHUP, then waits (bounded) until the loaded names are `want`.
  void ReloadUntil(const std::vector<std::string>& want) {
    ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (Loaded() != want && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
    ASSERT_EQ(Loaded(), want) << server_->Stdout();
  }
  grpc::Status Create(const std::string& scheme, const std::string& calibration,
                      v1::CreateSequenceResponse* resp, const std::string& id = "",
                      const std::vector<int32_t>& prompt = {}) {
    v1::CreateSequenceRequest req;
    req.set_namespace_(ns_);
    req.set_sequence_id(id);
    SetLayout(req.mutable_layout());
    req.set_scheme(scheme);
    req.set_calibration(calibration);
    for (int32_t t : prompt) req.add_prompt_token_ids(t);
    grpc::ClientContext ctx;
    return stub_->CreateSequence(&ctx, req, resp);
  }
  grpc::Status Match(const std::string& scheme, const std::string& calibration,
                     const std::vector<int32_t>& prompt, v1::MatchPrefixResponse* resp) {
    v1::MatchPrefixRequest req;
    req.set_namespace_(ns_);
    SetLayout(req.mutable_layout());
    req.set_scheme(scheme);
    req.set_calibration(calibration);
    for (int32_t t : prompt) req.add_prompt_token_ids(t);
    grpc::ClientContext ctx;
    return stub_->MatchPrefix(&ctx, req, resp);
  }

  TestTempDir temp_{"kvq_calibrations_"};
  const std::string dir_ = temp_.path();
};

TEST_F(CalibrationServerTest, LoadsValidFilesAndSkipsTheOthersSayingWhy) {
  ASSERT_NO_FATAL_FAILURE(Write("a.kvqcal", Calibration("a", 1)));
  ASSERT_NO_FATAL_FAILURE(Write("b.kvqcal", Calibration("b", 2)));
  std::string corrupt = *SerializeCalibration(Calibration("c", 3), "m");
  corrupt[corrupt.size() / 2] ^= 0x01;
  WriteBytes("c.kvqcal", corrupt);
  ASSERT_NO_FATAL_FAILURE(Write("other-name.kvqcal", Calibration("d", 4)));
  WriteBytes("e.kvqcal", "not a calibration");
  WriteBytes("ignored.txt", "not read: wrong extension");
  ASSERT_NO_FATAL_FAILURE(Start());
  EXPECT_EQ(Loaded(), std::vector<std::string>({"a", "b"}));
  const std::string out = server_->Stdout();
  EXPECT_TRUE(absl::StrContains(out, "kvq-server: calibration \"a\" loaded")) << out;
  EXPECT_TRUE(absl::StrContains(out, "c.kvqcal: calibration file checksum mismatch")) << out;
  EXPECT_TRUE(absl::StrContains(out, "other-name.kvqcal: holds calibration \"d\"; a calibration "
                                     "file must be named after it (d.kvqcal)"))
      << out;
  EXPECT_TRUE(absl::StrContains(out, "e.kvqcal: not a kvq calibration file")) << out;
  EXPECT_FALSE(absl::StrContains(out, "ignored.txt")) << out;
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->calibrations_loaded(), 2);
  // The metrics say the same: two loaded, three files skipped.
  absl::StatusOr<std::string> metrics = server_->MetricsAddress();
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  std::string body;
  ASSERT_EQ(RunCommand(absl::StrCat("curl -sS --max-time 20 http://", *metrics, "/metrics"), &body),
            0)
      << body;
  EXPECT_EQ(Sample(body, "kvq_calibrations_loaded"), 2.0) << body;
  EXPECT_EQ(Sample(body, "kvq_calibration_files_skipped_total"), 3.0) << body;
  // The CLI lists them and sends the field.
  const std::string cli =
      absl::StrCat(BinaryPath("KVQ_CLI_BIN", KVQ_CLI_BIN), " --server=", server_->address());
  std::string cli_out;
  ASSERT_EQ(RunCommand(cli + " info", &cli_out), 0) << cli_out;
  EXPECT_TRUE(absl::StrContains(cli_out, "\ncalibrations: a, b\n")) << cli_out;
  EXPECT_NE(RunCommand(cli + " create --layers=2 --kv_heads=2 --head_dim=64 --scheme=kivi2 "
                             "--calibration=a",
                       &cli_out),
            0);
  EXPECT_TRUE(absl::StrContains(cli_out, "calibration: scheme \"kivi2:g32:r128\" takes no "
                                     "calibration"))
      << cli_out;
}

TEST_F(CalibrationServerTest, SighupReloadsKeepingTheLastGoodVersion) {
  ASSERT_NO_FATAL_FAILURE(Write("a.kvqcal", Calibration("a", 1)));
  ASSERT_NO_FATAL_FAILURE(Start());
  EXPECT_EQ(Loaded(), std::vector<std::string>({"a"}));
  ASSERT_NO_FATAL_FAILURE(Write("b.kvqcal", Calibration("b", 2)));
  ASSERT_NO_FATAL_FAILURE(ReloadUntil({"a", "b"}));
  // A truncated a.kvqcal is skipped; the version loaded before stays.
  const std::string good = *SerializeCalibration(Calibration("a", 5), "m");
  WriteBytes("a.kvqcal", good.substr(0, good.size() - 3));
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!absl::StrContains(server_->Stdout(), "a.kvqcal: calibration file is truncated") &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(absl::StrContains(server_->Stdout(),
                                "calibration file skipped (a version loaded before stays): "))
      << server_->Stdout();
  EXPECT_EQ(Loaded(), std::vector<std::string>({"a", "b"}));
  // A removed file unloads its name.
  std::filesystem::remove(dir_ + "/b.kvqcal");
  ASSERT_NO_FATAL_FAILURE(ReloadUntil({"a"}));
  EXPECT_TRUE(absl::StrContains(server_->Stdout(),
                                "calibration \"b\" unloaded: its file is gone"));
}

TEST_F(CalibrationServerTest, CalibrationFieldErrorsFollowTheContract) {
  ASSERT_NO_FATAL_FAILURE(Write("a.kvqcal", Calibration("a", 1)));
  ASSERT_NO_FATAL_FAILURE(Write("three.kvqcal", Calibration("three", 1, 3)));
  ASSERT_NO_FATAL_FAILURE(Start());
  v1::CreateSequenceResponse resp;
  v1::MatchPrefixResponse match;
  // A scheme that takes none.
  grpc::Status st = Create("kivi2:g32:r128", "a", &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message(),
            "calibration: scheme \"kivi2:g32:r128\" takes no calibration; leave it empty");
  st = Match("kivi2:g32:r128", "a", {1, 2, 3}, &match);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  // A crq scheme without one.
  st = Create(kCrq, "", &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_TRUE(absl::StartsWith(st.error_message(), "calibration: scheme \"crq3"))
      << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "needs one")) << st.error_message();
  st = Match(kCrq, "", {1, 2, 3}, &match);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  // A name not loaded.
  st = Create(kCrq, "missing", &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  EXPECT_EQ(st.error_message(),
            "calibration \"missing\" is not loaded on this server (ServerInfo.calibrations "
            "lists those that are)");
  st = Match(kCrq, "missing", {1, 2, 3}, &match);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  // Another shape than the layout.
  st = Create(kCrq, "three", &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message(),
            "calibration \"three\" is for 3 layers x 2 KV heads x head_dim 64; the layout is "
            "2 layers x 2 KV heads x head_dim 64");
  // Bounded like every request string.
  st = Create(kCrq, std::string(129, 'x'), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(st.error_message(), "calibration has 129 bytes; the limit is 128");
  st = Match(kCrq, std::string(129, 'x'), {1}, &match);
  EXPECT_EQ(st.error_message(), "calibration has 129 bytes; the limit is 128");
  // Nothing was created.
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->sequences(), 0);
}

TEST_F(CalibrationServerTest, CrqSequenceKeepsItsVersionAndPrefixesNeedTheSameOne) {
  ASSERT_NO_FATAL_FAILURE(Write("a.kvqcal", Calibration("a", 1)));
  ASSERT_NO_FATAL_FAILURE(Write("b.kvqcal", Calibration("b", 2)));
  ASSERT_NO_FATAL_FAILURE(Start());
  constexpr int kTokens = 512;
  std::vector<int32_t> prompt(kTokens);
  for (int i = 0; i < kTokens; ++i) prompt[i] = 1000 + i;
  v1::CreateSequenceResponse created;
  grpc::Status st = Create(kCrq, "a", &created, "first", prompt);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const HostTensor k = Random({kLayers, kHeads, kTokens, kDim}, 1);
  const HostTensor v = Random({kLayers, kHeads, kTokens, kDim}, 2);
  absl::StatusOr<AppendResult> appended = client_->AppendPrompt("first", k, v);
  ASSERT_TRUE(appended.ok()) << appended.status();
  absl::StatusOr<v1::StatsResponse> stats = client_->Stats("first");
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->calibration(), "a");
  EXPECT_EQ(stats->num_tokens(), kTokens);

  // What the sequence reads back under version 1 of "a".
  FetchOptions fetch;
  fetch.dtype = DType::kFloat32;
  absl::StatusOr<FetchedKv> before = client_->FetchDequant("first", fetch);
  ASSERT_TRUE(before.ok()) << before.status();

  // The prefix is reusable under "a", not under "b" (same shape and scheme).
  v1::MatchPrefixResponse match;
  ASSERT_TRUE(Match(kCrq, "a", prompt, &match).ok());
  // Blocks of the residual window (crq3's default r128), all four stored.
  EXPECT_EQ(match.block_tokens(), 128);
  EXPECT_EQ(match.matched_tokens(), kTokens);
  EXPECT_EQ(created.block_tokens(), 128);
  ASSERT_TRUE(Match(kCrq, "b", prompt, &match).ok());
  EXPECT_EQ(match.matched_tokens(), 0);

  // A new version of "a": the stored sequence keeps reading what it read,
  // and its prefix is not offered under the new version.
  ASSERT_NO_FATAL_FAILURE(Write("a.kvqcal", Calibration("a", 9)));
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  int reloads = 0;
  while (absl::Now() < deadline) {
    const std::string out = server_->Stdout();
    size_t at = 0;
    reloads = 0;
    while ((at = out.find("calibration \"a\" loaded", at)) != std::string::npos) ++reloads, ++at;
    if (reloads == 2) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(reloads, 2) << server_->Stdout();
  absl::StatusOr<FetchedKv> after = client_->FetchDequant("first", fetch);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(after->k.data == before->k.data);
  EXPECT_TRUE(after->v.data == before->v.data);
  ASSERT_TRUE(Match(kCrq, "a", prompt, &match).ok());
  EXPECT_EQ(match.matched_tokens(), 0);
  v1::CreateSequenceResponse second;
  ASSERT_TRUE(Create(kCrq, "a", &second, "second", prompt).ok());
  EXPECT_EQ(second.num_tokens(), 0);
  // The same K/V under the new statistics store other codes: the
  // calibration is what the streams code with.
  ASSERT_TRUE(client_->AppendPrompt("second", k, v).ok());
  absl::StatusOr<FetchedKv> other = client_->FetchDequant("second", fetch);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_FALSE(other->k.data == before->k.data);
}

}  // namespace
}  // namespace kvq
