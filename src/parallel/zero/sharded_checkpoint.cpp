// Sharded, resharding checkpoints (see include/dtrain/parallel/zero/sharded_checkpoint.h).
#include "dtrain/parallel/zero/sharded_checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>
#include <unistd.h>

#include <functional>
#include <map>
#include <sstream>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "zero_engine.h"
#include "zero_part_format.h"

namespace dtrain {

namespace fs = std::filesystem;

namespace detail {

// The per-element optimizer state keys of an optimizer kind.
std::vector<std::string> state_keys(const std::string& kind) {
  if (kind == "sgd") return {"momentum_buffer"};
  if (kind == "adam" || kind == "adamw") return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {};
}

std::string kind_of(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return "sgd";
  return "other";
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
  at::Tensor t;
  if (archive.try_read("layout.shard_rank", t)) layout.shard_rank = static_cast<int>(t.item<std::int64_t>());
  if (archive.try_read("layout.shard_world", t)) layout.shard_world = static_cast<int>(t.item<std::int64_t>());
  if (archive.try_read("layout.replica", t)) layout.replica = static_cast<int>(t.item<std::int64_t>());
  c10::IValue params;
  if (archive.try_read("layout.params", params)) {
    std::stringstream lines(params.toStringRef());
    for (std::string line; std::getline(lines, line);) {
      std::stringstream fields(line);
      std::string unit, offset, trainable, dims;
      SavedParam p;
      std::getline(fields, unit, '\t');
      std::getline(fields, p.name, '\t');
      std::getline(fields, offset, '\t');
      std::getline(fields, trainable, '\t');
      std::getline(fields, dims);
      p.unit = std::stoul(unit);
      p.offset = std::stoll(offset);
      p.trainable = trainable == "1";
      std::stringstream sizes(dims);
      for (std::string d; std::getline(sizes, d, ',');) p.shape.push_back(std::stoll(d));
      layout.params.push_back(std::move(p));
    }
  }
  return layout;
}

std::shared_ptr<torch::optim::OptimizerOptions> read_options(torch::serialize::InputArchive& archive,
                                                             const std::string& kind) {
  torch::serialize::InputArchive options;
  if (!archive.try_read("optimizer.options", options)) return nullptr;
  std::shared_ptr<torch::optim::OptimizerOptions> out;
  if (kind == "adamw") out = std::make_shared<torch::optim::AdamWOptions>();
  if (kind == "adam") out = std::make_shared<torch::optim::AdamOptions>();
  if (kind == "sgd") out = std::make_shared<torch::optim::SGDOptions>(0.0);
  if (out) out->serialize(options);
  return out;
}

}  // namespace detail

using detail::kind_of;
using detail::make_state;
using detail::read_layout;
using detail::SavedLayout;
using detail::state_keys;
using detail::unit_key;

namespace {

void fsync_path(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
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

// This rank's part: every unit's chunk (fp32 masters), its optimizer state
// laid out like the chunk, the unit's optimizer step, and the layout
// (the units' cut, the shard rank and the number of shards). Under HSDP
// every replica holds the same shards: replica 0's ranks write them, the
// others only the layout. The parts are named by the checkpoint group's rank;
// replica 0's shard s must be that group's rank s (as a DeviceMesh with
// dp_replicate outside dp_shard makes it), which loading checks.
int replica_of(detail::ZeroEngine& engine) {
  return engine.replicated() ? engine.options().replicate_group->rank() : 0;
}

// ShardedCheckpointer's Checkpointer spans the shard group only; replicas
// would write into one folder at once.
void refuse_replicated(ShardedDataParallel& sdp) {
  DTRAIN_CHECK(!sdp.engine().replicated(), ConfigError,
               "ShardedCheckpointer over an HSDP model (ZeroOptions::replicate_group) is not supported.",
               "checkpoint HSDP through the Trainer (ZeroStrategy with the world group), or add zero_state() to a "
               "Checkpointer over the world group");
}

void write_part(detail::ZeroEngine& engine, torch::optim::Optimizer& optimizer,
                torch::serialize::OutputArchive& archive) {
  torch::NoGradGuard no_grad;
  const std::string kind = kind_of(optimizer);
  auto& units = engine.units();
  auto& shards = engine.shards();
  std::vector<std::int64_t> numel, shard;
  std::string names;
  const bool owner = replica_of(engine) == 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const detail::Unit& unit = units[u];
    numel.push_back(unit.numel);
    shard.push_back(unit.shard);
    names += (u == 0 ? "" : "\n") + unit.name;
    if (!owner) continue;
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
  }
  std::ostringstream params;  // see zero_part_format.h
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (const detail::FlatParam& fp : units[u].params) {
      params << u << '\t' << fp.name << '\t' << fp.offset << '\t' << (fp.trainable ? 1 : 0) << '\t';
      for (std::size_t d = 0; d < fp.shape.size(); ++d) params << (d ? "," : "") << fp.shape[d];
      params << '\n';
    }
  }
  archive.write("layout.params", c10::IValue(params.str()));
  if (optimizer.param_groups().size() == 1 && kind != "other") {
    torch::serialize::OutputArchive options;
    optimizer.param_groups()[0].options().serialize(options);
    archive.write("optimizer.options", options);
  }
  archive.write("layout.kind", c10::IValue(kind));
  archive.write("layout.names", c10::IValue(names));
  archive.write("layout.numel", at::tensor(numel, at::kLong));
  archive.write("layout.shard", at::tensor(shard, at::kLong));
  archive.write("layout.shard_rank", at::full({1}, engine.rank(), at::kLong));
  archive.write("layout.shard_world", at::full({1}, engine.world(), at::kLong));
  archive.write("layout.replica", at::full({1}, replica_of(engine), at::kLong));
}

// Fills this rank's chunks and optimizer state from the parts of the
// `old_world` ranks that saved (any number): each rank reads, from the saved
// chunks, the ranges its own chunk covers. `where` names the checkpoint in errors.
void read_parts(detail::ZeroEngine& engine, torch::optim::Optimizer& optimizer,
                const std::function<torch::serialize::InputArchive&(int)>& archive, int old_world,
                const std::string& where, bool counterpart_only = false) {
  torch::NoGradGuard no_grad;
  const SavedLayout layout = read_layout(archive(0));
  const std::string& kind = layout.kind;
  // The saving ranks that hold shards: all of them, or under HSDP the first
  // replica's (parts 0 .. shards-1, checked).
  const int old_shards = layout.shard_world > 0 ? layout.shard_world : old_world;
  // (counterpart_only: archive(r) is this rank's counterpart's part for every r,
  // and only the ranges of this rank's own chunk are read from it.)
  for (int r = 1; r < old_shards && layout.shard_world > 0 && !counterpart_only; ++r) {
    const SavedLayout other = read_layout(archive(r));
    DTRAIN_CHECK(other.shard_rank == r && other.replica == 0, DataError,
                 "checkpoint " << where << ": part " << r << " holds shard " << other.shard_rank << " of replica "
                               << other.replica << ", not shard " << r << " of replica 0.",
                 "save HSDP with the checkpoint group's ranks ordered replica-major (a DeviceMesh with dp_replicate "
                 "outside dp_shard)");
  }
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
      for (int r = 0; r < old_shards; ++r) {
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
    // Every piece of a unit steps together, so the parts this rank reads
    // anyway (those its chunk overlaps) hold the step; others are not opened.
    std::int64_t unit_step = 0;
    for (int r = 0; r < old_shards; ++r) {
      const std::int64_t lo = std::max(begin, r * old_shard), hi = std::min(end, (r + 1) * old_shard);
      if (hi <= lo) continue;
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

}  // namespace

namespace detail {

// The parts as state of the Checkpointer (StateScope::kSharded): the
// Trainer's ZeroStrategy and ShardedCheckpointer save and load through it.
class ZeroState : public ShardedStateful {
 public:
  int saved_world = 0;  // of the last load
  ZeroState(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer) : sdp_(&sdp), optimizer_(&optimizer) {}
  void save_state(torch::serialize::OutputArchive& archive) const override {
    write_part(sdp_->engine(), *optimizer_, archive);
  }
  void load_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) override {
    read_parts(sdp_->engine(), *optimizer_, part, saved_world, "(sharded state)");
    this->saved_world = saved_world;
    if (sdp_->engine().rank() == 0) {
      DTRAIN_LOG(kInfo) << "loaded ZeRO shards saved by " << saved_world << " ranks onto " << sdp_->engine().world();
    }
  }

 private:
  ShardedDataParallel* sdp_;
  torch::optim::Optimizer* optimizer_;
};

}  // namespace detail

ShardedCheckpointer::ShardedCheckpointer(ShardedCheckpointOptions options, ShardedDataParallel& sdp,
                                         torch::optim::Optimizer& optimizer)
    : sdp_(&sdp) {
  refuse_replicated(sdp);
  state_ = std::make_shared<detail::ZeroState>(sdp, optimizer);
  DTRAIN_CHECK(fs::is_directory(options.dir) || !fs::exists(options.dir), ConfigError,
               "the checkpoint directory " << options.dir << " is a file.", "pass a directory");
  checkpointer_ =
      std::make_unique<Checkpointer>(CheckpointOptions{.dir = options.dir, .keep = options.keep}, sdp.engine().group());
  checkpointer_->add_state("zero", state_, StateScope::kSharded);
  checkpointer_->add_state("extra",
                           json_state([this] { return extra_; }, [this](const std::string& s) { extra_ = s; }));
}

ShardedCheckpointer::~ShardedCheckpointer() = default;

void ShardedCheckpointer::save(std::int64_t step, const std::string& extra) {
  extra_ = extra;
  checkpointer_->save({.step = step});
}

std::vector<std::int64_t> ShardedCheckpointer::complete_steps() const {
  return checkpointer_->complete_steps();
}

std::optional<ShardedCheckpointInfo> ShardedCheckpointer::load_latest() {
  const auto loaded = checkpointer_->load_latest();
  if (!loaded) return std::nullopt;
  return ShardedCheckpointInfo{.step = loaded->step, .saved_world_size = state_->saved_world, .extra = extra_};
}

std::shared_ptr<ShardedStateful> zero_state(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer) {
  return std::make_shared<detail::ZeroState>(sdp, optimizer);
}

void load_counterpart_part(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer,
                           torch::serialize::InputArchive& part) {
  detail::ZeroEngine& engine = sdp.engine();
  const SavedLayout layout = read_layout(part);
  DTRAIN_CHECK(layout.shard_rank == engine.rank() && layout.shard_world == engine.world(), DataError,
               "a ZeRO part of shard " << layout.shard_rank << " of " << layout.shard_world << " cannot be loaded as "
                                       << "shard " << engine.rank() << " of " << engine.world() << ".",
               "send each rank the part of the same rank of a group of the same size");
  read_parts(
      engine, optimizer, [&part](int) -> torch::serialize::InputArchive& { return part; }, engine.world(),
      "(a peer's part)", /*counterpart_only=*/true);
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
