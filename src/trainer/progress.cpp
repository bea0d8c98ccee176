// Progress bar / progress lines.
#include "dtrain/trainer/progress.h"

#include <unistd.h>

#include <algorithm>

namespace dtrain {

Progress::Progress(std::int64_t total, ProgressOptions options)
    : total_(std::max<std::int64_t>(total, 1)),
      options_(std::move(options)),
      interactive_(options_.interactive.value_or(isatty(fileno(options_.out)) != 0)),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void Progress::update(std::int64_t done, const std::string& status) {
  if (!options_.enabled) return;
  const auto now = std::chrono::steady_clock::now();
  const auto interval = interactive_ ? std::chrono::milliseconds(100) : options_.line_interval;
  if (now - last_draw_ < interval) return;
  draw(done, status, false);
}

void Progress::finish(const std::string& status) {
  if (!options_.enabled) return;
  draw(total_, status, true);
}

void Progress::draw(std::int64_t done, const std::string& status, bool final) {
  last_draw_ = std::chrono::steady_clock::now();
  last_done_ = done;
  const double seconds = std::chrono::duration<double>(last_draw_ - start_).count();
  const double fraction = std::clamp(static_cast<double>(done) / static_cast<double>(total_), 0.0, 1.0);
  const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
  const std::string tail = status.empty() ? "" : "  " + status;
  if (interactive_) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(options_.out, "\r%s [%s] %3.0f%% %lld/%lld %.1f/s%s\033[K%s", options_.label.c_str(), bar.c_str(),
                 fraction * 100, static_cast<long long>(done), static_cast<long long>(total_), rate, tail.c_str(),
                 final ? "\n" : "");
  } else {
    std::fprintf(options_.out, "%s %3.0f%% %lld/%lld %.1f/s %.1fs%s\n", options_.label.c_str(), fraction * 100,
                 static_cast<long long>(done), static_cast<long long>(total_), rate, seconds, tail.c_str());
  }
  std::fflush(options_.out);
}

}  // namespace dtrain
