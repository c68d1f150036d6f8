#include "service/tenants.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/temp_tokens_file.h"

namespace kvq {
namespace {

constexpr char kTokenA[] = "token-of-tenant-a-0123";
constexpr char kTokenB[] = "token-of-tenant-b-4567";

TEST(TokenBucketTest, AllowsTheBurstThenTheRate) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  TokenBucket bucket(/*rate=*/2, /*burst=*/3, t0);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(bucket.TryTake(t0)) << i;
  EXPECT_FALSE(bucket.TryTake(t0));
  EXPECT_FALSE(bucket.TryTake(t0 + absl::Milliseconds(499)));
  EXPECT_TRUE(bucket.TryTake(t0 + absl::Milliseconds(500)));
  EXPECT_FALSE(bucket.TryTake(t0 + absl::Milliseconds(500)));
  // A long pause refills no more than the burst.
  const absl::Time later = t0 + absl::Hours(1);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(bucket.TryTake(later)) << i;
  EXPECT_FALSE(bucket.TryTake(later));
  // A clock that steps back takes nothing away and adds nothing.
  EXPECT_FALSE(bucket.TryTake(t0));
}

TEST(TenantsTest, AuthenticatesBearerTokens) {
  std::unique_ptr<Tenants> t =
      Tenants::FromSpecs({{"a", kTokenA, 100, 0, 0}, {"b", kTokenB, 0, 0, 0}});
  absl::StatusOr<std::shared_ptr<Tenant>> a =
      t->Authenticate(true, absl::StrCat("Bearer ", kTokenA));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->name(), "a");
  EXPECT_EQ((*t->Authenticate(true, absl::StrCat("bearer ", kTokenB)))->name(), "b");
  EXPECT_EQ(t->Authenticate(false, "").status(),
            absl::UnauthenticatedError(
                "this server needs \"authorization: Bearer <token>\" metadata on every call"));
  for (const std::string bad :
       {std::string(kTokenA), std::string("Basic abc"), std::string("Bearer ")}) {
    EXPECT_EQ(t->Authenticate(true, bad).status(),
              absl::UnauthenticatedError("the authorization metadata must be \"Bearer <token>\""))
        << bad;
  }
  for (const std::string bad : {absl::StrCat("Bearer ", kTokenA, "x"),
                                absl::StrCat("Bearer ", std::string(kTokenA).substr(1)),
                                std::string("Bearer token-of-tenant-a-0124")}) {
    EXPECT_EQ(t->Authenticate(true, bad).status(),
              absl::UnauthenticatedError("the bearer token is not valid"))
        << bad;
  }
}

TEST(TenantsTest, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abcd", "abc"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("ab\0", 3), "ab"));
}

TEST(TenantsTest, RateLimitNamesTheLimit) {
  std::unique_ptr<Tenants> t = Tenants::FromSpecs({{"a", kTokenA, 0, 1, 2}});
  std::shared_ptr<Tenant> a = *t->Authenticate(true, absl::StrCat("Bearer ", kTokenA));
  const absl::Time now = absl::Now();
  EXPECT_TRUE(a->Admit(now).ok());
  EXPECT_TRUE(a->Admit(now).ok());
  EXPECT_EQ(a->Admit(now), absl::ResourceExhaustedError(
                               "tenant \"a\" is over its rate limit: rate_rps = 1, burst = 2"));
}

class TenantsFileTest : public testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(file_.Create("kvq-tenants-"));
    path_ = file_.path();
  }
  void Write(const std::string& text) { std::ofstream(path_, std::ios::trunc) << text; }
  TempTokensFile file_;
  std::string path_;
};

TEST_F(TenantsFileTest, ReloadsWhenTheFileChangesAndKeepsTheTableOnABadFile) {
  Write(absl::StrCat("tenant=a token=", kTokenA, " rate_rps=0.001 burst=1\n"));
  absl::StatusOr<std::unique_ptr<Tenants>> t = Tenants::Load(path_);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*(*t)->ReloadIfChanged(), false);
  std::shared_ptr<Tenant> a = *(*t)->Authenticate(true, absl::StrCat("Bearer ", kTokenA));
  EXPECT_TRUE(a->Admit(absl::Now()).ok());

  // b added, a unchanged: a keeps its state (its bucket stays empty).
  Write(absl::StrCat("tenant=a token=", kTokenA,
                     " rate_rps=0.001 burst=1\ntenant=b token=", kTokenB, "\n"));
  EXPECT_EQ(*(*t)->ReloadIfChanged(), true);
  EXPECT_EQ((*(*t)->Authenticate(true, absl::StrCat("Bearer ", kTokenB)))->name(), "b");
  EXPECT_EQ(*(*t)->Authenticate(true, absl::StrCat("Bearer ", kTokenA)), a);
  EXPECT_EQ(a->Admit(absl::Now()).code(), absl::StatusCode::kResourceExhausted);

  // A broken file: the error names the line, the table stays.
  Write(absl::StrCat("tenant=b token=", kTokenB, "\ntenant=c\n"));
  EXPECT_EQ((*t)->ReloadIfChanged().status(),
            absl::InvalidArgumentError("tokens file line 2: token is missing"));
  EXPECT_EQ((*t)->Specs().size(), 2u);
  EXPECT_TRUE((*t)->Authenticate(true, absl::StrCat("Bearer ", kTokenA)).ok());
  // Reported once, not on every poll.
  EXPECT_EQ(*(*t)->ReloadIfChanged(), false);

  // a removed: its token no longer authenticates.
  Write(absl::StrCat("tenant=b token=", kTokenB, " quota_bytes=7\n"));
  EXPECT_EQ(*(*t)->ReloadIfChanged(), true);
  EXPECT_EQ((*t)->Authenticate(true, absl::StrCat("Bearer ", kTokenA)).status().code(),
            absl::StatusCode::kUnauthenticated);
  ASSERT_EQ((*t)->Specs().size(), 1u);
  EXPECT_EQ((*t)->Specs()[0].quota_bytes, 7);

  // A deleted file keeps the table too.
  std::remove(path_.c_str());
  EXPECT_EQ((*t)->ReloadIfChanged().status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE((*t)->Authenticate(true, absl::StrCat("Bearer ", kTokenB)).ok());
}

TEST_F(TenantsFileTest, LoadFailsOnABadFile) {
  Write("tenant=a token=x\n");
  EXPECT_EQ(Tenants::Load(path_).status(),
            absl::InvalidArgumentError(
                "tokens file line 1: token must have 16 to 512 characters, got 1"));
}

}  // namespace
}  // namespace kvq
