// A one-line progress bar on a terminal stream (the CLI's stderr).
#ifndef KVQ_CLIENT_PROGRESS_BAR_H_
#define KVQ_CLIENT_PROGRESS_BAR_H_

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/time/time.h"

namespace kvq {

class ProgressBar {
 public:
  // Draws nothing unless `enabled`. When not `forced`, the bar appears only
  // once a transfer has run for `delay` (short transfers stay quiet).
  ProgressBar(std::string label, bool enabled, bool forced, FILE* out = stderr,
              absl::Duration delay = absl::Milliseconds(300));
  ~ProgressBar();

  // `total` < 0: unknown (no percentage). Redraws at most ~10 times a second.
  void Update(int64_t done, int64_t total);
  // Draws the final state and ends the line (if anything was drawn).
  void Finish();

  // The text of one bar, e.g. "append [#####.....]  50%  1.0/2.0 MiB  8.0 MiB/s".
  static std::string Render(absl::string_view label, int64_t done, int64_t total,
                            double seconds, int width = 30);

 private:
  void Draw();

  std::string label_;
  bool enabled_;
  bool forced_;
  FILE* out_;
  absl::Duration delay_;
  absl::Time start_;
  absl::Time last_draw_ = absl::InfinitePast();
  int64_t done_ = 0;
  int64_t total_ = -1;
  size_t last_len_ = 0;
  bool drawn_ = false;
  bool finished_ = false;
};

}  // namespace kvq

#endif  // KVQ_CLIENT_PROGRESS_BAR_H_
