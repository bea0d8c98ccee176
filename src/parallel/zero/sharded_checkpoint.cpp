// Sharded, resharding checkpoints (see include/dtrain/parallel/zero/sharded_checkpoint.h).
#include "dtrain/parallel/zero/sharded_checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "../../core/torch_compat.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/checkpoint.h"
#include "zero_engine.h"

namespace dtrain {

namespace fs = std::filesystem;

namespace {

void fsync_path(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

fs::path step_dir(const fs::path& dir, std::int64_t step) {
  return dir / ("step_" + std::to_string(step));
}

// The per-element optimizer state keys of an optimizer kind.
std::vector<std::string> state_keys(const std::string& kind) {
  if (kind == "sgd") return {"momentum_buffer"};
  if (kind == "adam" || kind == "adamw") return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {};
}

std::string kind_of(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return "adamw";
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return "adam";
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return "sgd";
  return "other";
}

// One piece's state tensor for `key` (undefined when absent), and its step.
at::Tensor state_tensor(torch::optim::OptimizerParamState* state, const std::string& key, std::int64_t* step) {
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(state)) {
    *step = std::max(*step, s->step());
    return key == "exp_avg" ? s->exp_avg() : key == "exp_avg_sq" ? s->exp_avg_sq() : s->max_exp_avg_sq();
  }
  if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(state)) {
    *step = std::max(*step, s->step());
    return key == "exp_avg" ? s->exp_avg() : key == "exp_avg_sq" ? s->exp_avg_sq() : s->max_exp_avg_sq();
  }
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(state)) return s->momentum_buffer();
  return {};
}

std::unique_ptr<torch::optim::OptimizerParamState> make_state(const std::string& kind,
                                                              const std::map<std::string, at::Tensor>& values,
                                                              std::int64_t step) {
  auto get = [&](const std::string& k) {
    auto it = values.find(k);
    return it == values.end() ? at::Tensor() : it->second;
  };
  if (kind == "adamw") {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step).exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq"));
    if (get("max_exp_avg_sq").defined()) s->max_exp_avg_sq(get("max_exp_avg_sq"));
    return s;
  }
  if (kind == "adam") {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(step).exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq"));
    if (get("max_exp_avg_sq").defined()) s->max_exp_avg_sq(get("max_exp_avg_sq"));
    return s;
  }
  auto s = std::make_unique<torch::optim::SGDParamState>();
  s->momentum_buffer(get("momentum_buffer"));
  return s;
}

std::string unit_key(std::size_t u, const std::string& what) {
  return "u" + std::to_string(u) + "." + what;
}

// How the units were cut when a part was saved: enough to reshard.
struct SavedLayout {
  std::string kind;  // optimizer kind
  std::vector<std::string> names;
  std::vector<std::int64_t> numel;
  std::vector<std::int64_t> shard;
};

// This rank's part: every unit's chunk (fp32 masters), its optimizer state
// laid out like the chunk, the unit's optimizer step, and the layout.
// Every replica of an HSDP group holds the same shards; the part files are
// named by the sharding group's rank alone, so replicas would overwrite each
// other's.
void refuse_replicated(ShardedDataParallel& sdp) {
  DTRAIN_CHECK(!sdp.engine().replicated(), ConfigError,
               "sharded checkpoints of an HSDP model (ZeroOptions::replicate_group) are not supported yet.",
               "checkpoint the model's full_state_dict() from one rank, or train without replicate_group");
}

