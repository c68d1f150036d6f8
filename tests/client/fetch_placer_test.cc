// Placing fetch messages into output tensors: raw pages dequantized as
// they arrive (RawPagePlacer) and dense rows at an offset (FetchPlacer).
#include "client/fetch_placer.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "client/local_sequence.h"
#include "gtest/gtest.h"
#include "kernels/numeric.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 3, kDim = 64, kTokens = 4 + 256 + 40;

HostTensor Random(uint64_t seed) {
  HostTensor t = HostTensor::Zeros(DType::kFloat16, {kLayers, kHeads, kTokens, kDim});
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n;
  std::vector<float> row(kDim);
  for (int64_t r = 0; r < int64_t{kLayers} * kHeads * kTokens; ++r) {
    for (float& x : row) x = n(g);
    FloatToRow(row.data(), kDim, DType::kFloat16, t.mutable_bytes() + r * kDim * 2);
  }
  return t;
}

class RawPagePlacerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_.layout.num_layers = kLayers;
    config_.layout.num_kv_heads = kHeads;
    config_.layout.num_q_heads = kHeads;
    config_.layout.head_dim = kDim;
    config_.scheme = "kivi2:g32:r128:pre_rope:outliers=1:sink=4";
    const HostTensor k = Random(1), v = Random(2);
    // The stored sequence: every token appended as rows, as a server holds it.
    stored_ = LocalSequence::Create(config_).value();
    v1::KvChunk chunk;
    ToProto(k, chunk.mutable_k());
    ToProto(v, chunk.mutable_v());
    ASSERT_TRUE(stored_->ApplyChunk(chunk).ok());
    reader_ = LocalSequence::Create(config_).value();
    ASSERT_EQ(stored_->stream(0, 0).quantized_tokens(), 256);
  }

  // The raw fetch messages of tokens [4 + from, 4 + 256), `pages` pages
  // per message, as the server cuts them.
  std::vector<v1::FetchResponse> Messages(int from, int pages) const {
    std::vector<v1::FetchResponse> out;
    const KvStream& s0 = stored_->stream(0, 0);
    const int pt = s0.layout().page_tokens;
    for (int l = 0; l < kLayers; ++l) {
      for (int t = from; t < 256; t += pages * pt) {
        const int n = std::min(256, t + pages * pt) - t;
        v1::FetchResponse m;
        m.set_layer(l);
        m.set_token_begin(4 + t);
        v1::QuantizedPages* p = m.mutable_pages();
        p->set_layers(1);
        p->set_tokens(n);
        p->set_page_bytes(s0.layout().page_bytes);
        p->set_page_tokens(pt);
        const size_t per = static_cast<size_t>(s0.PagesFor(n)) * s0.layout().page_bytes;
        p->mutable_page_data()->resize(per * kHeads);
        for (int h = 0; h < kHeads; ++h) {
          EXPECT_TRUE(stored_->stream(l, h)
                          .CopyPages(t, t + n,
                                     reinterpret_cast<uint8_t*>(p->mutable_page_data()->data()) +
                                         h * per)
                          .ok());
        }
        out.push_back(std::move(m));
      }
    }
    return out;
  }

  SequenceConfig config_;
  std::unique_ptr<LocalSequence> stored_, reader_;
};

TEST_F(RawPagePlacerTest, PlacesWhatTheStoredSequenceReadsOnAnyThreadCount) {
  ReadOptions read;
  read.dtype = DType::kFloat32;
  read.apply_rope = true;
  // Tokens [37, 200) of the pages [4, 260): from mid-page to mid-page.
  const int begin = 37, end = 200;
  const FetchedKv want = stored_->Read(begin, end, read).value();
  for (int threads : {1, 2, 5}) {
    HostTensor k = HostTensor::Zeros(read.dtype, want.k.shape);
    HostTensor v = HostTensor::Zeros(read.dtype, want.v.shape);
    // Pages from the one holding token 37: 32-token pages, 4 + 32 = 36.
    RawPagePlacer placer(*reader_, read, 36, begin, end, begin, &k, &v, threads);
    for (const v1::FetchResponse& m : Messages(32, 3)) {
      if (m.token_begin() >= end) continue;
      v1::FetchResponse cut = m;
      // The last message ends at `end`, as the server cuts a range.
      const int n = std::min<int>(cut.pages().tokens(), end - cut.token_begin());
      cut.mutable_pages()->set_tokens(n);
      const KvStream& s0 = stored_->stream(0, 0);
      const size_t per_old = static_cast<size_t>(s0.PagesFor(m.pages().tokens())) * s0.layout().page_bytes;
      const size_t per_new = static_cast<size_t>(s0.PagesFor(n)) * s0.layout().page_bytes;
      std::string data;
      for (int h = 0; h < kHeads; ++h) data += m.pages().page_data().substr(h * per_old, per_new);
      cut.mutable_pages()->set_page_data(data);
      const absl::Status st = placer.Place(cut);
      ASSERT_TRUE(st.ok()) << st;
    }
    ASSERT_TRUE(placer.CheckComplete().ok()) << placer.CheckComplete();
    EXPECT_TRUE(k == want.k) << threads << " threads";
    EXPECT_TRUE(v == want.v) << threads << " threads";
  }
}

