// Committed checkpoints read outside a run (include/dtrain/checkpoint/checkpoint_reader.h).
#include "dtrain/checkpoint/checkpoint_reader.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/error.h"

namespace dtrain {

namespace fs = std::filesystem;

namespace {

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

bool is_step_dir(const fs::path& dir) {
  return dir.filename().string().rfind("step_", 0) == 0 && fs::exists(dir / "state.json");
}

}  // namespace

std::vector<std::string> CheckpointFolder::per_rank_states() const {
  std::set<std::string> names;
  for (const auto& f : files) {
    if (f.path.rfind("rank_0/", 0) == 0 && fs::path(f.path).extension() == ".pt") {
      names.insert(fs::path(f.path).stem().string());
    }
  }
  return {names.begin(), names.end()};
}

CheckpointFolder open_checkpoint(const fs::path& dir) {
  DTRAIN_CHECK(fs::is_directory(dir), DataError, dir.string() << " is not a folder.",
               "give a checkpoint folder (the Trainer's --checkpoint-dir) or one of its step_<N> folders");
  fs::path step_dir = dir;
  if (!is_step_dir(dir)) {
    const auto steps = Checkpointer({.dir = dir}).complete_steps();
    DTRAIN_CHECK(!steps.empty(), DataError, dir.string() << " holds no complete dtrain checkpoint (step_<N> folder).",
                 "give the folder a dtrain run checkpointed into");
    step_dir = dir / ("step_" + std::to_string(steps.front()));
  }
  const std::string problem = checkpoint_problem(step_dir);
  DTRAIN_CHECK(problem.empty(), DataError, "checkpoint " << step_dir.string() << ": " << problem << ".",
               "use an older checkpoint of the folder");
  CheckpointFolder folder{.dir = step_dir};
  folder.state_json = read_text(step_dir / "state.json");
  const auto meta = nlohmann::json::parse(folder.state_json);
  folder.step = meta.at("step").get<std::int64_t>();
  folder.world_size = meta.value("world_size", 1);
  const auto manifest = nlohmann::json::parse(read_text(step_dir / "MANIFEST"));
  const auto& files = manifest.contains("files") ? manifest.at("files") : manifest;
  for (const auto& [path, entry] : files.items()) {
    folder.files.push_back({path, entry.at("bytes").get<std::int64_t>(), entry.at("crc32").get<std::uint32_t>()});
  }
  return folder;
}

fs::path sharded_part(const CheckpointFolder& folder, const std::string& name, int rank) {
  DTRAIN_CHECK(rank >= 0 && rank < folder.world_size, DataError,
               "the state asked for the part of rank " << rank << " of " << folder.world_size << ".", "");
  return folder.dir / ("rank_" + std::to_string(rank)) / (name + ".pt");
}

}  // namespace dtrain
