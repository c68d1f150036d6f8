// kvq-demo, the main job's client (scripts/run.sh), against the real server:
// it runs to the end, prints a row per scheme, and its figures order the
// way the storage does (fewer bits, fewer bytes; every option it shows
// lowering the 2-bit error on the synthetic KV it stores).
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"

namespace kvq {
namespace {

struct DemoRow {
  double bits = 0;
  double kv_mib = 0;
  double attn_err = -1;
};

// The table's rows by scheme: the first column, bits/el, KV MiB and the last
// column (attn err).
std::map<std::string, DemoRow> ParseTable(const std::string& text) {
  std::map<std::string, DemoRow> rows;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    DemoRow row;
    if (f.size() != 9 || !absl::SimpleAtod(f[1], &row.bits) ||
        !absl::SimpleAtod(f[2], &row.kv_mib) || !absl::SimpleAtod(f[8], &row.attn_err)) {
      continue;
    }
    rows[std::string(f[0])] = row;
  }
  return rows;
}

TEST(DemoTest, StoresEverySchemeAndItsFiguresOrderAsTheStorageDoes) {
  ServerProcess server(KVQ_SERVER_BIN);
  ASSERT_TRUE(server.Start().ok());
  const std::vector<std::string> schemes = {"fp16", "kivi4", "kivi2",
                                            "kivi2:pre_rope:outliers=1:sink=4"};
  std::string out;
  const int code = RunCommand(absl::StrCat(KVQ_DEMO_BIN, " --server=", server.address(),
                                           " --tokens=1024 --steps=2 --schemes=",
                                           absl::StrJoin(schemes, ",")),
                              &out);
  ASSERT_EQ(code, 0) << out;
  const std::map<std::string, DemoRow> rows = ParseTable(out);
  for (const std::string& s : schemes) ASSERT_TRUE(rows.contains(s)) << s << " missing in\n" << out;
  const DemoRow& fp16 = rows.at("fp16");
  const DemoRow& kivi4 = rows.at("kivi4");
  const DemoRow& kivi2 = rows.at("kivi2");
  const DemoRow& combined = rows.at("kivi2:pre_rope:outliers=1:sink=4");
  // The baseline against itself.
  EXPECT_EQ(fp16.attn_err, 0.0) << out;
  EXPECT_GT(fp16.bits, 16.0) << out;
  EXPECT_LT(kivi4.bits, fp16.bits / 2) << out;
  EXPECT_LT(kivi2.bits, kivi4.bits) << out;
  EXPECT_LT(kivi2.kv_mib, kivi4.kv_mib) << out;
  EXPECT_LT(kivi4.kv_mib, fp16.kv_mib) << out;
  // Errors that are neither zero nor noise (on unstructured KV attention is
  // nearly uniform: kivi2 measured 0.56 here on such KV), in the order
  // KERNELS.md measures on this data.
  EXPECT_GT(kivi4.attn_err, 0.0) << out;
  EXPECT_LT(kivi4.attn_err, kivi2.attn_err) << out;
  EXPECT_LT(combined.attn_err, kivi2.attn_err) << out;
  EXPECT_LT(kivi2.attn_err, 0.35) << out;
}

}  // namespace
}  // namespace kvq
