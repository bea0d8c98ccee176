// ZeRO shards <-> the whole state by parameter name, and that state <->
// Python's FSDP2 state-dict structure (include/dtrain/parallel/zero/full_state.h).
#include "dtrain/parallel/zero/full_state.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <filesystem>
#include <memory>
#include <set>

#include "dtrain/checkpoint/checkpoint_reader.h"
#include "dtrain/checkpoint/optimizer_state.h"
#include "dtrain/error.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"
#include "zero_engine.h"
#include "zero_part_format.h"

namespace dtrain {
namespace {

using Dict = c10::impl::GenericDict;

Dict any_dict() {
  return Dict(c10::AnyType::get(), c10::AnyType::get());
}

// Unit u's flat `what` (param or an optimizer key), [numel] fp32, from the
// saved chunks; undefined when no part holds it.
at::Tensor saved_flat(const std::function<torch::serialize::InputArchive&(int)>& part, int shards,
                      const detail::SavedLayout& layout, std::size_t u, const std::string& what) {
  std::vector<at::Tensor> chunks;
  for (int r = 0; r < shards; ++r) {
    at::Tensor t;
    if (!part(r).try_read(detail::unit_key(u, what), t)) return {};
    chunks.push_back(t.reshape(-1).to(at::kFloat));
  }
  return at::cat(chunks).narrow(0, 0, layout.numel[u]);
}

}  // namespace

ZeroFullState consolidate_zero_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) {
  torch::NoGradGuard no_grad;
  const detail::SavedLayout layout = detail::read_layout(part(0));
  DTRAIN_CHECK(!layout.params.empty(), DataError,
               "this ZeRO checkpoint does not record where each parameter lies in its unit (it was saved before "
               "dtrain recorded it).",
               "resume it in dtrain and save it again, then convert the new checkpoint");
  const int shards = layout.shard_world > 0 ? layout.shard_world : saved_world;
  // Parts 0 .. shards-1 must be shards 0 .. shards-1 of replica 0, as the
  // resharding load requires (sharded_checkpoint.cpp).
  for (int r = 1; r < shards && layout.shard_world > 0; ++r) {
    const detail::SavedLayout other = detail::read_layout(part(r));
    DTRAIN_CHECK(other.shard_rank == r && other.replica == 0, DataError,
                 "part " << r << " of this ZeRO checkpoint holds shard " << other.shard_rank << " of replica "
                         << other.replica << ", not shard " << r << " of replica 0.",
                 "save HSDP with the checkpoint group's ranks ordered replica-major (a DeviceMesh with dp_replicate "
                 "outside dp_shard)");
  }
  ZeroFullState full;
  full.optimizer_kind = layout.kind;
  full.options = detail::read_options(part(0), layout.kind);
  // Units flat, once each: the parameters and every optimizer key.
  std::vector<std::map<std::string, at::Tensor>> flats(layout.numel.size());
  std::vector<std::int64_t> steps(layout.numel.size(), 0);
  for (std::size_t u = 0; u < layout.numel.size(); ++u) {
    flats[u]["param"] = saved_flat(part, shards, layout, u, "param");
    DTRAIN_CHECK(flats[u]["param"].defined(), DataError,
                 "unit " << u << " (" << layout.names.at(u) << ") has no saved chunk in some part.",
                 "the checkpoint is incomplete; use another one");
    for (const std::string& key : detail::state_keys(layout.kind)) {
      at::Tensor t = saved_flat(part, shards, layout, u, key);
      if (t.defined()) flats[u][key] = t;
    }
    for (int r = 0; r < shards; ++r) {
      at::Tensor t;
      if (part(r).try_read(detail::unit_key(u, "step"), t)) steps[u] = std::max(steps[u], t.item<std::int64_t>());
    }
  }
  for (const detail::SavedParam& p : layout.params) {
    const std::int64_t numel = c10::multiply_integers(p.shape);
    auto& unit = flats.at(p.unit);
    full.parameters.emplace_back(p.name, unit.at("param").narrow(0, p.offset, numel).view(p.shape).clone());
    full.trainable.push_back(p.trainable);
    full.placements.push_back({.unit = layout.names.at(p.unit),
                               .offset = p.offset,
                               .unit_numel = layout.numel.at(p.unit),
                               .shard = layout.shard.at(p.unit),
                               .shards = shards});
    if (!p.trainable || unit.size() == 1 || (steps[p.unit] == 0 && layout.kind != "sgd")) continue;
    ParameterOptimizerState state{.step = steps[p.unit]};
    for (const auto& [key, flat] : unit) {
      if (key != "param") state.state[key] = flat.narrow(0, p.offset, numel).view(p.shape).clone();
    }
    full.optimizer_state[p.name] = std::move(state);
  }
  return full;
}

