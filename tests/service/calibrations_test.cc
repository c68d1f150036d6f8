#include "service/calibrations.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/test_temp_dir.h"

namespace kvq {
namespace {

ModelCalibration Calibration(const std::string& name, float mean) {
  ModelCalibration c;
  c.name = name;
  c.num_layers = 1;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  HeadCalibration h = HeadCalibration::Identity(4);
  h.key_mean.assign(4, mean);
  c.heads = {h};
  return c;
}

class CalibrationsTest : public ::testing::Test {
 protected:
  void Write(const std::string& file, const ModelCalibration& c) {
    ASSERT_TRUE(WriteCalibrationFile(dir_ + "/" + file, c, "m").ok());
  }
  TestTempDir temp_{"kvq_calibrations_unit_"};
  const std::string dir_ = temp_.path();
};

TEST_F(CalibrationsTest, ARescanReplacesChangedFilesAndKeepsTheLastGoodVersion) {
  Calibrations calibrations(dir_);
  ASSERT_NO_FATAL_FAILURE(Write("a.kvqcal", Calibration("a", 1.0f)));
  Calibrations::ScanReport r = calibrations.Rescan();
  EXPECT_EQ(r.loaded, std::vector<std::string>({"a"}));
  EXPECT_TRUE(r.skipped.empty());
  std::shared_ptr<const CalibrationFile> v1 = calibrations.Find("a");
  ASSERT_NE(v1, nullptr);
  EXPECT_EQ(v1->calibration.heads[0].key_mean[0], 1.0f);

  // Unchanged: nothing reloaded, the same object served.
  r = calibrations.Rescan();
  EXPECT_TRUE(r.loaded.empty());
  EXPECT_EQ(calibrations.Find("a"), v1);

  // Changed: the new version is served; a holder of the old one keeps it.
  ASSERT_NO_FATAL_FAILURE(Write("a.kvqcal", Calibration("a", 2.0f)));
  r = calibrations.Rescan();
  EXPECT_EQ(r.loaded, std::vector<std::string>({"a"}));
  std::shared_ptr<const CalibrationFile> v2 = calibrations.Find("a");
  EXPECT_EQ(v2->calibration.heads[0].key_mean[0], 2.0f);
  EXPECT_NE(v2->checksum, v1->checksum);
  EXPECT_EQ(v1->calibration.heads[0].key_mean[0], 1.0f);

  // Damaged: skipped with the path and why; version 2 stays.
  std::ofstream(dir_ + "/a.kvqcal", std::ios::binary | std::ios::trunc) << "KVQCAL";
  r = calibrations.Rescan();
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(r.skipped[0].message(), dir_ + "/a.kvqcal: "))
      << r.skipped[0];
  EXPECT_EQ(calibrations.Find("a"), v2);

  // Gone: unloaded.
  std::filesystem::remove(dir_ + "/a.kvqcal");
  r = calibrations.Rescan();
  EXPECT_EQ(r.removed, std::vector<std::string>({"a"}));
  EXPECT_EQ(calibrations.Find("a"), nullptr);
  EXPECT_EQ(calibrations.size(), 0u);
}

TEST_F(CalibrationsTest, AFileMustBeNamedAfterItsCalibration) {
  Calibrations calibrations(dir_);
  ASSERT_NO_FATAL_FAILURE(Write("x.kvqcal", Calibration("y", 1.0f)));
  ASSERT_NO_FATAL_FAILURE(Write("y.kvqcal", Calibration("y", 1.0f)));
  Calibrations::ScanReport r = calibrations.Rescan();
  EXPECT_EQ(calibrations.Names(), std::vector<std::string>({"y"}));
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_EQ(r.skipped[0].message(),
            absl::StrCat(dir_, "/x.kvqcal: holds calibration \"y\"; a calibration file must be "
                               "named after it (y.kvqcal)"));
}

TEST_F(CalibrationsTest, AMissingDirectoryUnloadsNothing) {
  Calibrations calibrations(dir_);
  ASSERT_NO_FATAL_FAILURE(Write("a.kvqcal", Calibration("a", 1.0f)));
  calibrations.Rescan();
  std::filesystem::remove_all(dir_);
  Calibrations::ScanReport r = calibrations.Rescan();
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(r.skipped[0].message(), dir_ + ": cannot list: "))
      << r.skipped[0];
  EXPECT_NE(calibrations.Find("a"), nullptr);
}

TEST(TakesCalibrationTest, OnlyCrqSchemes) {
  EXPECT_TRUE(TakesCalibration(*QuantSpec::Parse("crq3:pre_rope")));
  EXPECT_FALSE(TakesCalibration(*QuantSpec::Parse("kivi2:pre_rope")));
  EXPECT_FALSE(TakesCalibration(*QuantSpec::Parse("fp16")));
}

}  // namespace
}  // namespace kvq
