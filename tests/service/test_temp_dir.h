// A fresh, empty folder under the system temp dir named for the running
// test (prefix, pid, test name), for tests that write files a component
// then reads; removed with the object.
#ifndef KVQ_TESTS_SERVICE_TEST_TEMP_DIR_H_
#define KVQ_TESTS_SERVICE_TEST_TEMP_DIR_H_

#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvq {

class TestTempDir {
 public:
  explicit TestTempDir(const std::string& prefix)
      : path_((std::filesystem::temp_directory_path() /
               absl::StrCat(prefix, getpid(), "_",
                            ::testing::UnitTest::GetInstance()->current_test_info()->name()))
                  .string()) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TestTempDir() { std::filesystem::remove_all(path_); }
  TestTempDir(const TestTempDir&) = delete;
  TestTempDir& operator=(const TestTempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace kvq

#endif  // KVQ_TESTS_SERVICE_TEST_TEMP_DIR_H_
