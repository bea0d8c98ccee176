// Atomic, verified checkpoints.
#include "dtrain/trainer/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <fcntl.h>
#include <torch/serialize.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dtrain/error.h"
#include "dtrain/log.h"

namespace fs = std::filesystem;

namespace dtrain {
namespace {

constexpr const char* kFiles[] = {"model.pt", "optimizer.pt", "state.json"};

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

// Empty when the checkpoint is complete and intact; else why not.
std::string verify(const fs::path& dir) {
  std::ifstream in(dir / "MANIFEST");
  if (!in) return "no MANIFEST (incomplete)";
  try {
    const auto manifest = nlohmann::json::parse(in);
    for (const char* file : kFiles) {
      const auto& entry = manifest.at(file);
      if (!fs::exists(dir / file)) return std::string(file) + " is missing";
      const std::string bytes = read_all(dir / file);
      if (bytes.size() != entry.at("bytes").get<std::size_t>()) return std::string(file) + " has the wrong size";
      if (crc_of(bytes) != entry.at("crc32").get<std::uint32_t>()) return std::string(file) + " fails its CRC";
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

// Copies the archive's values into the model's existing tensors. Unlike
// Module::load, which set_()s new storage under each parameter, this keeps the
// tensors' identity and storage, which DistributedDataParallel's Reducer and
// optimizers hold on to (torch's load_state_dict copies in place too).
void load_tensors(torch::serialize::InputArchive& archive, torch::nn::Module& model, const fs::path& dir) {
  torch::NoGradGuard no_grad;
  auto copy = [&](const std::string& key, at::Tensor target, bool buffer) {
    at::Tensor value;
    DTRAIN_CHECK(archive.try_read(key, value, buffer), DataError,
                 "checkpoint " << dir.string() << " has no " << key << ".",
                 "it was written for a different model; point --checkpoint-dir elsewhere");
    DTRAIN_CHECK(value.sizes() == target.sizes(), DataError,
                 "checkpoint " << dir.string() << ": " << key << " has shape " << value.sizes() << ", the model "
                               << target.sizes() << ".",
                 "it was written for a different model; point --checkpoint-dir elsewhere");
    target.copy_(value);
  };
  for (const auto& item : model.named_parameters()) copy("parameter/" + item.key(), item.value(), false);
  for (const auto& item : model.named_buffers()) copy("buffer/" + item.key(), item.value(), true);
}

}  // namespace

Checkpointer::Checkpointer(CheckpointOptions options, std::optional<dist::ProcessGroup> group)
    : options_(std::move(options)), group_(std::move(group)) {
  DTRAIN_CHECK(!options_.dir.empty(), ConfigError, "the checkpoint directory is empty.", "pass a directory");
  DTRAIN_CHECK(options_.keep >= 1, ConfigError, "CheckpointOptions::keep " << options_.keep << " must be at least 1.",
               "keep at least the newest checkpoint");
}

std::vector<std::int64_t> Checkpointer::complete_steps() const {
  std::vector<std::int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(options_.dir, ec)) return steps;
  for (const auto& entry : fs::directory_iterator(options_.dir, ec)) {
    const auto step = step_of(entry.path());
    if (!step) continue;
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

void Checkpointer::save(const TrainingState& state, torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const bool writer = !group_ || group_->rank() == 0;
  if (writer) {
    fs::create_directories(options_.dir);
    const fs::path final_dir = options_.dir / ("step_" + std::to_string(state.step));
    const fs::path tmp = options_.dir / (".tmp_step_" + std::to_string(state.step) + "_" + std::to_string(::getpid()));
    fs::remove_all(tmp);
    fs::create_directories(tmp);

    std::ostringstream model_bytes, optimizer_bytes;
    {
      // Flat names (parameter/fc1.weight, ...) so that loading can copy into
      // the existing tensors in place; see load_tensors.
      torch::serialize::OutputArchive archive;
      for (const auto& item : model.named_parameters()) archive.write("parameter/" + item.key(), item.value());
      for (const auto& item : model.named_buffers()) archive.write("buffer/" + item.key(), item.value(), true);
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      archive.write("rng_state", generator.get_state());
      archive.save_to(model_bytes);
    }
    torch::save(optimizer, optimizer_bytes);
    const nlohmann::json meta = {
        {"step", state.step}, {"sampler_epoch", state.sampler.epoch}, {"sampler_consumed", state.sampler.consumed}};
    const std::string files[] = {model_bytes.str(), optimizer_bytes.str(), meta.dump()};
    nlohmann::json manifest;
    for (size_t i = 0; i < 3; ++i) {
      write_file(tmp / kFiles[i], files[i]);
      manifest[kFiles[i]] = {{"bytes", files[i].size()}, {"crc32", crc_of(files[i])}};
    }
    write_file(tmp / "MANIFEST", manifest.dump());  // last: marks the checkpoint complete
    fsync_path(tmp, true);
    fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);
    fsync_path(options_.dir, true);
    // Keep the newest `keep`.
    const auto steps = complete_steps();
    for (size_t i = static_cast<size_t>(options_.keep); i < steps.size(); ++i) {
      fs::remove_all(options_.dir / ("step_" + std::to_string(steps[i])));
    }
  }
  if (group_) group_->barrier();
}

std::optional<TrainingState> Checkpointer::load_latest(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  std::int64_t chosen = -1;
  if (!group_ || group_->rank() == 0) {
    const auto steps = complete_steps();
    if (!steps.empty()) chosen = steps.front();
  }
  if (group_) {
    at::Tensor t = at::tensor({chosen}, at::TensorOptions().dtype(at::kLong).device(group_->device()));
    group_->broadcast(t, 0).wait();
    chosen = t.cpu().item<std::int64_t>();
  }
  if (chosen < 0) return std::nullopt;
  const fs::path dir = options_.dir / ("step_" + std::to_string(chosen));
  const std::string problem = verify(dir);
  DTRAIN_CHECK(problem.empty(), DataError,
               "checkpoint " << dir.string() << " chosen by rank 0 is not usable here: " << problem << ".",
               "put checkpoints on storage every rank sees the same way");
  {
    torch::serialize::InputArchive archive;
    archive.load_from((dir / "model.pt").string());
    load_tensors(archive, model, dir);
    at::Tensor rng;
    archive.read("rng_state", rng);
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(rng);
  }
  torch::load(optimizer, (dir / "optimizer.pt").string());
  const auto meta = nlohmann::json::parse(read_all(dir / "state.json"));
  TrainingState state;
  state.step = meta.at("step").get<std::int64_t>();
  state.sampler = {.epoch = meta.at("sampler_epoch").get<std::int64_t>(),
                   .consumed = meta.at("sampler_consumed").get<std::int64_t>()};
  DTRAIN_LOG(kInfo) << "resumed from " << dir.string() << " (step " << state.step << ", epoch " << state.sampler.epoch
                    << ", " << state.sampler.consumed << " examples into it)";
  return state;
}

}  // namespace dtrain
