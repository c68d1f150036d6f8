#ifndef KVQ_TESTS_TEST_CERTS_FIXTURE_H_
#define KVQ_TESTS_TEST_CERTS_FIXTURE_H_

// A test suite's fixture whose tests share one set of certificates from
// tests/integration/make_test_certs.sh (KVQ_MAKE_CERTS_SH, a compile
// definition of the test): made once per suite in a temporary folder,
// removed after it. The script prints its errors itself.
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvq {

class TestCertsFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(absl::StrCat(::testing::TempDir(), "/kvq_test_certs_", getpid()));
    made_ = std::system(absl::StrCat("'", KVQ_MAKE_CERTS_SH, "' '", *dir_, "'").c_str()) == 0;
  }
  static void TearDownTestSuite() {
    std::system(absl::StrCat("rm -rf '", *dir_, "'").c_str());
    delete dir_;
  }
  void SetUp() override { ASSERT_TRUE(made_) << "make_test_certs.sh failed"; }

  // The path of file `name` (ca.pem, server.pem, ...) of the suite's set.
  static std::string F(const std::string& name) { return *dir_ + "/" + name; }

 private:
  static inline std::string* dir_ = nullptr;
  static inline bool made_ = false;
};

}  // namespace kvq

#endif  // KVQ_TESTS_TEST_CERTS_FIXTURE_H_
