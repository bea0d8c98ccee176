// Atomic, verified checkpoints written by every rank.
#include "dtrain/checkpoint/checkpointer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <fcntl.h>
#include <torch/serialize.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "../core/torch_compat.h"
#include "dtrain/checkpoint/checkpoint_reader.h"
#include "dtrain/error.h"
#include "dtrain/log.h"

namespace fs = std::filesystem;

// Note [Checkpoint commit]
// A checkpoint is committed by one rename, after every byte of it is on disk:
//  1. rank 0 creates DIR/.tmp_step_N (removing a leftover of a crashed save);
//  2. every rank writes its files into it (rank 0 also the replicated ones),
//     fsyncs each, and writes rank_R.part listing their sizes and CRC32s;
//  3. rank 0 merges the parts into MANIFEST (written last, fsync'd), renames
//     the folder to DIR/step_N and fsyncs DIR.
// Between the steps the ranks agree (an all-reduce of "did this rank
// succeed"), so an error on any rank stops every rank before the rename, is
// thrown on all of them, and the previous checkpoints stay untouched. A crash
// leaves at most a temporary folder, which loading ignores. A checkpoint
// whose MANIFEST lists files of W ranks needs all of them to verify.

// Note [Checkpoint I/O]
// What a save and a load cost besides the bytes themselves is kept small:
//  - a save streams each LibTorch archive straight into its file and takes
//    its CRC32 as it goes (no in-memory copy of the archive, no read-back);
//  - after a save, pruning counts the steps this Checkpointer committed or
//    verified without reading them again (their files were checked when
//    written or loaded); other steps are verified in full;
//  - a load verifies the newest step first and stops at the first intact one
//    (older ones are not read); rank 0 verifies all its files, every other
//    rank the replicated files and its own part;
//  - verification reads files in 4 MiB blocks.
// complete_steps() still verifies every step in full.

namespace dtrain {
namespace {

constexpr const char* kManifest = "MANIFEST";
constexpr const char* kStateFile = "state.json";

void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

std::uint32_t crc_of(const std::string& bytes) {
  return static_cast<std::uint32_t>(
      ::crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

std::optional<std::int64_t> step_of(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.rfind("step_", 0) != 0) return std::nullopt;
  try {
    size_t used = 0;
    const auto step = std::stoll(name.substr(5), &used);
    if (used != name.size() - 5) return std::nullopt;
    return step;
  } catch (...) {
    return std::nullopt;
  }
}

std::string rank_dir(int rank) {
  return "rank_" + std::to_string(rank);
}

// The files a MANIFEST lists: {"files": {path: {bytes, crc32}}}, or, in the
// first format (one writer), the top-level object itself.
const nlohmann::json& manifest_files(const nlohmann::json& manifest) {
  return manifest.contains("files") ? manifest.at("files") : manifest;
}

// Size and CRC32 of a file, read in 4 MiB blocks (Note [Checkpoint I/O]);
// nullopt when it cannot be opened.
std::optional<std::pair<std::uint64_t, std::uint32_t>> file_sum(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return std::nullopt;
  std::vector<char> buffer(4 << 20);
  std::uint64_t total = 0;
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    crc = ::crc32_z(crc, reinterpret_cast<const Bytef*>(buffer.data()), static_cast<z_size_t>(n));
    total += static_cast<std::uint64_t>(n);
  }
  ::close(fd);
  return std::make_pair(total, static_cast<std::uint32_t>(crc));
}

// Empty when the checkpoint is complete and intact; else why not. With
// `only_rank` >= 0, other ranks' rank_<R>/ files are not read.
std::string verify(const fs::path& dir, int only_rank = -1) {
  std::ifstream in(dir / kManifest);
  if (!in) return "no MANIFEST (incomplete)";
  try {
    const auto manifest = nlohmann::json::parse(in);
    const std::string own = only_rank >= 0 ? rank_dir(only_rank) + "/" : "";
    for (const auto& [file, entry] : manifest_files(manifest).items()) {
      if (only_rank >= 0 && file.rfind("rank_", 0) == 0 && file.rfind(own, 0) != 0) continue;
      std::error_code ec;
      const auto size = fs::file_size(dir / file, ec);
      if (ec) return file + " is missing";
      if (size != entry.at("bytes").get<std::uint64_t>()) return file + " has the wrong size";
      const auto sum = file_sum(dir / file);
      if (!sum) return file + " is missing";
      if (sum->first != size) return file + " has the wrong size";
      if (sum->second != entry.at("crc32").get<std::uint32_t>()) return file + " fails its CRC";
    }
  } catch (const std::exception& e) {
    return std::string("unreadable MANIFEST: ") + e.what();
  }
  return {};
}

void write_file(const fs::path& path, const std::string& bytes) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    DTRAIN_CHECK(out.good(), ConfigError, "cannot write " << path.string() << ".", "check free space and permissions");
  }
  fsync_path(path, false);
}