ZeroFullState read_zero_checkpoint(const CheckpointFolder& folder, const std::string& name) {
  DTRAIN_CHECK(
      std::filesystem::exists(sharded_part(folder, name, 0)), DataError,
      "checkpoint " << folder.dir.string() << " has no sharded state '" << name << "' (rank_0/" << name << ".pt).",
      "this reads checkpoints of ZeRO runs (--strategy zero1|zero2|zero3, ShardedCheckpointer)");
  std::vector<std::unique_ptr<torch::serialize::InputArchive>> parts(static_cast<std::size_t>(folder.world_size));
  auto part = [&](int r) -> torch::serialize::InputArchive& {
    const auto file = sharded_part(folder, name, r);
    auto& slot = parts[static_cast<std::size_t>(r)];
    if (!slot) {
      slot = std::make_unique<torch::serialize::InputArchive>();
      slot->load_from(file.string());
    }
    return *slot;
  };
  return consolidate_zero_parts(part, folder.world_size);
}

std::vector<ZeroParameterInfo> zero_parameters(ShardedDataParallel& sdp) {
  std::vector<ZeroParameterInfo> out;
  for (const detail::Unit& unit : sdp.engine().units())
    for (const detail::FlatParam& fp : unit.params)
      out.push_back({.name = fp.name, .shape = fp.shape, .trainable = fp.trainable});
  return out;
}

std::string zero_optimizer_kind(const torch::optim::Optimizer& optimizer) {
  return detail::kind_of(optimizer);
}

void load_zero_full_state(ShardedDataParallel& sdp, torch::optim::Optimizer& optimizer, const ZeroFullState& full) {
  torch::NoGradGuard no_grad;
  detail::ZeroEngine& engine = sdp.engine();
  const std::string kind = detail::kind_of(optimizer);
  DTRAIN_CHECK(full.optimizer_kind == kind || full.optimizer_state.empty(), ConfigError,
               "the state holds a " << full.optimizer_kind << " optimizer's state, this run uses " << kind << ".",
               "build the optimizer the state was saved with");
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : full.parameters) by_name[name] = &t;
  const int rank = engine.rank();
  for (detail::Unit& unit : engine.units()) {
    const std::int64_t begin = rank * unit.shard, end = std::min(begin + unit.shard, unit.numel);
    for (const detail::FlatParam& fp : unit.params) {
      const auto it = by_name.find(fp.name);
      DTRAIN_CHECK(it != by_name.end(), DataError, "the state has no parameter '" << fp.name << "'.",
                   "load a state of the same model (names as in named_parameters())");
      const at::Tensor& value = *it->second;
      DTRAIN_CHECK(value.sizes() == at::IntArrayRef(fp.shape), DataError,
                   "parameter '" << fp.name << "' has shape " << value.sizes() << " in the state, "
                                 << at::IntArrayRef(fp.shape) << " in the model.",
                   "load a state of the same model");
      const std::int64_t lo = std::max(begin, fp.offset), hi = std::min(end, fp.offset + fp.numel);
      if (hi <= lo) continue;
      unit.chunk.narrow(0, lo - begin, hi - lo)
          .copy_(value.reshape(-1).narrow(0, lo - fp.offset, hi - lo).to(unit.chunk.scalar_type()));
    }
  }
  for (const ParameterShard& piece : sdp.parameter_shards()) {
    auto* impl = piece.shard.unsafeGetTensorImpl();
    optimizer.state().erase(impl);
    const auto it = full.optimizer_state.find(piece.name);
    if (it == full.optimizer_state.end() || it->second.state.empty() || kind == "other") continue;
    std::map<std::string, at::Tensor> mine;
    for (const auto& [key, t] : it->second.state) {
      DTRAIN_CHECK(t.numel() == piece.parameter.numel(), DataError,
                   "optimizer state '" << key << "' of '" << piece.name << "' has " << t.numel()
                                       << " elements, the parameter " << piece.parameter.numel() << ".",
                   "load a state of the same model");
      mine[key] = t.reshape(-1).narrow(0, piece.offset, piece.shard.numel()).to(at::kFloat).clone();
    }
    optimizer.state()[impl] = detail::make_state(kind, mine, it->second.step);
  }
  // Options of another optimizer's type would be static_cast to this one's at
  // its next step: set them only when the kinds agree.
  if (full.options && full.optimizer_kind == kind) {
    DTRAIN_CHECK(optimizer.param_groups().size() == 1, ConfigError,
                 "the state holds one param group's options, the optimizer has " << optimizer.param_groups().size()
                                                                                 << " groups.",
                 "build the optimizer over sdp.parameters() in one group");
    optimizer.param_groups()[0].set_options(full.options->clone());
  }
  engine.mark_dirty();
}

