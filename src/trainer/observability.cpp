// Metrics (JSON lines, TensorBoard event files) and the trace timeline,
// including the comm hook that puts DDP's buckets on it.
#include <ATen/core/ivalue.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>

#include "dtrain/error.h"
#include "dtrain/trainer/metrics.h"
#include "dtrain/trainer/strategy.h"
#include "dtrain/trainer/trace.h"

namespace fs = std::filesystem;

namespace dtrain {

// Note [TensorBoard records]
// An event file is a sequence of TFRecords (tensorflow/core/lib/io/record_writer.cc):
//   uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)
// all little-endian, where masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8
// over CRC-32C (Castagnoli). Each data is a tensorflow.Event (event.proto):
//   double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
// Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
// Protobuf wire format: a key varint (field << 3 | wire type; 0 varint,
// 1 fixed64, 2 length-delimited, 5 fixed32), then the value. TensorBoard's
// reader wants the first event to carry file_version "brain.Event:2".
namespace detail {

std::uint32_t crc32c(const void* data, std::size_t size) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t crc = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace detail

namespace {

void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
template <typename T>
void put_fixed(std::string& out, T value) {  // little-endian hosts only (x86, arm64)
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.append(bytes, sizeof(T));
}
void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<std::uint64_t>(field) << 3 | static_cast<std::uint64_t>(wire_type));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string event_header(double wall_time, std::int64_t step) {
  std::string event;
  put_key(event, 1, 1);
  put_fixed(event, wall_time);
  put_key(event, 2, 0);
  put_varint(event, static_cast<std::uint64_t>(step));
  return event;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const fs::path& dir) {
  fs::create_directories(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const auto seconds = static_cast<std::int64_t>(wall_seconds());
  file_ = dir / ("events.out.tfevents." + std::to_string(seconds) + "." + host + "." + std::to_string(::getpid()));
  out_.open(file_, std::ios::binary | std::ios::trunc);
  DTRAIN_CHECK(out_.is_open(), ConfigError, "cannot create the TensorBoard event file " << file_.string() << ".",
               "check that --tensorboard points to a writable directory");
  std::string first = event_header(wall_seconds(), 0);
  put_bytes(first, 3, "brain.Event:2");
  write_record(first);
  flush();
}

void TensorBoardWriter::add_scalars(const std::vector<std::pair<std::string, double>>& values, std::int64_t step) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string v;
    put_bytes(v, 1, tag);
    put_key(v, 2, 5);
    put_fixed(v, static_cast<float>(value));
    put_bytes(summary, 1, v);
  }
  std::string event = event_header(wall_seconds(), step);
  put_bytes(event, 5, summary);
  write_record(event);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, std::int64_t step) {
  add_scalars({{tag, value}}, step);
}

void TensorBoardWriter::write_record(const std::string& bytes) {
  std::string record;
  const std::uint64_t length = bytes.size();
  put_fixed(record, length);
  put_fixed(record, detail::masked_crc32c(record.data(), sizeof length));
  record += bytes;
  put_fixed(record, detail::masked_crc32c(bytes.data(), bytes.size()));
  out_.write(record.data(), static_cast<std::streamsize>(record.size()));
}

void TensorBoardWriter::flush() {
  out_.flush();
}

MetricsLogger::MetricsLogger(const MetricsOptions& options) {
  if (!options.jsonl.empty()) {
    if (options.jsonl.has_parent_path()) fs::create_directories(options.jsonl.parent_path());
    jsonl_.open(options.jsonl, std::ios::app);
    DTRAIN_CHECK(jsonl_.is_open(), ConfigError, "cannot open the metrics file " << options.jsonl.string() << ".",
                 "check that the path is writable");
  }
  if (!options.tensorboard_dir.empty()) tensorboard_.emplace(options.tensorboard_dir);
}

void MetricsLogger::log(std::int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  if (jsonl_.is_open()) {
    nlohmann::json line = {{"step", step}};
    for (const auto& [name, value] : values) line[name] = value;
    jsonl_ << line.dump() << '\n';
    jsonl_.flush();
  }
  if (tensorboard_) {
    tensorboard_->add_scalars(values, step);
    tensorboard_->flush();
  }
}

Tracer::Tracer(fs::path file, int rank)
    : file_(std::move(file)), rank_(rank), start_(std::chrono::steady_clock::now()) {
  if (file_.has_parent_path()) fs::create_directories(file_.parent_path());
}

Tracer::~Tracer() {
  try {
    write();
  } catch (...) {  // a destructor must not throw; write() was the user's chance to see it
  }
}

std::int64_t Tracer::now_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start_).count();
}

