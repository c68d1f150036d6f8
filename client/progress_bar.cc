#include "client/progress_bar.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace kvq {

ProgressBar::ProgressBar(std::string label, bool enabled, bool forced, FILE* out,
                         absl::Duration delay)
    : label_(std::move(label)),
      enabled_(enabled),
      forced_(forced),
      out_(out),
      delay_(delay),
      start_(absl::Now()) {}

ProgressBar::~ProgressBar() { Finish(); }

std::string ProgressBar::Render(absl::string_view label, int64_t done, int64_t total,
                                double seconds, int width) {
  constexpr double kMiB = 1024.0 * 1024.0;
  const double rate = seconds > 0.0 ? done / kMiB / seconds : 0.0;
  if (total < 0) {
    return absl::StrFormat("%s  %.1f MiB  %.1f MiB/s", label, done / kMiB, rate);
  }
  const double frac = total > 0 ? std::clamp(static_cast<double>(done) / total, 0.0, 1.0) : 1.0;
  const int fill = static_cast<int>(frac * width + 0.5);
  return absl::StrFormat("%s [%s%s] %3d%%  %.1f/%.1f MiB  %.1f MiB/s", label,
                         std::string(fill, '#'), std::string(width - fill, '.'),
                         static_cast<int>(frac * 100.0 + 0.5), done / kMiB, total / kMiB, rate);
}

void ProgressBar::Draw() {
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
  std::string line = Render(label_, done_, total_, seconds);
  const size_t len = line.size();
  // Pad over the previous line instead of a terminal escape: the bar may go
  // to a file (--progress).
  if (len < last_len_) line.append(last_len_ - len, ' ');
  last_len_ = len;
  absl::FPrintF(out_, "\r%s", line);
  std::fflush(out_);
  drawn_ = true;
  last_draw_ = absl::Now();
}

void ProgressBar::Update(int64_t done, int64_t total) {
  done_ = done;
  total_ = total;
  if (!enabled_ || finished_) return;
  const absl::Time now = absl::Now();
  if (!forced_ && now - start_ < delay_) return;
  if (now - last_draw_ < absl::Milliseconds(100)) return;
  Draw();
}

void ProgressBar::Finish() {
  if (finished_) return;
  finished_ = true;
  if (!enabled_ || (!drawn_ && !forced_)) return;
  Draw();
  absl::FPrintF(out_, "\n");
  std::fflush(out_);
}

}  // namespace kvq
