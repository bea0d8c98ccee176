// Loading a checkpoint of any plan (include/dtrain/trainer/resharding.h), and
// the default Strategy's laid-out checkpoints (strategy.h).
#include "dtrain/trainer/resharding.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "dtrain/checkpoint/layout_state.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/parallel/zero/full_state.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "dtrain/trainer/strategy.h"

namespace dtrain {

namespace fs = std::filesystem;

SavedModelState saved_model_state(Checkpointer& checkpointer) {
  // The step the load will take, verified once on rank 0 (not every retained
  // step on every rank): latest_step() keeps it for load_latest().
  const std::int64_t step = checkpointer.latest_step();
  if (step < 0) return SavedModelState::kNone;
  const fs::path dir = checkpointer.options().dir / ("step_" + std::to_string(step));
  if (fs::exists(dir / "rank_0" / (std::string(kLaidOutState) + ".pt"))) return SavedModelState::kLaidOut;
  if (fs::exists(dir / "rank_0" / (std::string(kZeroState) + ".pt"))) return SavedModelState::kZero;
  if (fs::exists(dir / "model.pt")) return SavedModelState::kReplicated;
  if (fs::exists(dir / "rank_0" / (std::string(kTensorParallelState) + ".pt"))) return SavedModelState::kTensorParallel;
  return SavedModelState::kOther;
}

namespace {

// A laid-out state filled from ZeRO chunks, through their whole state.
class ZeroReader : public ShardedStateful {
 public:
  explicit ZeroReader(std::shared_ptr<LayoutState> target) : target_(std::move(target)) {}
  void save_state(torch::serialize::OutputArchive& /*archive*/) const override {
    DTRAIN_INTERNAL_ASSERT(false, "a ZeroReader only loads");
  }
  void load_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) override {
    const ZeroFullState full = consolidate_zero_parts(part, saved_world);
    DTRAIN_LOG(kInfo) << "resharding ZeRO shards saved by " << saved_world << " ranks into a laid-out plan";
    std::map<std::string, at::Tensor> whole;
    for (const auto& [name, t] : full.parameters) whole["model." + name] = t;
    for (const auto& [name, s] : full.optimizer_state) {
      for (const auto& [field, t] : s.state) whole["optimizer." + name + "." + field] = t;
      whole["optimizer." + name + ".step"] = at::full({1}, s.step, at::kLong);
    }
    std::vector<std::string> saved;
    for (const auto& [name, t] : whole) saved.push_back(name);
    target_->load_whole(
        [&](const std::string& name) {
          const auto it = whole.find(name);
          return it == whole.end() ? at::Tensor() : it->second;
        },
        saved);
  }

 private:
  std::shared_ptr<LayoutState> target_;
};

// ZeRO shards filled from laid-out pieces: the whole state is assembled from
// the boxes, then each rank takes its chunks (load_zero_full_state).
class LaidOutReader : public ShardedStateful {
 public:
  LaidOutReader(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer) : sdp_(sdp), optimizer_(optimizer) {}
  void save_state(torch::serialize::OutputArchive& /*archive*/) const override {
    DTRAIN_INTERNAL_ASSERT(false, "a LaidOutReader only loads");
  }
  void load_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) override {
    ZeroWholeTargets targets = zero_whole_targets(sdp_, optimizer_, [](const std::string& name) { return name; });
    for (const auto& item : sdp_.module().named_buffers()) {
      const std::string& name = item.key();
      targets.known.insert("model." + name);
    }
    LayoutState state([&targets, this] {
      LaidOutTensors all = targets.tensors;
      // Buffers are not sharded: filled in place where the checkpoint has them.
      for (const auto& item : sdp_.module().named_buffers()) {
        const std::string& name = item.key();
        all.emplace_back("model." + name, whole_tensor(item.value(), true));
      }
      return all;
    });
    state.set_known([&targets](const std::string& name) { return targets.known.count(name) > 0; });
    state.load_parts(part, saved_world);
    targets.finish([&state](const std::string& name) { return state.loaded(name); });
  }

 private:
  ShardedDataParallel& sdp_;
  torch::optim::Optimizer& optimizer_;
};

}  // namespace

LaidOutTensor whole_tensor(at::Tensor t, bool optional) {
  const std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
  return LaidOutTensor{
      .local = std::move(t),
      .layout = {.mesh = {{"whole", 1}}, .placements = {dist::Placement::replicate()}, .global_shape = shape},
      .coordinates = {0},
      .optional = optional};
}

