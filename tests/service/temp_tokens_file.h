// A tokens file path (the server's --tokens_file) in a fresh folder of its
// own under /tmp, for the tests that load, watch or serve one; the file and
// the folder are removed with the object.
#ifndef KVQ_TESTS_SERVICE_TEMP_TOKENS_FILE_H_
#define KVQ_TESTS_SERVICE_TEMP_TOKENS_FILE_H_

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvq {

class TempTokensFile {
 public:
  TempTokensFile() = default;
  TempTokensFile(const TempTokensFile&) = delete;
  TempTokensFile& operator=(const TempTokensFile&) = delete;
  ~TempTokensFile() {
    if (dir_.empty()) return;
    std::remove(path_.c_str());
    rmdir(dir_.c_str());
  }

  // Makes the folder /tmp/<prefix>XXXXXX (the file is not written); false
  // when mkdtemp fails.
  bool Create(const std::string& prefix) {
    std::string dir = "/tmp/" + prefix + "XXXXXX";
    if (mkdtemp(dir.data()) == nullptr) return false;
    dir_ = dir;
    path_ = dir_ + "/tokens";
    return true;
  }

  const std::string& dir() const { return dir_; }
  const std::string& path() const { return path_; }

 private:
  std::string dir_, path_;
};

}  // namespace kvq

#endif  // KVQ_TESTS_SERVICE_TEMP_TOKENS_FILE_H_