void write_part(detail::ZeroEngine& engine, torch::optim::Optimizer& optimizer,
                torch::serialize::OutputArchive& archive) {
  torch::NoGradGuard no_grad;
  const std::string kind = kind_of(optimizer);
  auto& units = engine.units();
  auto& shards = engine.shards();
  std::vector<std::int64_t> numel, shard;
  std::string names;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const detail::Unit& unit = units[u];
    archive.write(unit_key(u, "param"), unit.chunk.to(at::kFloat).clone());
    std::int64_t unit_step = 0;
    for (const std::string& key : state_keys(kind)) {
      at::Tensor flat = at::zeros({unit.shard}, at::kFloat);
      bool any = false;
      for (std::size_t i : unit.pieces) {
        auto it = optimizer.state().find(shards[i].shard.unsafeGetTensorImpl());
        if (it == optimizer.state().end()) continue;
        at::Tensor t = state_tensor(it->second.get(), key, &unit_step);
        if (!t.defined()) continue;
        flat.narrow(0, engine.piece_chunk_offset(i), t.numel()).copy_(t.reshape(-1));
        any = true;
      }
      if (any) archive.write(unit_key(u, key), flat);
    }
    archive.write(unit_key(u, "step"), at::full({1}, unit_step, at::kLong));
    numel.push_back(unit.numel);
    shard.push_back(unit.shard);
    names += (u == 0 ? "" : "\n") + unit.name;
  }
  archive.write("layout.kind", c10::IValue(kind));
  archive.write("layout.names", c10::IValue(names));
  archive.write("layout.numel", at::tensor(numel, at::kLong));
  archive.write("layout.shard", at::tensor(shard, at::kLong));
}

SavedLayout read_layout(torch::serialize::InputArchive& archive) {
  SavedLayout layout;
  c10::IValue kind, names;
  at::Tensor numel, shard;
  archive.read("layout.kind", kind);
  archive.read("layout.names", names);
  archive.read("layout.numel", numel);
  archive.read("layout.shard", shard);
  layout.kind = kind.toStringRef();
  std::stringstream in(names.toStringRef());
  for (std::string name; std::getline(in, name);) layout.names.push_back(name);
  for (std::int64_t i = 0; i < numel.numel(); ++i) {
    layout.numel.push_back(numel[i].item<std::int64_t>());
    layout.shard.push_back(shard[i].item<std::int64_t>());
  }
  return layout;
}

// Fills this rank's chunks and optimizer state from the parts of the
// `old_world` ranks that saved (any number): each rank reads, from the saved
// chunks, the ranges its own chunk covers. `where` names the checkpoint in errors.
void read_parts(detail::ZeroEngine& engine, torch::optim::Optimizer& optimizer,
                const std::function<torch::serialize::InputArchive&(int)>& archive, int old_world,
                const std::string& where) {
  torch::NoGradGuard no_grad;
  const SavedLayout layout = read_layout(archive(0));
  const std::string& kind = layout.kind;
  auto& units = engine.units();
  auto& shards = engine.shards();
  DTRAIN_CHECK(layout.numel.size() == units.size(), ConfigError,
               "checkpoint " << where << " has " << layout.numel.size() << " units, the model " << units.size() << ".",
               "load it into the model (and sharding policy) it was saved from");
  DTRAIN_CHECK(kind == kind_of(optimizer) || kind == "other", ConfigError,
               "checkpoint " << where << " holds the state of a " << kind << " optimizer, this run uses "
                             << kind_of(optimizer) << ".",
               "resume with the optimizer the checkpoint was saved with");
  const int rank = engine.rank();
  for (std::size_t u = 0; u < units.size(); ++u) {
    detail::Unit& unit = units[u];
    DTRAIN_CHECK(layout.numel[u] == unit.numel, ConfigError,
                 "checkpoint unit " << u << " (" << (u < layout.names.size() ? layout.names[u] : "?") << ") has "
                                    << layout.numel[u] << " parameters, the model's " << unit.numel << ".",
                 "load it into the model it was saved from");
    const std::int64_t old_shard = layout.shard[u];
    const std::int64_t begin = rank * unit.shard, end = std::min(begin + unit.shard, unit.numel);
    // This rank's new chunk of `what`, from the old ranks' chunks covering it.
    auto assemble = [&](const std::string& what, bool* found) {
      at::Tensor out = at::zeros({unit.shard}, at::kFloat);
      for (int r = 0; r < old_world; ++r) {
        const std::int64_t lo = std::max(begin, r * old_shard), hi = std::min(end, (r + 1) * old_shard);
        if (hi <= lo) continue;
        at::Tensor t;
        if (!archive(r).try_read(unit_key(u, what), t)) continue;
        *found = true;
        out.narrow(0, lo - begin, hi - lo).copy_(t.narrow(0, lo - r * old_shard, hi - lo));
      }
      return out;
    };
    bool found = false;
    unit.chunk.copy_(assemble("param", &found));
    std::int64_t unit_step = 0;
    for (int r = 0; r < old_world; ++r) {
      at::Tensor t;
      if (archive(r).try_read(unit_key(u, "step"), t)) unit_step = std::max(unit_step, t.item<std::int64_t>());
    }
    std::map<std::string, at::Tensor> values;
    for (const std::string& key : state_keys(kind)) {
      bool has = false;
      at::Tensor flat = assemble(key, &has);
      if (has) values[key] = flat;
    }
    for (std::size_t i : unit.pieces) {
      at::Tensor& shard = shards[i].shard;
      auto* impl = shard.unsafeGetTensorImpl();
      optimizer.state().erase(impl);
      if (values.empty() || kind == "other") continue;
      std::map<std::string, at::Tensor> mine;
      for (const auto& [key, flat] : values) {
        mine[key] = flat.narrow(0, engine.piece_chunk_offset(i), shard.numel()).clone();
      }
      optimizer.state()[impl] = make_state(kind, mine, unit_step);
    }
  }
  engine.mark_dirty();
}