ZeroWholeTargets zero_whole_targets(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer,
                                    const std::function<std::string(const std::string&)>& name_of,
                                    const PartOf& part_of) {
  ZeroWholeTargets out;
  const auto target = [&](const ZeroParameterInfo& p, bool optional) {
    at::Tensor zeros = at::zeros(p.shape, at::kFloat);
    if (!part_of) return whole_tensor(std::move(zeros), optional);
    LaidOutTensor t = part_of(p.name, std::move(zeros));
    t.optional = optional;
    return t;
  };
  const std::vector<ZeroParameterInfo> params = zero_parameters(sdp);
  const std::string kind = zero_optimizer_kind(optimizer);
  std::vector<std::string> fields;
  if (kind == "adam" || kind == "adamw") fields = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  if (kind == "sgd") fields = {"momentum_buffer"};
  for (const ZeroParameterInfo& p : params) {
    const std::string name = name_of(p.name);
    out.tensors.emplace_back("model." + name, target(p, false));
    out.known.insert("model." + name);
    if (!p.trainable) continue;
    for (const std::string& f : fields) {
      out.tensors.emplace_back("optimizer." + name + "." + f, target(p, true));
      out.known.insert("optimizer." + name + "." + f);
    }
    out.tensors.emplace_back("optimizer." + name + ".step", whole_tensor(at::zeros({1}, at::kLong), true));
    out.known.insert("optimizer." + name + ".step");
  }
  // The tensors live in `out.tensors`, which the finisher reads once loaded
  // (copies of the vector share them).
  const LaidOutTensors tensors = out.tensors;
  out.finish = [&sdp, &optimizer, params, kind, fields,
                tensors](const std::function<bool(const std::string&)>& loaded) {
    ZeroFullState full{.optimizer_kind = kind};
    std::size_t i = 0;
    for (const ZeroParameterInfo& p : params) {
      full.parameters.emplace_back(p.name, tensors[i++].second.local);
      full.trainable.push_back(p.trainable);
      if (!p.trainable) continue;
      ParameterOptimizerState s;
      for (const std::string& f : fields) {
        const auto& [name, t] = tensors[i++];
        if (loaded(name)) s.state[f] = t.local;
      }
      const auto& [step_name, step] = tensors[i++];
      if (loaded(step_name)) s.step = step.local.item<std::int64_t>();
      if (!s.state.empty()) full.optimizer_state[p.name] = std::move(s);
    }
    load_zero_full_state(sdp, optimizer, full);
  };
  return out;
}

std::shared_ptr<LayoutState> zero_parts_reader(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer,
                                               PartOf part_of) {
  struct Reader {
    ZeroWholeTargets targets;
    LayoutState* state = nullptr;
  };
  auto reader = std::make_shared<Reader>();
  auto collect = [reader, &sdp, &optimizer, part_of = std::move(part_of)] {
    reader->targets = zero_whole_targets(
        sdp, optimizer, [](const std::string& name) { return name; }, part_of);
    LaidOutTensors all = reader->targets.tensors;
    // Buffers are not sharded: filled in place where the checkpoint has them.
    for (const auto& item : sdp.module().named_buffers())
      all.emplace_back("model." + item.key(), whole_tensor(item.value(), true));
    return all;
  };
  auto after_load = [reader] {
    reader->targets.finish([&](const std::string& name) { return reader->state->loaded(name); });
  };
  auto state = std::make_shared<LayoutState>(collect, after_load);
  reader->state = state.get();
  state->set_known(known_model_names(zero_module_names(sdp)));
  return state;
}

std::vector<std::string> zero_module_names(ShardedDataParallel& sdp) {
  std::vector<std::string> names;
  for (const ZeroParameterInfo& p : zero_parameters(sdp)) names.push_back(p.name);
  for (const auto& item : sdp.module().named_buffers()) names.push_back(item.key());
  return names;
}

std::shared_ptr<ShardedStateful> zero_reader(std::shared_ptr<LayoutState> laid_out) {
  return std::make_shared<ZeroReader>(std::move(laid_out));
}

std::shared_ptr<ShardedStateful> laid_out_reader(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer) {
  return std::make_shared<LaidOutReader>(sdp, optimizer);
}

std::vector<std::pair<std::string, at::Tensor>> consolidate_laid_out(
    const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) {
  // The names and global shapes first (a piece's values are read only where
  // they are copied), then one LayoutState load into whole tensors.
  std::vector<std::pair<std::string, at::Tensor>> whole;
  std::set<std::string> seen;
  for (int r = 0; r < saved_world; ++r) {
    c10::IValue names;
    part(r).read("laid_out.names", names);
    std::stringstream in(names.toStringRef());
    std::size_t i = 0;
    for (std::string name; std::getline(in, name); ++i) {
      if (!seen.insert(name).second) continue;
      at::Tensor shape, values;
      part(r).read("laid_out." + std::to_string(i) + ".global_shape", shape);
      part(r).read("laid_out." + std::to_string(i) + ".values", values);
      const at::Tensor s = shape.to(at::kLong).contiguous();
      whole.emplace_back(name, at::zeros(at::IntArrayRef(s.data_ptr<std::int64_t>(), s.numel()), values.options()));
    }
  }
  LayoutState state([&whole] {
    LaidOutTensors out;
    for (const auto& [name, t] : whole) {
      const std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
      out.emplace_back(name, LaidOutTensor{.local = t,
                                           .layout = {.mesh = {{"whole", 1}},
                                                      .placements = {dist::Placement::replicate()},
                                                      .global_shape = shape},
                                           .coordinates = {0}});
    }
    return out;
  });
  state.load_parts(part, saved_world);
  return whole;
}

