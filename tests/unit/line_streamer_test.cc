// LineStreamer: a region written in pieces of any size, starting anywhere in
// a line, holds exactly the pieces' bytes, and nothing outside it changes.
#include "kernels/line_streamer.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvq {
namespace {

TEST(LineStreamerTest, PiecesOfAnySizeLandAsOneCopy) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 400; ++trial) {
    const size_t skew = rng() % 64;  // Where in a line the region starts.
    const size_t size = trial < 8 ? trial : rng() % 6000;
    std::vector<uint8_t> src(size);
    for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
    // A guard line on both sides of the region, in a line-aligned buffer.
    constexpr size_t kGuard = 128;
    std::vector<uint8_t> buffer(kGuard + skew + size + kGuard + 64, 0x5A);
    uint8_t* base = buffer.data();
    base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
    uint8_t* region = base + kGuard + skew;
    LineStreamer streamer(region);
    size_t done = 0;
    while (done < size) {
      // Pieces from one byte to a few lines, as pages of rows would come.
      const size_t piece = std::min<size_t>(size - done, 1 + rng() % (rng() % 2 ? 40 : 400));
      streamer.Write(src.data() + done, piece);
      done += piece;
    }
    streamer.Finish();
    ASSERT_EQ(std::vector<uint8_t>(region, region + size), src)
        << "skew " << skew << " size " << size;
    for (uint8_t* p = buffer.data(); p < region; ++p) ASSERT_EQ(*p, 0x5A) << "before the region";
    for (uint8_t* p = region + size; p < buffer.data() + buffer.size(); ++p) {
      ASSERT_EQ(*p, 0x5A) << "after the region, skew " << skew << " size " << size;
    }
  }
}

}  // namespace
}  // namespace kvq