TEST_F(RawPagePlacerTest, AGapOrACorruptPageIsAnErrorThatNamesIt) {
  ReadOptions read;
  read.dtype = DType::kFloat16;
  const std::vector<v1::FetchResponse> messages = Messages(0, 2);  // 4 per layer.
  HostTensor k = HostTensor::Zeros(read.dtype, {kLayers, kHeads, 256, kDim});
  HostTensor v = HostTensor::Zeros(read.dtype, k.shape);
  {
    RawPagePlacer placer(*reader_, read, 4, 4, 260, 4, &k, &v);
    ASSERT_TRUE(placer.Place(messages[0]).ok());
    const absl::Status st = placer.Place(messages[2]);  // Skips [68, 132).
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(std::string(st.message()),
              "raw fetch response for layer 0 token 132 (64 tokens, 10368 bytes) does not "
              "continue the range: layer 0 is at token 68 of [4, 260), 3 kv heads of 32-token, "
              "1728-byte pages");
    EXPECT_EQ(placer.CheckComplete().code(), absl::StatusCode::kDataLoss);
  }
  {
    RawPagePlacer placer(*reader_, read, 4, 4, 260, 4, &k, &v);
    v1::FetchResponse bad = messages[1];
    const PageLayout& L = stored_->stream(0, 0).layout();
    const size_t per = 2 * L.page_bytes;
    // Head 1's second page: an infinite value scale.
    const uint16_t inf = 0x7c00;
    std::memcpy(bad.mutable_pages()->mutable_page_data()->data() + per + L.page_bytes +
                    L.value.params_offset,
                &inf, 2);
    ASSERT_TRUE(placer.Place(messages[0]).ok());
    const absl::Status st = placer.Place(bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(st.message()),
              "raw fetch of layer 0 kv head 1 from token 68: page 1 value row 0: scale 0 must be "
              "finite and >= 0");
  }
}

// Responses from a broken or hostile server: raw-page messages with a field
// corrupted at random (layer, first token, page count, page size or tokens
// per page, the data cut or grown, data bits flipped). Place either takes
// the message or fails with DATA_LOSS or INVALID_ARGUMENT; it never reads
// or writes outside the message and the output tensors (checked by the
// sanitizer build).
TEST_F(RawPagePlacerTest, RandomlyCorruptedResponsesArePlacedOrRejected) {
  ReadOptions read;
  read.dtype = DType::kFloat16;
  const std::vector<v1::FetchResponse> messages = Messages(0, 2);
  std::mt19937_64 rng(3);
  auto flip = [&](auto x) {
    using U = std::make_unsigned_t<decltype(x)>;
    return static_cast<decltype(x)>(static_cast<U>(x) ^ (U{1} << (rng() % (8 * sizeof(x)))));
  };
  int rejected = 0;
  for (int trial = 0; trial < 300; ++trial) {
    HostTensor k = HostTensor::Zeros(read.dtype, {kLayers, kHeads, 256, kDim});
    HostTensor v = HostTensor::Zeros(read.dtype, k.shape);
    RawPagePlacer placer(*reader_, read, 4, 4, 260, 4, &k, &v, 1 + trial % 2);
    for (size_t i = 0; i < messages.size(); ++i) {
      v1::FetchResponse m = messages[i];
      if (i == static_cast<size_t>(trial) % messages.size()) {
        v1::QuantizedPages* p = m.mutable_pages();
        std::string* data = p->mutable_page_data();
        switch (rng() % 8) {
          case 0: m.set_layer(flip(m.layer())); break;
          case 1: m.set_token_begin(flip(m.token_begin())); break;
          case 2: p->set_layers(flip(p->layers())); break;
          case 3: p->set_tokens(flip(p->tokens())); break;
          case 4: p->set_page_bytes(flip(p->page_bytes())); break;
          case 5: p->set_page_tokens(flip(p->page_tokens())); break;
          case 6: data->resize(rng() % (data->size() + 64)); break;
          default:
            for (int f = 1 + static_cast<int>(rng() % 4); f > 0; --f) {
              (*data)[rng() % data->size()] ^= static_cast<char>(1 << (rng() % 8));
            }
        }
      }
      const absl::Status st = placer.Place(m);
      if (st.ok()) continue;
      EXPECT_TRUE(st.code() == absl::StatusCode::kDataLoss ||
                  st.code() == absl::StatusCode::kInvalidArgument)
          << "trial " << trial << ": " << st;
      ++rejected;
      break;
    }
  }
  EXPECT_GE(rejected, 150);
}

TEST(FetchPlacerTest, DenseRowsLandAtTheirOffset) {
  FetchOptions part;
  part.layer_begin = 0;
  part.token_begin = 10;
  part.token_end = 13;
  part.dtype = DType::kFloat32;
  HostTensor k = HostTensor::Zeros(DType::kFloat32, {1, 1, 8, 2});
  HostTensor v = HostTensor::Zeros(DType::kFloat32, k.shape);
  FetchPlacer placer(part, &k, &v, /*out_offset=*/5, /*tokens=*/3);
  v1::FetchResponse m;
  m.set_layer(0);
  m.set_token_begin(10);
  const HostTensor rows = HostTensor::FromFloats({1, 2, 3, 4, 5, 6}, {1, 3, 2}).value();
  ToProto(rows, m.mutable_k());
  ToProto(rows, m.mutable_v());
  ASSERT_TRUE(placer.Place(m).ok());
  ASSERT_TRUE(placer.CheckComplete().ok());
  EXPECT_EQ(k.ToFloats(), (std::vector<float>{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(placer.Place(m).code(), absl::StatusCode::kDataLoss);  // Past the part's 3 tokens.
}

}  // namespace
}  // namespace kvq
