#include "service/tokens_file.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvq {
namespace {

constexpr char kTokenA[] = "token-of-tenant-a-0123";
constexpr char kTokenB[] = "token-of-tenant-b-4567";

TEST(TokensFileTest, ParsesTenantsCommentsAndDefaults) {
  absl::StatusOr<std::vector<TenantSpec>> specs = ParseTokensFile(
      absl::StrCat("# tenants\n\n  tenant=team-a token=", kTokenA,
                   " quota_bytes=1048576 rate_rps=5 burst=10\n"
                   "\ttoken=",
                   kTokenB, "\ttenant=b.2 rate_rps=2.5  \n   # indented comment\n"));
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 2u);
  EXPECT_EQ((*specs)[0], (TenantSpec{"team-a", kTokenA, 1048576, 5, 10}));
  // burst defaults to max(1, rate_rps); no quota is 0.
  EXPECT_EQ((*specs)[1], (TenantSpec{"b.2", kTokenB, 0, 2.5, 2.5}));
  ASSERT_TRUE(ParseTokensFile(absl::StrCat("tenant=c token=", kTokenA, " rate_rps=0.5")).ok());
  EXPECT_EQ(ParseTokensFile(absl::StrCat("tenant=c token=", kTokenA, " rate_rps=0.5"))->at(0).burst,
            1.0);
  EXPECT_TRUE(ParseTokensFile("# nothing\n")->empty());
}

TEST(TokensFileTest, ErrorsNameTheLineAndTheKeyAndNeverTheToken) {
  const std::string a = absl::StrCat("tenant=a token=", kTokenA, "\n");
  struct Case {
    std::string text;
    std::string message;
  } cases[] = {
      {"tenant=a\n", "tokens file line 1: token is missing"},
      {absl::StrCat("\n# c\ntoken=", kTokenA), "tokens file line 3: tenant is missing"},
      {"tenant=a token=short", "tokens file line 1: token must have 16 to 512 characters, got 5"},
      {absl::StrCat("tenant=a/b token=", kTokenA),
       "tokens file line 1: tenant may hold only letters, digits and - _ ."},
      {absl::StrCat("tenant= token=", kTokenA),
       "tokens file line 1: tenant must have 1 to 64 characters, got 0"},
      {absl::StrCat("tenant=a token=", kTokenA, " quota=5"),
       "tokens file line 1: unknown key \"quota\" (known: tenant, token, quota_bytes, rate_rps, "
       "burst)"},
      {absl::StrCat("tenant=a token=", kTokenA, " quota_bytes=-1"),
       "tokens file line 1: quota_bytes = \"-1\" is not an integer >= 0"},
      {absl::StrCat("tenant=a token=", kTokenA, " quota_bytes=1G"),
       "tokens file line 1: quota_bytes = \"1G\" is not an integer >= 0"},
      {absl::StrCat("tenant=a token=", kTokenA, " rate_rps=nan"),
       "tokens file line 1: rate_rps = \"nan\" is not a finite number >= 0"},
      {absl::StrCat("tenant=a token=", kTokenA, " burst=4"),
       "tokens file line 1: burst needs rate_rps > 0"},
      {absl::StrCat("tenant=a token=", kTokenA, " rate_rps=1 burst=0.5"),
       "tokens file line 1: burst = \"0.5\" is not a finite number >= 1"},
      {absl::StrCat("tenant=a token=", kTokenA, " tenant=b"),
       "tokens file line 1: tenant is given twice"},
      {absl::StrCat("tenant=a token=", kTokenA, " stray"),
       "tokens file line 1: \"stray\" is not key=value"},
      {absl::StrCat(a, "tenant=a token=", kTokenB),
       "tokens file line 2: tenant \"a\" is given twice"},
      {absl::StrCat(a, "tenant=b token=", kTokenA),
       "tokens file line 2: token is the same as another tenant's"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    absl::StatusOr<std::vector<TenantSpec>> specs = ParseTokensFile(c.text);
    ASSERT_FALSE(specs.ok());
    EXPECT_EQ(specs.status(), absl::InvalidArgumentError(c.message));
    EXPECT_FALSE(absl::StrContains(specs.status().message(), kTokenA));
  }
}

TEST(TokensFileTest, ReadNamesAMissingFile) {
  EXPECT_EQ(ReadTokensFile("/nonexistent-dir/tokens").status(),
            absl::NotFoundError("tokens file /nonexistent-dir/tokens: No such file or directory"));
}

}  // namespace
}  // namespace kvq
