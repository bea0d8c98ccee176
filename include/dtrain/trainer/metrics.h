// Training metrics to JSON lines and to TensorBoard event files.
//
//   dtrain::MetricsLogger metrics({.jsonl = "metrics.jsonl", .tensorboard_dir = "runs/a"});
//   metrics.log(step, {{"train/loss", 0.41}, {"train/lr", 1e-3}});
//
// TensorBoardWriter writes the TFRecord format TensorBoard reads
// (events.out.tfevents.<time>.<host>.<pid>): each record is its length
// (uint64, little-endian), the length's masked CRC32C, the bytes, and their
// masked CRC32C; each record's bytes are a tensorflow.Event protobuf, encoded
// here by hand: the first carries file_version "brain.Event:2", the others
// {wall_time, step, summary {value {tag, simple_value}}}. See Note
// [TensorBoard records] in src/trainer/observability.cpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain {

namespace detail {
// CRC-32C (Castagnoli) and TFRecord's masking of it.
std::uint32_t crc32c(const void* data, std::size_t size);
std::uint32_t masked_crc32c(const void* data, std::size_t size);
}  // namespace detail

class TensorBoardWriter {
 public:
  // Creates `dir` and a new event file in it.
  explicit TensorBoardWriter(const std::filesystem::path& dir);
  void add_scalar(const std::string& tag, double value, std::int64_t step);
  void add_scalars(const std::vector<std::pair<std::string, double>>& values, std::int64_t step);
  void flush();
  const std::filesystem::path& file() const { return file_; }

 private:
  void write_record(const std::string& bytes);
  std::filesystem::path file_;
  std::ofstream out_;
};

struct MetricsOptions {
  std::filesystem::path jsonl;            // "" = no JSON lines
  std::filesystem::path tensorboard_dir;  // "" = no TensorBoard
};

class MetricsLogger {
 public:
  explicit MetricsLogger(const MetricsOptions& options);
  bool enabled() const { return jsonl_.is_open() || tensorboard_.has_value(); }
  // One JSON line {"step": ..., "<name>": value, ...} and one scalar per name.
  void log(std::int64_t step, const std::vector<std::pair<std::string, double>>& values);

 private:
  std::ofstream jsonl_;
  std::optional<TensorBoardWriter> tensorboard_;
};

}  // namespace dtrain
