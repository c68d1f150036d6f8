// Calibration files (*.kvqcal): a ModelCalibration on disk, as kvq-eval
// --write_calibration writes it and kvq-server --calibration_dir loads it.
//
// Layout, little-endian, no padding:
//   offset 0   8 bytes   magic "KVQCAL\0\0"
//              u32       version (kCalibrationFileVersion)
//              u32       name length N (<= kMaxCalibrationNameBytes), N bytes
//              u32       model length M (<= kMaxCalibrationModelBytes), M bytes
//              i32 x 3   num_layers, num_kv_heads, head_dim
//              f32 ...   per (layer, KV head), layer-major: key_mean,
//                        key_scale, value_mean, value_scale ([head_dim] each)
//              u64       XXH3-64 of every byte before it
// `model` is a fingerprint of the model the statistics were taken from (its
// file name and attention shape): informative, never compared.
#ifndef KVQ_KERNELS_CALIBRATION_FILE_H_
#define KVQ_KERNELS_CALIBRATION_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/calibration.h"

namespace kvq {

inline constexpr char kCalibrationMagic[8] = {'K', 'V', 'Q', 'C', 'A', 'L', 0, 0};
inline constexpr uint32_t kCalibrationFileVersion = 1;
// A name is what CreateSequenceRequest.calibration carries (a request
// string, bounded like the other names).
inline constexpr size_t kMaxCalibrationNameBytes = 128;
inline constexpr size_t kMaxCalibrationModelBytes = 1024;
inline constexpr char kCalibrationFileExtension[] = ".kvqcal";

// A parsed file: the calibration, the model it describes and the file's
// checksum (what a sequence's prefix-reuse key includes, so two versions of
// one name never share pages).
struct CalibrationFile {
  ModelCalibration calibration;
  std::string model;
  uint64_t checksum = 0;
};

// INVALID_ARGUMENT naming both shapes when `c` is not for a model of
// `num_layers` x `num_kv_heads` x `head_dim`.
absl::Status CheckCalibrationShape(const ModelCalibration& c, int num_layers, int num_kv_heads,
                                   int head_dim);

// Letters, digits and - _ . : only, 1..kMaxCalibrationNameBytes bytes;
// INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckCalibrationName(absl::string_view name, absl::string_view field);

// The file's bytes. INVALID_ARGUMENT when `calibration` fails Validate(),
// its name CheckCalibrationName() or `model` is longer than its bound.
absl::StatusOr<std::string> SerializeCalibration(const ModelCalibration& calibration,
                                                 absl::string_view model);

// Parses and checks a file's bytes: INVALID_ARGUMENT for a file that is not
// a calibration (magic), a version this build does not read, a header value
// outside its bounds or statistics that fail ModelCalibration::Validate();
// DATA_LOSS for a file shorter or longer than its header describes, or
// whose checksum does not match.
absl::StatusOr<CalibrationFile> ParseCalibration(absl::string_view bytes);

// SerializeCalibration into `path` (written to a temporary file and renamed
// over it, so a server rescanning the directory never reads half a file).
absl::Status WriteCalibrationFile(const std::string& path, const ModelCalibration& calibration,
                                  absl::string_view model);
// ParseCalibration of `path`'s bytes; NOT_FOUND when it cannot be read.
// Messages start with the path.
absl::StatusOr<CalibrationFile> ReadCalibrationFile(const std::string& path);

}  // namespace kvq

#endif  // KVQ_KERNELS_CALIBRATION_FILE_H_