// The Trainer's Checkpointer's view of the same parts (StateScope::kSharded).
class ZeroState : public ShardedStateful {
 public:
  ZeroState(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer) : sdp_(&sdp), optimizer_(&optimizer) {}
  void save_state(torch::serialize::OutputArchive& archive) const override {
    write_part(sdp_->engine(), *optimizer_, archive);
  }
  void load_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) override {
    read_parts(sdp_->engine(), *optimizer_, part, saved_world, "(sharded state)");
    if (sdp_->engine().rank() == 0) {
      DTRAIN_LOG(kInfo) << "loaded ZeRO shards saved by " << saved_world << " ranks onto " << sdp_->engine().world();
    }
  }

 private:
  ShardedDataParallel* sdp_;
  torch::optim::Optimizer* optimizer_;
};

}  // namespace

ShardedCheckpointer::ShardedCheckpointer(ShardedCheckpointOptions options, ShardedDataParallel& sdp,
                                         torch::optim::Optimizer& optimizer)
    : options_(std::move(options)), sdp_(&sdp), optimizer_(&optimizer) {
  refuse_replicated(sdp);
}

void ShardedCheckpointer::save(std::int64_t step, const std::string& extra) {
  torch::NoGradGuard no_grad;
  detail::ZeroEngine& engine = sdp_->engine();
  dist::ProcessGroup& group = engine.group();
  const int rank = engine.rank();
  const std::string kind = kind_of(*optimizer_);
  const fs::path tmp = options_.dir / (".step_" + std::to_string(step) + ".tmp");
  if (rank == 0) {
    fs::create_directories(options_.dir);
    compat::remove_all(tmp);
    fs::create_directories(tmp);
  }
  group.barrier();

  torch::serialize::OutputArchive archive;
  write_part(engine, *optimizer_, archive);
  nlohmann::json manifest_units = nlohmann::json::array();
  for (const detail::Unit& unit : engine.units()) {
    manifest_units.push_back({{"name", unit.name}, {"numel", unit.numel}, {"shard", unit.shard}});
  }
  const fs::path file = tmp / ("rank_" + std::to_string(rank) + ".pt");
  archive.save_to(file.string());
  fsync_path(file);
  group.barrier();  // every rank's part is on disk

  if (rank == 0) {
    nlohmann::json files = nlohmann::json::object();
    for (int r = 0; r < engine.world(); ++r) {
      const std::string name = "rank_" + std::to_string(r) + ".pt";
      files[name] = fs::file_size(tmp / name);
    }
    const nlohmann::json manifest{
        {"step", step},      {"world_size", engine.world()}, {"stage", engine.options().stage},
        {"optimizer", kind}, {"units", manifest_units},      {"files", files},
        {"extra", extra}};
    {
      std::ofstream out(tmp / "MANIFEST");
      out << manifest.dump(2);
    }
    fsync_path(tmp / "MANIFEST");
    fsync_path(tmp);
    const fs::path final_dir = step_dir(options_.dir, step);
    compat::remove_all(final_dir);
    fs::rename(tmp, final_dir);
    fsync_path(options_.dir);
    const auto steps = complete_steps();
    for (std::size_t i = static_cast<std::size_t>(std::max(options_.keep, 1)); i < steps.size(); ++i) {
      compat::remove_all(step_dir(options_.dir, steps[i]));
    }
  }
  group.barrier();
}

