// `kvq-bench convert`: the client's share of a quantized prompt round trip
// (kvq-bench rpc's roundtrip section), in this process with no server and
// no wire: quantizing the prompt into Append chunks as
// AppendPromptQuantized does, and dequantizing raw-page fetch messages into
// fp16 tensors as FetchDequantLocalInto does, against a memcpy and a memset
// of the same fp16 bytes measured in the same run. It says how much of a
// round trip's time the two cores spend converting.
#ifndef KVQ_BENCH_CONVERT_BENCH_H_
#define KVQ_BENCH_CONVERT_BENCH_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvq {

struct ConvertBenchOptions {
  int tokens = 4096;
  int reps = 7;
  int warmup = 2;
  int64_t chunk_bytes = int64_t{1} << 20;  // Append chunks and fetch messages.
  std::vector<std::string> schemes = {"kivi4", "kivi2"};
};

struct ConvertRow {
  std::string id;      // e.g. "kivi2_quantize_t1".
  std::string scheme;  // "" for the baselines.
  std::string label;   // What ran.
  int threads = 1;
  int64_t fp16_bytes = 0;  // fp16 K+V the row converts (or copies).
  std::vector<double> seconds;
  double median_s = 0.0;
};

struct ConvertBenchResult {
  int tokens = 0;
  int64_t fp16_bytes = 0;  // K + V of the prompt.
  int hardware_threads = 0;
  std::vector<ConvertRow> rows;
};

absl::StatusOr<ConvertBenchResult> RunConvertBench(const ConvertBenchOptions& options,
                                                   std::ostream* progress);
std::string FormatConvertTable(const ConvertBenchResult& result, const std::string& command);
std::string FormatConvertJson(const ConvertBenchResult& result, const std::string& command);

}  // namespace kvq

#endif  // KVQ_BENCH_CONVERT_BENCH_H_
