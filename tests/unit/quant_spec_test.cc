#include "kernels/quant_spec.h"

#include "gtest/gtest.h"

namespace kvq {
namespace {

TEST(QuantSpecTest, ParsesAndPrintsCanonicalForm) {
  absl::StatusOr<QuantSpec> s = QuantSpec::Parse("kivi2:g32:r128:pre_rope:outliers=1:sink=4");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->bits, 2);
  EXPECT_TRUE(s->pre_rope);
  EXPECT_EQ(s->sink, 4);
  EXPECT_EQ(s->ToString(), "kivi2:g32:r128:pre_rope:outliers=1:sink=4");
  EXPECT_EQ(QuantSpec::Parse("kivi4")->ToString(), "kivi4:g32:r128");
}

}  // namespace
}  // namespace kvq