void Tracer::set_step(std::int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = step;
}

void Tracer::record(const std::string& name, const char* category, std::int64_t start_us, std::int64_t end_us,
                    int track) {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({name, category, start_us, end_us, track, step_});
}

Tracer::Span::Span(Tracer* tracer, std::string name, const char* category)
    : tracer_(tracer), name_(std::move(name)), category_(category), start_us_(tracer ? tracer->now_us() : 0) {}

Tracer::Span::~Span() {
  if (tracer_ != nullptr) tracer_->record(name_, category_, start_us_, tracer_->now_us());
}

void Tracer::write() {
  nlohmann::json events = nlohmann::json::array();
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  events.push_back(
      {{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", kTrainTrack}, {"args", {{"name", "train"}}}});
  events.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", rank_},
                    {"tid", kCommTrack},
                    {"args", {{"name", "communication"}}}});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& e : events_) {
      events.push_back({{"name", e.name},
                        {"cat", e.category},
                        {"ph", "X"},
                        {"ts", e.start_us},
                        {"dur", e.end_us - e.start_us},
                        {"pid", rank_},
                        {"tid", e.track},
                        {"args", {{"step", e.step}}}});
    }
  }
  // The temporary file is this process's own: two writers of one trace
  // (a path given to several processes) must not rename each other's.
  const fs::path tmp = file_.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
    out.close();
    if (out.fail()) {
      std::error_code ignored;
      fs::remove(tmp, ignored);  // each writer's own: a failed one must not pile up
    }
    DTRAIN_CHECK(!out.fail(), ConfigError, "cannot write the trace " << file_.string() << ".",
                 "check that --trace points to a writable path");
  }
  fs::rename(tmp, file_);
}

fs::path per_rank_path(const fs::path& file, int rank, int world) {
  if (world <= 1) return file;
  return file.parent_path() / (file.stem().string() + ".rank" + std::to_string(rank) + file.extension().string());
}

namespace detail {
namespace {

class TracedHook : public CommHook {
 public:
  TracedHook(std::shared_ptr<CommHook> inner, Tracer* tracer) : inner_(std::move(inner)), tracer_(tracer) {}
  dist::Future run(dist::ProcessGroup& group, GradBucket& bucket) override {
    const std::int64_t start = tracer_->now_us();
    dist::Future reduced = inner_->run(group, bucket);
    std::string name = "bucket " + std::to_string(bucket.index) + " (" +
                       std::to_string(bucket.buffer.numel() * static_cast<std::int64_t>(bucket.buffer.element_size())) +
                       " B)";
    Tracer* tracer = tracer_;
    // The span is recorded before the returned future completes, so DDP (which
    // waits for it inside backward) sees every bucket end before backward ends.
    return reduced->then(
        [tracer, start, name = std::move(name)](c10::ivalue::Future& done) {
          tracer->record(name, "comm", start, tracer->now_us(), Tracer::kCommTrack);
          return done.value();
        },
        reduced->elementType());
  }

 private:
  std::shared_ptr<CommHook> inner_;
  Tracer* tracer_;
};

}  // namespace

std::shared_ptr<CommHook> traced_hook(std::shared_ptr<CommHook> inner, Tracer* tracer) {
  return std::make_shared<TracedHook>(inner ? std::move(inner) : hooks::all_reduce(), tracer);
}

}  // namespace detail
}  // namespace dtrain