c10::IValue to_fsdp_state_dict(const ZeroFullState& full) {
  DTRAIN_CHECK(full.options, ConfigError,
               "the state does not record the optimizer's options (a checkpoint saved before issue 26, or an "
               "optimizer with several param groups), which Python's param_groups need.",
               "resume it in dtrain with one param group and save again");
  Dict model = any_dict();
  for (const auto& [name, t] : full.parameters) model.insert(name, t);
  Dict state = any_dict();
  c10::impl::GenericList names(c10::AnyType::get());
  for (std::size_t i = 0; i < full.parameters.size(); ++i) {
    if (!full.trainable[i]) continue;
    const std::string& name = full.parameters[i].first;
    names.push_back(name);
    const auto it = full.optimizer_state.find(name);
    if (it == full.optimizer_state.end()) continue;
    Dict s = any_dict();
    // Python keeps an Adam step as a float32 scalar tensor.
    if (full.optimizer_kind != "sgd") s.insert("step", at::scalar_tensor(static_cast<double>(it->second.step)));
    for (const auto& [key, t] : it->second.state) s.insert(key, t);
    state.insert(name, s);
  }
  Dict group = checkpoint::python_param_group(*full.options);
  group.insert("params", names);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  Dict optim = any_dict();
  optim.insert("state", state);
  optim.insert("param_groups", groups);
  Dict out = any_dict();
  out.insert("model", model);
  out.insert("optim", optim);
  return out;
}

namespace {

Dict dict_at(const Dict& d, const std::string& key, const std::string& where) {
  DTRAIN_CHECK(d.contains(key) && d.at(key).isGenericDict(), DataError, where << " has no dict '" << key << "'.",
               "give the structure python/dtrain_dcp.py from-dcp writes: {\"model\": ..., \"optim\": {\"state\": "
               "..., \"param_groups\": [...]}}");
  return d.at(key).toGenericDict();
}

ZeroFullState from_fsdp(const c10::IValue& value) {
  DTRAIN_CHECK(value.isGenericDict(), DataError, "the state dict is not a dict.",
               "give the file python/dtrain_dcp.py from-dcp writes");
  const Dict top = value.toGenericDict();
  ZeroFullState full;
  for (const auto& entry : dict_at(top, "model", "the state dict")) {
    DTRAIN_CHECK(entry.value().isTensor(), DataError, "model entry '" << entry.key().toStringRef() << "' is no tensor.",
                 "");
    full.parameters.emplace_back(entry.key().toStringRef(), entry.value().toTensor().to(at::kFloat));
    full.trainable.push_back(false);
  }
  if (!top.contains("optim")) return full;
  const Dict optim = dict_at(top, "optim", "the state dict");
  DTRAIN_CHECK(optim.contains("param_groups") && optim.at("param_groups").isList() &&
                   optim.at("param_groups").toList().size() == 1,
               DataError, "the optimizer state has no param_groups list of one group.",
               "save an optimizer with one param group");
  const Dict group = optim.at("param_groups").toList().get(0).toGenericDict();
  const bool sgd = group.contains("momentum");
  full.optimizer_kind = sgd ? "sgd" : "adamw";
  full.options = checkpoint::options_from_python_param_group(group);
  std::set<std::string> trainable;
  const auto params = group.at("params").toList();
  for (std::size_t i = 0; i < params.size(); ++i) trainable.insert(params.get(i).toStringRef());
  for (std::size_t i = 0; i < full.parameters.size(); ++i) {
    full.trainable[i] = trainable.count(full.parameters[i].first) > 0;
  }
  for (const auto& entry : dict_at(optim, "state", "the optimizer state")) {
    const std::string& name = entry.key().toStringRef();
    DTRAIN_CHECK(trainable.count(name), DataError, "optimizer state for '" << name << "', which no param group lists.",
                 "");
    ParameterOptimizerState state;
    for (const auto& kv : entry.value().toGenericDict()) {
      const std::string& key = kv.key().toStringRef();
      if (key == "step") {
        const auto& v = kv.value();
        state.step = v.isTensor() ? static_cast<std::int64_t>(v.toTensor().item<double>())
                                  : static_cast<std::int64_t>(v.isDouble() ? v.toDouble() : v.toInt());
      } else if (kv.value().isTensor()) {
        state.state[key] = kv.value().toTensor().to(at::kFloat);
      }
    }
    full.optimizer_state[name] = std::move(state);
  }
  return full;
}

}  // namespace

ZeroFullState from_fsdp_state_dict(const c10::IValue& state_dict) {
  try {
    return from_fsdp(state_dict);
  } catch (const dtrain::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw DataError(std::string("the state dict is malformed (") + e.what() + ").",
                    "give the file python/dtrain_dcp.py from-dcp writes");
  }
}

}  // namespace dtrain