void register_saved_state(Checkpointer& checkpointer, const std::string& name, std::shared_ptr<ShardedStateful> state) {
  checkpointer.remove_state(name);
  checkpointer.add_state(name, std::move(state), StateScope::kSharded);
}

std::optional<TrainingState> load_any_plan(Checkpointer& checkpointer, const StateReaders& readers,
                                           const std::string& plan) {
  // The saving states are out of the way: a load registers only the reader
  // of the format the checkpoint has.
  checkpointer.remove_state(kLaidOutState);
  checkpointer.remove_state(kZeroState);
  const SavedModelState saved = saved_model_state(checkpointer);
  if (saved == SavedModelState::kNone) return checkpointer.load_latest();
  const char* name = saved == SavedModelState::kLaidOut ? kLaidOutState : kZeroState;
  const std::shared_ptr<ShardedStateful> reader = saved == SavedModelState::kLaidOut ? readers.laid_out
                                                  : saved == SavedModelState::kZero  ? readers.zero
                                                                                     : nullptr;
  DTRAIN_CHECK(reader != nullptr, ConfigError,
               "the checkpoint in " << checkpointer.options().dir.string() << " holds "
                                    << (saved == SavedModelState::kLaidOut ? "a laid-out model state"
                                        : saved == SavedModelState::kZero  ? "ZeRO shards"
                                        : saved == SavedModelState::kReplicated
                                            ? "a replicated model.pt (saved before laid-out checkpoints)"
                                        : saved == SavedModelState::kTensorParallel
                                            ? "a tensor-parallel state saved before tp checkpoints were laid out"
                                            : "per-rank model state")
                                    << ", which the " << plan << " plan cannot load.",
               "resume it under the plan that saved it (see docs/checkpoints.md for what reshards to what)");
  checkpointer.add_state(name, reader, StateScope::kSharded);
  struct Remove {
    Checkpointer& c;
    const char* name;
    ~Remove() { c.remove_state(name); }
  } remove{checkpointer, name};
  return checkpointer.load_latest();
}

// The default strategy's model state: the module's parameters and buffers,
// replicated over the strategy's group (rank 0 writes), laid out.
std::shared_ptr<LayoutState> Strategy::laid_out_state(torch::optim::Optimizer& optimizer) {
  if (laid_out_ && laid_out_optimizer_ == &optimizer) return laid_out_;
  laid_out_optimizer_ = &optimizer;
  laid_out_ = parameter_state(
      [this] {
        const std::optional<dist::ProcessGroup> g = group();
        const int ranks = g ? g->size() : 1, rank = g ? g->rank() : 0;
        std::vector<LaidOutParameter> out;
        auto add = [&](const std::string& name, const at::Tensor& t, bool buffer) {
          const std::vector<std::int64_t> shape(t.sizes().begin(), t.sizes().end());
          out.push_back({.name = name,
                         .tensor = {.local = t,
                                    .layout = {.mesh = {{"replicas", ranks}},
                                               .placements = {dist::Placement::replicate()},
                                               .global_shape = shape},
                                    .coordinates = {rank}},
                         .buffer = buffer});
        };
        for (const auto& item : module().named_parameters()) {
          const std::string& name = item.key();
          const at::Tensor& p = item.value();
          add(name, p, false);
        }
        for (const auto& item : module().named_buffers()) {
          const std::string& name = item.key();
          const at::Tensor& b = item.value();
          add(name, b, true);
        }
        return out;
      },
      &optimizer,
      [this] {
        std::vector<std::string> names;
        for (const auto& item : module().named_parameters()) names.push_back(item.key());
        for (const auto& item : module().named_buffers()) names.push_back(item.key());
        return names;
      }());
  return laid_out_;
}

void Strategy::save(Checkpointer& checkpointer, const TrainingState& state, torch::optim::Optimizer& optimizer) {
  register_saved_state(checkpointer, kLaidOutState, laid_out_state(optimizer));
  checkpointer.save(state);
}

std::optional<TrainingState> Strategy::load(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer) {
  // Checkpoints of this strategy before laid-out ones: model.pt and optimizer.pt.
  if (saved_model_state(checkpointer) == SavedModelState::kReplicated) {
    checkpointer.remove_state(kLaidOutState);
    return checkpointer.load_latest(module(), optimizer);
  }
  const std::shared_ptr<LayoutState> mine = laid_out_state(optimizer);
  return load_any_plan(checkpointer, {.laid_out = mine, .zero = zero_reader(mine)}, name());
}

}  // namespace dtrain
