// Calibrations: the calibration files (*.kvqcal) a server has loaded from
// its --calibration_dir, by name.
//
// A file's name is the one written inside it (kvq-eval
// --calibration_name), and the file must be named after it: NAME.kvqcal.
// A file named otherwise is skipped (so one name never comes from two
// files). Rescan() re-reads the directory: a new or changed file that
// validates replaces the version loaded before; one that fails validation
// is reported and skipped, and the version loaded before (if any) stays; a
// file that is gone unloads its name. Sequences hold the version they were
// created with (a shared_ptr), so a reload never changes a stored
// sequence's statistics.
//
// Thread-safe.
#ifndef KVQ_SERVICE_CALIBRATIONS_H_
#define KVQ_SERVICE_CALIBRATIONS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/calibration_file.h"
#include "kernels/quant_spec.h"

namespace kvq {

// Whether `spec` stores K/V through a calibration (the crq schemes).
bool TakesCalibration(const QuantSpec& spec);

class Calibrations {
 public:
  // Nothing is loaded until the first Rescan(). An empty `dir` never loads
  // anything.
  explicit Calibrations(std::string dir) : dir_(std::move(dir)) {}

  struct ScanReport {
    std::vector<std::string> loaded;    // Names loaded or replaced.
    std::vector<std::string> removed;   // Names whose file is gone.
    std::vector<absl::Status> skipped;  // Files not loaded, the path first in each message.
  };
  // Reads every *.kvqcal file of the directory (see above). An unreadable
  // directory is one skipped entry and unloads nothing.
  ScanReport Rescan();

  // The version loaded now, null when `name` is not loaded.
  std::shared_ptr<const CalibrationFile> Find(absl::string_view name) const;
  // Loaded names, sorted.
  std::vector<std::string> Names() const;
  size_t size() const;
  const std::string& dir() const { return dir_; }

 private:
  const std::string dir_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const CalibrationFile>> by_name_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvq

#endif  // KVQ_SERVICE_CALIBRATIONS_H_