// Writes `object`'s archive straight into `path` (no copy of it in memory),
// fsyncs it, and returns its size and CRC32, computed as it is written.
// A failed write (ENOSPC) is not reported to LibTorch's writer: a short
// count makes it throw, and its destructor then writes the archive's end
// again, fails again and throws during the unwinding, which terminates the
// process (seen on a full disk under fault tolerance, where the group is
// meant to warn and train on). The writer is told every byte went, the rest
// is skipped, and the error is thrown here once it returns.
std::pair<std::uint64_t, std::uint32_t> write_archive(const fs::path& path, const Stateful& object) {
  torch::serialize::OutputArchive archive;
  object.save_state(archive);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DTRAIN_CHECK(fd >= 0, ConfigError, "cannot create " << path.string() << ": " << std::strerror(errno) << ".",
               "check free space and permissions");
  std::uint64_t total = 0;
  uLong crc = ::crc32(0L, Z_NULL, 0);
  int error = 0;
  try {
    std::vector<char> zeros;
    archive.save_to([&](const void* data, std::size_t n) -> std::size_t {
      if (n == 0) return 0;      // zlib's crc32 of a null buffer is its initial value, not a no-op
      if (error != 0) return n;  // failed already: skip the rest (see above)
      if (data == nullptr) {  // LibTorch's "skip n bytes" (Note [write_record_metadata]): zeros, as a file's hole reads
        zeros.assign(n, 0);
        data = zeros.data();
      }
      const char* p = static_cast<const char*>(data);
      std::size_t left = n;
      while (left > 0) {
        const ssize_t w = ::write(fd, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
          error = w < 0 ? errno : EIO;
          return n;  // thrown below, once the writer is done (see above)
        }
        p += w;
        left -= static_cast<std::size_t>(w);
      }
      crc = ::crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(n));
      total += n;
      return n;
    });
  } catch (...) {
    ::close(fd);
    DTRAIN_CHECK(error == 0, ConfigError, "cannot write " << path.string() << ": " << std::strerror(error) << ".",
                 "check free space and permissions");
    throw;
  }
  const bool synced = ::fsync(fd) == 0;
  const int sync_errno = errno;
  ::close(fd);
  DTRAIN_CHECK(error == 0 && synced, ConfigError,
               "cannot write " << path.string() << ": " << std::strerror(error ? error : sync_errno) << ".",
               "check free space and permissions");
  return {total, static_cast<std::uint32_t>(crc)};
}

// This rank's generators: the default CPU one and, where CUDA is available,
// each device's default CUDA generator.
class RngState : public Stateful {
 public:
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("cpu", state_of(at::detail::getDefaultCPUGenerator()));
    const std::int64_t devices = at::hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
    archive.write("cuda_devices", at::tensor(devices));
    for (std::int64_t i = 0; i < devices; ++i) {
      archive.write("cuda/" + std::to_string(i),
                    state_of(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<int8_t>(i)))));
    }
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    at::Tensor t;
    archive.read("cpu", t);
    set_state(at::detail::getDefaultCPUGenerator(), t);
    archive.read("cuda_devices", t);
    const std::int64_t saved = t.item<std::int64_t>();
    const std::int64_t devices = at::hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
    if (saved != devices) {
      DTRAIN_LOG(kWarning) << "the checkpoint holds CUDA generator states of " << saved << " devices, this rank sees "
                           << devices << "; restoring the first " << std::min(saved, devices);
    }
    for (std::int64_t i = 0; i < std::min(saved, devices); ++i) {
      archive.read("cuda/" + std::to_string(i), t);
      set_state(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<int8_t>(i))), t);
    }
  }

 private:
  static at::Tensor state_of(at::Generator generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    return generator.get_state();
  }
  static void set_state(at::Generator generator, const at::Tensor& state) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
};

