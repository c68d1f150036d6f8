#include "service/calibrations.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace kvq {

bool TakesCalibration(const QuantSpec& spec) { return spec.is_crq(); }

Calibrations::ScanReport Calibrations::Rescan() {
  ScanReport report;
  if (dir_.empty()) return report;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir_, ec);
  if (ec) {
    report.skipped.push_back(
        absl::UnavailableError(absl::StrCat(dir_, ": cannot list: ", ec.message())));
    return report;
  }
  std::vector<std::filesystem::path> paths;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    const std::filesystem::path& p = it->path();
    if (p.extension() == kCalibrationFileExtension && it->is_regular_file(ec)) paths.push_back(p);
  }
  if (ec) {
    report.skipped.push_back(
        absl::UnavailableError(absl::StrCat(dir_, ": cannot list: ", ec.message())));
    return report;
  }
  std::sort(paths.begin(), paths.end());
  // Stems present, whether or not they loaded: a file that fails keeps its
  // previous version; only a file that is gone unloads.
  absl::flat_hash_map<std::string, std::shared_ptr<const CalibrationFile>> fresh;
  std::vector<std::string> present;
  for (const std::filesystem::path& p : paths) {
    const std::string stem = p.stem().string();
    present.push_back(stem);
    absl::StatusOr<CalibrationFile> file = ReadCalibrationFile(p.string());
    if (!file.ok()) {
      report.skipped.push_back(file.status());
      continue;
    }
    if (file->calibration.name != stem) {
      report.skipped.push_back(absl::InvalidArgumentError(absl::StrCat(
          p.string(), ": holds calibration \"", file->calibration.name,
          "\"; a calibration file must be named after it (", file->calibration.name,
          kCalibrationFileExtension, ")")));
      continue;
    }
    fresh[stem] = std::make_shared<const CalibrationFile>(*std::move(file));
  }
  absl::MutexLock lock(&mu_);
  for (auto& [name, file] : fresh) {
    auto old = by_name_.find(name);
    if (old == by_name_.end() || old->second->checksum != file->checksum) {
      report.loaded.push_back(name);
      by_name_[name] = std::move(file);
    }
  }
  for (auto it = by_name_.begin(); it != by_name_.end();) {
    if (std::find(present.begin(), present.end(), it->first) == present.end()) {
      report.removed.push_back(it->first);
      by_name_.erase(it++);
    } else {
      ++it;
    }
  }
  std::sort(report.loaded.begin(), report.loaded.end());
  std::sort(report.removed.begin(), report.removed.end());
  return report;
}

std::shared_ptr<const CalibrationFile> Calibrations::Find(absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<std::string> Calibrations::Names() const {
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, file] : by_name_) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

size_t Calibrations::size() const {
  absl::MutexLock lock(&mu_);
  return by_name_.size();
}

}  // namespace kvq
