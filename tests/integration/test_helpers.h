#ifndef KVQ_TESTS_INTEGRATION_TEST_HELPERS_H_
#define KVQ_TESTS_INTEGRATION_TEST_HELPERS_H_

// Helpers that several integration tests share.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/host_tensor.h"
#include "client/local_sequence.h"
#include "client/sequence_config.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"

namespace kvq {

// Polls `done` until it holds or `bound` passes (a slow machine only waits
// longer; nothing asserts on this timing).
template <typename F>
bool PollUntil(F done, absl::Duration bound = absl::Seconds(15)) {
  const absl::Time give_up = absl::Now() + bound;
  while (!done()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return true;
}

// The dequantization (fp32) of `chunks` appended in order to a fresh
// sequence of `config`, computed here with the CPU kernels.
inline FetchedKv LocalDequant(const SequenceConfig& config,
                              const std::vector<std::pair<HostTensor, HostTensor>>& chunks) {
  absl::StatusOr<std::unique_ptr<LocalSequence>> local = LocalSequence::Create(config);
  EXPECT_TRUE(local.ok()) << local.status();
  if (!local.ok()) return {};
  for (const auto& [k, v] : chunks) {
    v1::KvChunk c;
    ToProto(k, c.mutable_k());
    ToProto(v, c.mutable_v());
    absl::Status st = (*local)->ApplyChunk(c);
    EXPECT_TRUE(st.ok()) << st;
  }
  ReadOptions ro;
  ro.dtype = DType::kFloat32;
  ro.apply_rope = false;
  absl::StatusOr<FetchedKv> out = (*local)->Read(0, -1, ro);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : FetchedKv();
}

// Replaces `to` with a copy of `from` in one rename (a server that
// reloads `to` never sees it half written).
inline void ReplaceFile(const std::string& from, const std::string& to) {
  std::string out;
  ASSERT_EQ(RunCommand(absl::StrCat("cp '", from, "' '", to, ".new' && mv -f '", to, ".new' '", to,
                                    "'"),
                       &out),
            0)
      << out;
}

// Makes folder `live` holding cert.pem and key.pem, copies of `cert` and
// `key`: the files a rotation test replaces while the server runs.
inline void MakeLiveCertFolder(const std::string& live, const std::string& cert,
                               const std::string& key) {
  std::string out;
  ASSERT_EQ(RunCommand(absl::StrCat("mkdir -p '", live, "'"), &out), 0) << out;
  ASSERT_NO_FATAL_FAILURE(ReplaceFile(cert, live + "/cert.pem"));
  ASSERT_NO_FATAL_FAILURE(ReplaceFile(key, live + "/key.pem"));
}

}  // namespace kvq

#endif  // KVQ_TESTS_INTEGRATION_TEST_HELPERS_H_
