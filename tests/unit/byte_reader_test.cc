// ByteReader reads buffers laid end to end as one: pointers into a run
// when the bytes lie inside it, copies when they straddle runs.
#include "kernels/byte_reader.h"

#include <cstdint>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace kvq {
namespace {

class ByteReaderTest : public ::testing::Test {
 protected:
  ByteReaderTest() : bytes_(20) {
    std::iota(bytes_.begin(), bytes_.end(), uint8_t{0});
    // Runs of 3, 0, 5, 12 bytes: an empty run in the middle.
    runs_ = {{bytes_.data(), 3}, {bytes_.data() + 3, 0}, {bytes_.data() + 3, 5},
             {bytes_.data() + 8, 12}};
  }
  std::vector<uint8_t> bytes_;
  std::vector<ByteReader::Run> runs_;
};

TEST_F(ByteReaderTest, NextPointsIntoARunOrCopiesAcrossRuns) {
  ByteReader r(runs_);
  EXPECT_EQ(r.remaining(), 20u);
  uint8_t scratch[16] = {};
  EXPECT_EQ(r.Next(2, scratch), bytes_.data()) << "inside the first run";
  const uint8_t* p = r.Next(4, scratch);  // 2..5: the first run's end, the empty run, the third's start.
  EXPECT_EQ(p, scratch);
  EXPECT_EQ(std::vector<uint8_t>(p, p + 4), (std::vector<uint8_t>{2, 3, 4, 5}));
  EXPECT_EQ(r.Next(2, scratch), bytes_.data() + 6) << "the rest of the third run";
  EXPECT_EQ(r.Next(12, scratch), bytes_.data() + 8) << "the whole last run";
  EXPECT_EQ(r.remaining(), 0u);
}

TEST_F(ByteReaderTest, ReadAndSkipCrossRunsAndCopiesAreIndependentCursors) {
  ByteReader r(runs_);
  r.Skip(1);
  ByteReader copy = r;
  std::vector<uint8_t> out(9);
  r.Read(9, out.data());
  EXPECT_EQ(out, std::vector<uint8_t>(bytes_.begin() + 1, bytes_.begin() + 10));
  EXPECT_EQ(r.remaining(), 10u);
  EXPECT_EQ(copy.remaining(), 19u) << "the copy did not move";
  copy.Skip(18);
  copy.Read(1, out.data());
  EXPECT_EQ(out[0], 19);
  EXPECT_EQ(copy.remaining(), 0u);
}

TEST(ByteReaderEmptyTest, NoRunsOrOnlyEmptyRunsHoldNothing) {
  EXPECT_EQ(ByteReader({}).remaining(), 0u);
  const std::vector<ByteReader::Run> empty = {{nullptr, 0}, {nullptr, 0}};
  ByteReader r(empty);
  EXPECT_EQ(r.remaining(), 0u);
  r.Skip(0);
  r.Read(0, nullptr);
}

}  // namespace
}  // namespace kvq