// Copies the archive's values into the model's existing tensors. Unlike
// Module::load, which set_()s new storage under each parameter, this keeps the
// tensors' identity and storage, which DistributedDataParallel's Reducer and
// optimizers hold on to (torch's load_state_dict copies in place too).
class ModuleState : public Stateful {
 public:
  explicit ModuleState(torch::nn::Module& module) : module_(module) {}
  void save_state(torch::serialize::OutputArchive& archive) const override {
    // Flat names (parameter/fc1.weight, ...) so that loading can copy in place.
    for (const auto& item : module_.named_parameters()) archive.write("parameter/" + item.key(), item.value());
    for (const auto& item : module_.named_buffers()) archive.write("buffer/" + item.key(), item.value(), true);
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    torch::NoGradGuard no_grad;
    auto copy = [&](const std::string& key, const at::Tensor& target, bool buffer) {
      at::Tensor value;
      DTRAIN_CHECK(archive.try_read(key, value, buffer), DataError, "the checkpoint has no " << key << ".",
                   "it was written for a different model; point --checkpoint-dir elsewhere");
      DTRAIN_CHECK(
          value.sizes() == target.sizes(), DataError,
          "the checkpoint's " << key << " has shape " << value.sizes() << ", the model " << target.sizes() << ".",
          "it was written for a different model; point --checkpoint-dir elsewhere");
      target.copy_(value);
    };
    for (const auto& item : module_.named_parameters()) copy("parameter/" + item.key(), item.value(), false);
    for (const auto& item : module_.named_buffers()) copy("buffer/" + item.key(), item.value(), true);
  }

 private:
  torch::nn::Module& module_;
};

class OptimizerState : public Stateful {
 public:
  explicit OptimizerState(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {}
  void save_state(torch::serialize::OutputArchive& archive) const override { optimizer_.save(archive); }
  void load_state(torch::serialize::InputArchive& archive) override { optimizer_.load(archive); }

 private:
  torch::optim::Optimizer& optimizer_;
};

class JsonState : public Stateful {
 public:
  JsonState(std::function<std::string()> save, std::function<void(const std::string&)> load)
      : save_(std::move(save)), load_(std::move(load)) {}
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("json", c10::IValue(save_()));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    c10::IValue value;
    archive.read("json", value);
    load_(value.toStringRef());
  }

 private:
  std::function<std::string()> save_;
  std::function<void(const std::string&)> load_;
};

bool valid_name(const std::string& name) {
  if (name.empty() || name == "." || name == "..") return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

}  // namespace

std::shared_ptr<Stateful> json_state(std::function<std::string()> save, std::function<void(const std::string&)> load) {
  return std::make_shared<JsonState>(std::move(save), std::move(load));
}
std::shared_ptr<Stateful> module_state(torch::nn::Module& module) {
  return std::make_shared<ModuleState>(module);
}
std::shared_ptr<Stateful> optimizer_state(torch::optim::Optimizer& optimizer) {
  return std::make_shared<OptimizerState>(optimizer);
}

void ShardedStateful::load_state(torch::serialize::InputArchive& /*archive*/) {
  DTRAIN_INTERNAL_ASSERT(false, "sharded state is loaded through load_parts");
}

std::string checkpoint_problem(const fs::path& step_dir) {
  return verify(step_dir);
}

Checkpointer::Checkpointer(CheckpointOptions options, std::optional<dist::ProcessGroup> group)
    : options_(std::move(options)), group_(std::move(group)) {
  DTRAIN_CHECK(!options_.dir.empty(), ConfigError, "the checkpoint directory is empty.", "pass a directory");
  DTRAIN_CHECK(options_.keep >= 1, ConfigError, "CheckpointOptions::keep " << options_.keep << " must be at least 1.",
               "keep at least the newest checkpoint");
}

