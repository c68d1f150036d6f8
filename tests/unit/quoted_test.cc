#include "kernels/quoted.h"

#include <string>

#include "gtest/gtest.h"

namespace kvq {
namespace {

TEST(QuotedTest, ShortInputIsQuotedWhole) {
  EXPECT_EQ(Quoted(""), "\"\"");
  EXPECT_EQ(Quoted("kivi2:g32"), "\"kivi2:g32\"");
  EXPECT_EQ(Quoted(std::string(kQuotedPrefixBytes, 'a')),
            "\"" + std::string(kQuotedPrefixBytes, 'a') + "\"");
}

TEST(QuotedTest, LongInputKeepsAPrefixAndItsLength) {
  EXPECT_EQ(Quoted(std::string(20000, 'x')),
            "\"" + std::string(kQuotedPrefixBytes, 'x') + "...\" (20000 bytes)");
  EXPECT_EQ(Quoted(std::string(kQuotedPrefixBytes + 1, 'y')),
            "\"" + std::string(kQuotedPrefixBytes, 'y') + "...\" (33 bytes)");
}

TEST(QuotedTest, NonPrintableBytesAreEscapedAndStayBounded) {
  EXPECT_EQ(Quoted("a\"b\n\xff"), "\"a\\\"b\\n\\xff\"");
  const std::string quoted = Quoted(std::string(20000, '\xfe'));
  EXPECT_LE(quoted.size(), 4 * kQuotedPrefixBytes + 32);
  EXPECT_EQ(quoted.substr(0, 9), "\"\\xfe\\xfe");
}

}  // namespace
}  // namespace kvq