std::vector<std::int64_t> ShardedCheckpointer::complete_steps() const {
  std::vector<std::int64_t> steps;
  if (!fs::is_directory(options_.dir)) return steps;
  for (const auto& entry : fs::directory_iterator(options_.dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) != 0 || !fs::exists(entry.path() / "MANIFEST")) continue;
    try {
      const auto manifest = nlohmann::json::parse(std::ifstream(entry.path() / "MANIFEST"));
      bool complete = true;
      for (const auto& [file, bytes] : manifest.at("files").items()) {
        complete = complete && fs::exists(entry.path() / file) &&
                   fs::file_size(entry.path() / file) == bytes.get<std::uintmax_t>();
      }
      if (complete) steps.push_back(std::stoll(name.substr(5)));
    } catch (const std::exception& e) {
      DTRAIN_LOG(kWarning) << "skipping checkpoint " << entry.path() << ": " << e.what();
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

std::optional<ShardedCheckpointInfo> ShardedCheckpointer::load_latest() {
  torch::NoGradGuard no_grad;
  detail::ZeroEngine& engine = sdp_->engine();
  dist::ProcessGroup& group = engine.group();
  at::Tensor chosen = at::full({1}, std::int64_t{-1}, at::kLong);
  if (engine.rank() == 0) {
    const auto steps = complete_steps();
    if (!steps.empty()) chosen.fill_(steps.front());
  }
  group.broadcast(chosen, 0).wait();
  const std::int64_t step = chosen.item<std::int64_t>();
  if (step < 0) return std::nullopt;
  const fs::path dir = step_dir(options_.dir, step);
  const auto manifest = nlohmann::json::parse(std::ifstream(dir / "MANIFEST"));
  const int old_world = manifest.at("world_size").get<int>();
  std::vector<std::unique_ptr<torch::serialize::InputArchive>> archives(static_cast<std::size_t>(old_world));
  auto archive = [&](int r) -> torch::serialize::InputArchive& {
    auto& a = archives[static_cast<std::size_t>(r)];
    if (!a) {
      a = std::make_unique<torch::serialize::InputArchive>();
      a->load_from((dir / ("rank_" + std::to_string(r) + ".pt")).string());
    }
    return *a;
  };
  read_parts(engine, *optimizer_, archive, old_world, dir.string());
  const int rank = engine.rank();
  if (rank == 0) {
    DTRAIN_LOG(kInfo) << "loaded ZeRO checkpoint of step " << step << " saved by " << old_world << " ranks";
  }
  return ShardedCheckpointInfo{
      .step = step, .saved_world_size = old_world, .extra = manifest.at("extra").get<std::string>()};
}

std::shared_ptr<ShardedStateful> zero_state(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer) {
  refuse_replicated(sdp);
  return std::make_shared<ZeroState>(sdp, optimizer);
}

void ShardedCheckpointer::export_full_state_dict(const fs::path& path) {
  auto full = sdp_->full_state_dict();
  if (sdp_->engine().rank() == 0) {
    torch::serialize::OutputArchive archive;
    for (const auto& [name, tensor] : full) archive.write(name, tensor);
    archive.save_to(path.string() + ".tmp");
    fsync_path(path.string() + ".tmp");
    fs::rename(path.string() + ".tmp", path);
  }
  sdp_->group().barrier();
}

}  // namespace dtrain