void Checkpointer::add_state(const std::string& name, std::shared_ptr<Stateful> object, StateScope scope) {
  static const std::set<std::string> kReserved = {"model", "optimizer", "state", "rng", "MANIFEST"};
  DTRAIN_CHECK(valid_name(name) && kReserved.count(name) == 0, ConfigError,
               "checkpoint state name '" << name << "' is not allowed.",
               "use letters, digits, '_', '-' and '.', other than model, optimizer, state and rng");
  DTRAIN_CHECK(object != nullptr, ConfigError, "checkpoint state '" << name << "' is null.", "pass an object");
  DTRAIN_CHECK(scope != StateScope::kSharded || dynamic_cast<ShardedStateful*>(object.get()) != nullptr, ConfigError,
               "checkpoint state '" << name << "' is added as sharded but is not a ShardedStateful.",
               "derive it from dtrain::ShardedStateful (load_parts reads every saved rank's part)");
  for (const auto& entry : added_) {
    DTRAIN_CHECK(entry.name != name, ConfigError, "checkpoint state '" << name << "' was added twice.",
                 "give each state its own name");
  }
  added_.push_back({name, std::move(object), scope});
}

void Checkpointer::remove_state(const std::string& name) {
  std::erase_if(added_, [&](const Entry& entry) { return entry.name == name; });
}

std::vector<std::int64_t> Checkpointer::complete_steps() const {
  return complete_steps({});
}

