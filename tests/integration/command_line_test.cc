// The first commands a user runs: `kvq-server --help` lists the server's
// flags with their defaults, grouped; `--version` on every installed binary
// prints the version, the git revision, the backends compiled in and the
// SIMD target (the one the server reports when it starts).
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"

namespace kvq {
namespace {

TEST(CommandLineTest, ServerHelpListsItsFlagsGroupedWithDefaults) {
  std::string out;
  ASSERT_EQ(RunCommand(absl::StrCat(KVQ_SERVER_BIN, " --help"), &out), 0) << out;
  EXPECT_FALSE(absl::StrContains(out, "No flags matched")) << out;
  // The groups, in order.
  size_t at = 0;
  for (const char* group :
       {"\nListening:\n", "\nBackend and pool:\n", "\nSecurity:\n", "\nLimits:\n",
        "\nCalibrations:\n"}) {
    const size_t found = out.find(group, at);
    ASSERT_NE(found, std::string::npos) << group << " (in order) in:\n" << out;
    at = found;
  }
  // Every flag of the server sits in a group.
  EXPECT_FALSE(absl::StrContains(out, "\nOther:\n")) << out;
  auto section = [&](const char* title) {
    const size_t begin = out.find(absl::StrCat("\n", title, ":\n"));
    const size_t end = out.find("\n\n", begin + 1);
    return out.substr(begin, end - begin);
  };
  EXPECT_TRUE(absl::StrContains(section("Listening"), "--address (default: 127.0.0.1:50051)"))
      << out;
  EXPECT_TRUE(absl::StrContains(section("Listening"), "--port_file (default: \"\")")) << out;
  EXPECT_TRUE(absl::StrContains(section("Backend and pool"), "--backend (default: auto)")) << out;
  EXPECT_TRUE(absl::StrContains(section("Backend and pool"), "--capacity_fraction (default: 0.25)"))
      << out;
  EXPECT_TRUE(absl::StrContains(section("Security"), "--tokens_file (default: \"\")")) << out;
  EXPECT_TRUE(absl::StrContains(section("Security"), "--insecure (default: false)")) << out;
  EXPECT_TRUE(absl::StrContains(section("Limits"), "--max_ttl_seconds (default: 86400)")) << out;
  EXPECT_TRUE(absl::StrContains(section("Limits"), "--max_message_bytes (default: 67108864)"))
      << out;
  EXPECT_TRUE(absl::StrContains(out, "Largest idle lease a client may ask for")) << out;
  EXPECT_TRUE(absl::StrContains(section("Calibrations"), "--calibration_dir (default: \"\")"))
      << out;
  EXPECT_TRUE(
      absl::StrContains(section("Calibrations"), "--calibration_reload_seconds (default: 60)"))
      << out;
}

TEST(CommandLineTest, EveryBinaryPrintsItsVersionRevisionBackendsAndSimdTarget) {
  // The SIMD target the server dispatches to, from its start-up line.
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start().ok());
  std::smatch m;
  const std::string started = server.Stdout();
  ASSERT_TRUE(std::regex_search(started, m, std::regex("SIMD ([A-Za-z0-9_]+)"))) << started;
  const std::string simd = m[1];
  const std::string want_tail =
      absl::StrCat(" ", KVQ_VERSION, "\ngit revision: ", KVQ_GIT_REVISION,
                   "\nbackends: ", KVQ_BACKENDS, "\nSIMD target: ", simd, "\n");
  const std::vector<std::pair<std::string, std::string>> binaries = {{KVQ_SERVER_BIN, "kvq-server"},
                                                                     {KVQ_CLI_BIN, "kvq"},
                                                                     {KVQ_DEMO_BIN, "kvq-demo"},
                                                                     {KVQ_BENCH_BIN, "kvq-bench"},
                                                                     {KVQ_EVAL_BIN, "kvq-eval"}};
  for (const auto& [path, name] : binaries) {
    std::string out;
    EXPECT_EQ(RunCommand(absl::StrCat(path, " --version"), &out), 0) << name << ":\n" << out;
    EXPECT_EQ(out, name + want_tail) << name;
  }
  EXPECT_NE(std::string(KVQ_GIT_REVISION), "");
}

}  // namespace
}  // namespace kvq
