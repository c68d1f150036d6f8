// Prefix reuse under calibrations (SequenceStore): a stored prefix is
// offered only to a sequence of the same calibration name and version (the
// file's checksum), and a sequence reusing it shares that calibration.
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/calibration_file.h"
#include "service/sequence_store.h"
#include "tests/service/store_test_data.h"

namespace kvq {
namespace {

constexpr int kLayers = 2, kHeads = 2, kDim = 64;

std::shared_ptr<const CalibrationFile> Calibration(const std::string& name, uint64_t checksum) {
  auto file = std::make_shared<CalibrationFile>();
  file->calibration.name = name;
  file->calibration.num_layers = kLayers;
  file->calibration.num_kv_heads = kHeads;
  file->calibration.head_dim = kDim;
  file->calibration.heads.assign(kLayers * kHeads, HeadCalibration::Identity(kDim));
  file->checksum = checksum;
  return file;
}

CreateSequenceArgs Args(const std::string& id, std::shared_ptr<const CalibrationFile> c) {
  CreateSequenceArgs a;
  a.ns = "ns";
  a.id = id;
  a.shape = GqaShape(kLayers, kHeads, kDim);
  // The store holds whatever calibration the edge resolved; kivi streams
  // ignore it, so the prefix logic is tested on any scheme.
  a.scheme = "kivi2";
  a.calibration = std::move(c);
  return a;
}

TEST(CalibrationPrefixTest, OnlyTheSameNameAndVersionShareAPrefix) {
  std::unique_ptr<SequenceStore> store = NewTestStore(16 << 20);
  std::vector<int32_t> ids(600);
  for (int i = 0; i < 600; ++i) ids[i] = 1000 + i;
  const auto a1 = Calibration("a", 1);
  {
    absl::StatusOr<SequenceStore::Handle> first = store->Create(Args("first", a1));
    ASSERT_TRUE(first.ok()) << first.status();
    absl::MutexLock lock(&(*first)->mu());
    ASSERT_TRUE((*first)->AppendDense(RandomKv(kLayers, kHeads, kDim, 600, 1).view(600)).ok());
    (*first)->token_ids() = ids;
    store->RegisterPrefixBlocks(first->shared());
  }
  int block = 0;
  auto match = [&](std::shared_ptr<const CalibrationFile> c) {
    CreateSequenceArgs probe = Args("", std::move(c));
    probe.prompt_token_ids = ids;
    return store->MatchPrefix(probe, &block).value_or(-1);
  };
  EXPECT_EQ(match(a1), 512);  // Whole blocks of 128.
  EXPECT_EQ(match(Calibration("a", 1)), 512) << "another copy of the same version";
  EXPECT_EQ(match(Calibration("a", 2)), 0) << "another version of the name";
  EXPECT_EQ(match(Calibration("b", 1)), 0) << "another name";
  EXPECT_EQ(match(nullptr), 0) << "no calibration";

  CreateSequenceArgs other = Args("other-version", Calibration("a", 2));
  other.prompt_token_ids = ids;
  absl::StatusOr<SequenceStore::Handle> fresh = store->Create(other);
  ASSERT_TRUE(fresh.ok());
  {
    absl::ReaderMutexLock lock(&(*fresh)->mu());
    EXPECT_EQ((*fresh)->num_tokens(), 0);
    EXPECT_EQ((*fresh)->calibration()->checksum, 2u);
  }
  CreateSequenceArgs same = Args("same-version", Calibration("a", 1));
  same.prompt_token_ids = ids;
  absl::StatusOr<SequenceStore::Handle> reused = store->Create(same);
  ASSERT_TRUE(reused.ok());
  absl::ReaderMutexLock lock(&(*reused)->mu());
  EXPECT_EQ((*reused)->num_tokens(), 512);
  // The reused prefix's streams were made with the source's statistics,
  // which the new sequence now keeps.
  EXPECT_EQ((*reused)->calibration(), a1);
}

TEST(CalibrationPrefixTest, ACalibrationOfAnotherShapeIsRefusedNamingBoth) {
  std::unique_ptr<SequenceStore> store = NewTestStore(16 << 20);
  auto wrong = std::make_shared<CalibrationFile>(*Calibration("w", 1));
  wrong->calibration.num_layers = 3;
  wrong->calibration.heads.resize(3 * kHeads, HeadCalibration::Identity(kDim));
  absl::StatusOr<SequenceStore::Handle> s = store->Create(Args("x", wrong));
  EXPECT_EQ(s.status(), absl::InvalidArgumentError(
                            "calibration \"w\" is for 3 layers x 2 KV heads x head_dim 64; the "
                            "layout is 2 layers x 2 KV heads x head_dim 64"));
}

}  // namespace
}  // namespace kvq