std::vector<std::int64_t> Checkpointer::complete_steps(const std::set<std::int64_t>& known) const {
  std::vector<std::int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(options_.dir, ec)) return steps;
  for (const auto& entry : fs::directory_iterator(options_.dir, ec)) {
    const auto step = step_of(entry.path());
    if (!step) continue;
    if (known.count(*step) != 0 && fs::exists(entry.path() / kManifest)) {
      steps.push_back(*step);
      continue;
    }
    const std::string problem = verify(entry.path());
    if (problem.empty()) {
      steps.push_back(*step);
    } else {
      DTRAIN_LOG(kWarning) << "skipping checkpoint " << entry.path().string() << ": " << problem;
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::int64_t Checkpointer::newest_complete_step() {
  std::vector<std::int64_t> steps;
  std::error_code ec;
  if (fs::is_directory(options_.dir, ec)) {
    for (const auto& entry : fs::directory_iterator(options_.dir, ec))
      if (const auto step = step_of(entry.path())) steps.push_back(*step);
  }
  std::sort(steps.rbegin(), steps.rend());
  for (const std::int64_t step : steps) {  // newest first: older ones are not read
    const fs::path dir = options_.dir / ("step_" + std::to_string(step));
    const std::string problem = verify(dir);
    if (problem.empty()) {
      committed_.insert(step);
      return step;
    }
    DTRAIN_LOG(kWarning) << "skipping checkpoint " << dir.string() << ": " << problem;
  }
  return -1;
}

void Checkpointer::save(const TrainingState& state, torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  std::vector<Entry> entries = {{"model", module_state(model), StateScope::kReplicated},
                                {"optimizer", optimizer_state(optimizer), StateScope::kReplicated}};
  entries.insert(entries.end(), added_.begin(), added_.end());
  save_entries(state, entries);
}

void Checkpointer::save(const TrainingState& state) {
  save_entries(state, added_);
}

void Checkpointer::save_entries(const TrainingState& state, const std::vector<Entry>& entries) {
  latest_.reset();
  const int rank = group_ ? group_->rank() : 0;
  const int world = group_ ? group_->size() : 1;
  const fs::path final_dir = options_.dir / ("step_" + std::to_string(state.step));
  const fs::path tmp = options_.dir / (".tmp_step_" + std::to_string(state.step));
  std::exception_ptr error;
  // Whether every rank got through the phase; the highest failing rank + 1 otherwise (0: none).
  auto failed_rank = [&]() -> int {
    int code = error ? rank + 1 : 0;
    if (group_) {
      at::Tensor t =
          at::tensor({static_cast<std::int64_t>(code)}, at::TensorOptions().dtype(at::kLong).device(group_->device()));
      group_->all_reduce(t, dist::ReduceOp::kMax).wait();
      code = static_cast<int>(t.cpu().item<std::int64_t>());
    }
    return code;
  };
  auto abandon = [&](int code) {
    if (rank == 0) {
      std::error_code ec;
      compat::remove_all(tmp, ec);
    }
    if (error) std::rethrow_exception(error);
    DTRAIN_CHECK(false, DataError,
                 "checkpoint step " << state.step << " was not saved: rank " << code - 1 << " failed writing its part.",
                 "see rank " << code - 1 << "'s error; the previous checkpoints are unchanged");
  };

  if (rank == 0) {
    try {
      fs::create_directories(options_.dir);
      // Temporary folders left by saves that crashed (any step) go now: one
      // Checkpointer saves into a directory at a time, so none is in use.
      for (const auto& entry : fs::directory_iterator(options_.dir)) {
        if (entry.path().filename().string().rfind(".tmp_step_", 0) == 0) compat::remove_all(entry.path());
      }
      fs::create_directories(tmp);
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (const int code = failed_rank()) abandon(code);

  try {
    nlohmann::json part = nlohmann::json::object();
    auto put = [&](const std::string& relative, const std::string& bytes) {
      write_file(tmp / relative, bytes);
      part[relative] = {{"bytes", bytes.size()}, {"crc32", crc_of(bytes)}};
    };
    auto put_archive = [&](const std::string& relative, const Stateful& object) {
      const auto [bytes, crc] = write_archive(tmp / relative, object);
      part[relative] = {{"bytes", bytes}, {"crc32", crc}};
    };
    fs::create_directories(tmp / rank_dir(rank));
    put_archive(rank_dir(rank) + "/rng.pt", RngState());
    for (const auto& entry : entries) {
      if (entry.scope != StateScope::kReplicated) {
        put_archive(rank_dir(rank) + "/" + entry.name + ".pt", *entry.object);
      } else if (rank == 0) {
        put_archive(entry.name + ".pt", *entry.object);
      }
    }
    if (rank == 0) {
      put(kStateFile, nlohmann::json{{"step", state.step},
                                     {"sampler_epoch", state.sampler.epoch},
                                     {"sampler_consumed", state.sampler.consumed},
                                     {"world_size", world}}
                          .dump());
    }
    fsync_path(tmp / rank_dir(rank), true);
    write_file(tmp / (rank_dir(rank) + ".part"), part.dump());
  } catch (...) {
    error = std::current_exception();
  }
  if (const int code = failed_rank()) abandon(code);

  if (rank == 0) {
    try {
      nlohmann::json files = nlohmann::json::object();
      for (int r = 0; r < world; ++r) {
        const fs::path part_file = tmp / (rank_dir(r) + ".part");
        files.update(nlohmann::json::parse(read_all(part_file)));
        fs::remove(part_file);
      }
      write_file(tmp / kManifest, nlohmann::json{{"world_size", world}, {"files", files}}.dump());  // last
      fsync_path(tmp, true);
      compat::remove_all(final_dir);
      fs::rename(tmp, final_dir);
      fsync_path(options_.dir, true);
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (const int code = failed_rank()) abandon(code);

  if (rank == 0) {
    // Keep the newest `keep` complete ones. Steps this Checkpointer committed
    // or verified are not read again (Note [Checkpoint I/O]).
    committed_.insert(state.step);
    const auto steps = complete_steps(committed_);
    for (size_t i = static_cast<size_t>(options_.keep); i < steps.size(); ++i) {
      compat::remove_all(options_.dir / ("step_" + std::to_string(steps[i])));
      committed_.erase(steps[i]);
    }
  }
}

std::optional<TrainingState> Checkpointer::load_latest(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  std::vector<Entry> entries = {{"model", module_state(model), StateScope::kReplicated},
                                {"optimizer", optimizer_state(optimizer), StateScope::kReplicated}};
  entries.insert(entries.end(), added_.begin(), added_.end());
  return load_entries(entries);
}

std::optional<TrainingState> Checkpointer::load_latest() {
  return load_entries(added_);
}

std::int64_t Checkpointer::latest_step() {
  if (latest_) return *latest_;
  const int rank = group_ ? group_->rank() : 0;
  std::int64_t chosen = -1;
  if (rank == 0) chosen = newest_complete_step();
  if (group_) {
    at::Tensor t = at::tensor({chosen}, at::TensorOptions().dtype(at::kLong).device(group_->device()));
    group_->broadcast(t, 0).wait();
    chosen = t.cpu().item<std::int64_t>();
  }
  latest_ = chosen;
  return chosen;
}

std::optional<TrainingState> Checkpointer::load_entries(const std::vector<Entry>& entries) {
  const int rank = group_ ? group_->rank() : 0;
  const std::int64_t chosen = latest_step();
  latest_.reset();
  if (chosen < 0) return std::nullopt;
  const fs::path dir = options_.dir / ("step_" + std::to_string(chosen));
  // Rank 0 verified every file just now; the others check what they read
  // themselves (the replicated files and their own part).
  const std::string problem = rank == 0 ? std::string() : verify(dir, rank);
  DTRAIN_CHECK(problem.empty(), DataError,
               "checkpoint " << dir.string() << " chosen by rank 0 is not usable here: " << problem << ".",
               "put checkpoints on storage every rank sees the same way");
  auto load = [&](const fs::path& file, Stateful& object) {
    torch::serialize::InputArchive archive;
    archive.load_from(file.string());
    object.load_state(archive);
  };
  const auto meta = nlohmann::json::parse(read_all(dir / kStateFile));
  const int saved_world = meta.value("world_size", 1);
  for (const auto& entry : entries) {
    if (entry.scope == StateScope::kSharded) {
      std::vector<std::unique_ptr<torch::serialize::InputArchive>> parts(static_cast<std::size_t>(saved_world));
      auto part = [&](int r) -> torch::serialize::InputArchive& {
        DTRAIN_CHECK(r >= 0 && r < saved_world, DataError,
                     "sharded state '" << entry.name << "' asked for the part of rank " << r << " of " << saved_world
                                       << " in " << dir.string() << ".",
                     "ask only for ranks below the saved world size");
        auto& a = parts[static_cast<std::size_t>(r)];
        if (!a) {
          const fs::path file = dir / rank_dir(r) / (entry.name + ".pt");
          DTRAIN_CHECK(fs::exists(file), DataError,
                       "checkpoint " << dir.string() << " has no part of '" << entry.name << "' for rank " << r << ".",
                       "it was written without it; add the same states when saving and loading");
          a = std::make_unique<torch::serialize::InputArchive>();
          a->load_from(file.string());
        }
        return *a;
      };
      dynamic_cast<ShardedStateful&>(*entry.object).load_parts(part, saved_world);
      continue;
    }
    fs::path file = dir / (entry.name + ".pt");
    if (entry.scope == StateScope::kPerRank) {
      file = dir / rank_dir(rank) / (entry.name + ".pt");
      DTRAIN_CHECK(fs::exists(file), DataError,
                   "checkpoint " << dir.string() << " has no part of '" << entry.name << "' for rank " << rank
                                 << " (it was written by " << saved_world << " ranks).",
                   "resume per-rank state with the world size that saved it");
    }
    if (!fs::exists(file) && !entry.object->needed_to_resume()) continue;  // written before the state was added
    DTRAIN_CHECK(fs::exists(file), DataError, "checkpoint " << dir.string() << " has no " << entry.name << " state.",
                 "it was written without it; add the same states when saving and loading");
    load(file, *entry.object);
  }
  const fs::path rng = dir / rank_dir(rank) / "rng.pt";
  if (fs::exists(rng)) {
    RngState generators;
    load(rng, generators);
  } else {
    // First format: rank 0's CPU generator inside model.pt; otherwise a rank
    // the saving run did not have keeps its own seeding.
    torch::serialize::InputArchive archive;
    at::Tensor state;
    if (fs::exists(dir / "model.pt")) archive.load_from((dir / "model.pt").string());
    if (fs::exists(dir / "model.pt") && archive.try_read("rng_state", state)) {
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    } else {
      DTRAIN_LOG(kWarning) << "checkpoint " << dir.string() << " has no generator state for rank " << rank
                           << " (written by " << saved_world << " ranks); this rank's generators are not restored";
    }
  }
  TrainingState state;
  state.step = meta.at("step").get<std::int64_t>();
  state.sampler = {.epoch = meta.at("sampler_epoch").get<std::int64_t>(),
                   .consumed = meta.at("sampler_consumed").get<std::int64_t>()};
  DTRAIN_LOG(kInfo) << "resumed from " << dir.string() << " (step " << state.step << ", epoch " << state.sampler.epoch
                    << ", " << state.sampler.consumed << " examples into it)";
  return state;
}

}  // namespace dtrain
