// `kvq-bench device`: flags and output of the device benchmark
// (bench/device_bench.h). --probe only names the device (exit 1 without one):
// scripts/gpu_check.sh asks it first.
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "bench/device_bench.h"

ABSL_DECLARE_FLAG(std::vector<std::string>, schemes);
ABSL_DECLARE_FLAG(int, reps);
ABSL_DECLARE_FLAG(int, warmup);
ABSL_DECLARE_FLAG(int, page_tokens);
ABSL_FLAG(bool, probe, false, "device: print device 0's name, memory and SMs; exit 1 without one.");
ABSL_FLAG(int, batch, 64, "device: sequences attended over in one launch.");
ABSL_FLAG(int, context, 32768, "device: tokens per sequence.");
ABSL_FLAG(std::string, json_out, "", "device: also write the figures and checks as JSON here.");

namespace kvq {

int DeviceMain(const std::string& command) {
  if (absl::GetFlag(FLAGS_probe)) {
    absl::StatusOr<std::string> device = ProbeDevice();
    if (!device.ok()) {
      std::cerr << "kvq-bench device: " << device.status().message() << "\n";
      return 1;
    }
    std::cout << *device << "\n";
    return 0;
  }
  DeviceBenchOptions options;
  options.schemes = absl::GetFlag(FLAGS_schemes);
  options.batch = absl::GetFlag(FLAGS_batch);
  options.context = absl::GetFlag(FLAGS_context);
  options.warmup = absl::GetFlag(FLAGS_warmup);
  options.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  if (absl::GetFlag(FLAGS_reps) > 0) options.reps = absl::GetFlag(FLAGS_reps);
  absl::StatusOr<DeviceBenchResult> result = RunDeviceBench(options, &std::cerr);
  if (!result.ok()) {
    std::cerr << "kvq-bench device: " << result.status() << "\n";
    return 1;
  }
  const std::vector<CheckResult> checks = CheckDeviceBench(*result);
  std::cout << FormatDeviceTable(*result, command) << "\n" << FormatChecks(checks);
  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  if (!json_out.empty()) {
    std::ofstream out(json_out);
    out << FormatDeviceJson(*result, command, checks);
    if (!out) {
      std::cerr << "kvq-bench device: cannot write " << json_out << "\n";
      return 1;
    }
  }
  // The targets are reported, not the exit status: a run that measured
  // every figure succeeded whatever the figures are.
  return 0;
}

}  // namespace kvq
