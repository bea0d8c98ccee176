// A Chrome trace-event timeline of one rank's training (opens in Perfetto or
// chrome://tracing): spans for data wait, forward, backward, each DDP
// communication bucket (start to end, on its own track), optimizer step.
//
//   dtrain::Tracer tracer("trace.rank0.json", rank);
//   { auto s = tracer.span("forward", "compute"); ... }
//   tracer.write();                                 // also on destruction
//
// The file is {"traceEvents": [...]} with complete events ("ph": "X", ts and
// dur in microseconds since the tracer started), pid = rank, tid 0 for the
// training thread and 1 for communication. Thread-safe: buckets complete on
// communication threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace dtrain {

class Tracer {
 public:
  static constexpr int kTrainTrack = 0;
  static constexpr int kCommTrack = 1;

  Tracer(std::filesystem::path file, int rank);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Microseconds since construction.
  std::int64_t now_us() const;
  // Records a complete span [start_us, end_us] on `track`, tagged with the current step.
  void record(const std::string& name, const char* category, std::int64_t start_us, std::int64_t end_us,
              int track = kTrainTrack);
  void set_step(std::int64_t step);

  // Records from construction to destruction.
  class Span {
   public:
    Span(Tracer* tracer, std::string name, const char* category);
    ~Span();
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    Tracer* tracer_;
    std::string name_;
    const char* category_;
    std::int64_t start_us_;
  };
  // A span; with a null tracer it records nothing (so call sites need no checks).
  static Span span(Tracer* tracer, std::string name, const char* category) {
    return Span(tracer, std::move(name), category);
  }

  // Writes the whole timeline so far (replacing the file).
  void write();
  const std::filesystem::path& file() const { return file_; }

 private:
  struct Event {
    std::string name;
    const char* category;
    std::int64_t start_us;
    std::int64_t end_us;
    int track;
    std::int64_t step;
  };
  std::filesystem::path file_;
  int rank_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex mutex_;
  std::int64_t step_ = 0;
  std::vector<Event> events_;
};

// `file` for one rank of `world`: unchanged for one rank, else
// <stem>.rank<R><extension> (trace.json -> trace.rank1.json).
std::filesystem::path per_rank_path(const std::filesystem::path& file, int rank, int world);

}  // namespace dtrain
