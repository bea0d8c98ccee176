// Training progress for people: a redrawn bar on a terminal, periodic whole
// lines otherwise (logs, CI), so output stays readable in both places.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace dtrain {

struct ProgressOptions {
  std::string label = "train";
  // Bar or lines; defaults to whether `out` is a terminal.
  std::optional<bool> interactive;
  // Lines mode: print at most this often (and at the end).
  std::chrono::milliseconds line_interval = std::chrono::seconds(5);
  FILE* out = stderr;
  bool enabled = true;  // e.g. rank == 0
};

class Progress {
 public:
  Progress(std::int64_t total, ProgressOptions options);
  // Marks `done` of `total` units complete; `status` is shown after the count
  // (e.g. "loss 0.41").
  void update(std::int64_t done, const std::string& status = "");
  // Draws the final state and ends the bar's line.
  void finish(const std::string& status = "");

 private:
  void draw(std::int64_t done, const std::string& status, bool final);

  std::int64_t total_;
  ProgressOptions options_;
  bool interactive_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
  std::int64_t last_done_ = -1;
};

}  // namespace dtrain
