// ZeroEngine: units, forward and stage 3's gathers (Note [ZeRO step] in
// sharded_data_parallel.cpp); backward is in zero_backward.cpp.
#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <functional>
#include <unordered_map>
#include <utility>

#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "zero_engine.h"

namespace dtrain::detail {

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

std::int64_t storage_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<std::int64_t>(t.storage().nbytes()) : 0;
}

// A tensor over `base`'s storage from element `offset`, contiguous, of `sizes`:
// an alias autograd does not know as a view (Optimizer::zero_grad detach_()es
// gradients, which it refuses for views).
at::Tensor alias_of(const at::Tensor& base, std::int64_t offset, at::IntArrayRef sizes) {
  std::vector<std::int64_t> strides(sizes.size(), 1);
  for (std::size_t i = sizes.size(); i > 1; --i)
    strides[i - 2] = strides[i - 1] * std::max<std::int64_t>(sizes[i - 1], 1);
  at::Tensor t = at::empty({0}, base.options());
  t.set_(base.storage(), base.storage_offset() + offset, sizes, strides);
  return t;
}

namespace {

// Runs a callback before a gradient accumulator stores a gradient.
class BeforeAccumulateHook : public torch::autograd::FunctionPreHook {
 public:
  explicit BeforeAccumulateHook(std::shared_ptr<ZeroEngine*> engine) : engine_(std::move(engine)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (*engine_ != nullptr) (*engine_)->begin_backward_if_needed();
    return grads;
  }

 private:
  std::shared_ptr<ZeroEngine*> engine_;
};

// Runs a callback after a gradient accumulator has stored a gradient.
class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::shared_ptr<ZeroEngine*> engine, std::size_t unit) : engine_(std::move(engine)), unit_(unit) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (*engine_ != nullptr) (*engine_)->on_grad_ready(unit_);
    return outputs;
  }

 private:
  std::shared_ptr<ZeroEngine*> engine_;
  std::size_t unit_;
};

}  // namespace

ZeroEngine::ZeroEngine(std::shared_ptr<torch::nn::Module> module, dist::ProcessGroup group, ZeroOptions options)
    : module_(std::move(module)), group_(std::move(group)), options_(std::move(options)) {
  DTRAIN_CHECK(options_.stage >= 1 && options_.stage <= 3, ConfigError,
               "ZeRO stage " << options_.stage << " does not exist.", "use stage 1, 2 or 3");
  rank_ = group_.rank();
  world_ = group_.size();
  if (options_.sequential.empty()) {
    if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module_))
      sequential_ = torch::nn::Sequential(seq);
  } else {
    for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
      if (item.key() == options_.sequential) {
        auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(item.value());
        DTRAIN_CHECK(seq, ConfigError,
                     "ZeroOptions::sequential names '" << options_.sequential << "', not a Sequential.",
                     "name the Sequential whose children forward() runs in order");
        sequential_ = torch::nn::Sequential(seq);
      }
    }
    DTRAIN_CHECK(!sequential_.is_empty(), ConfigError,
                 "ZeroOptions::sequential names '" << options_.sequential << "', which the module does not have.",
                 "give the submodule's qualified name, e.g. \"layers\"");
  }
  DTRAIN_CHECK(options_.stage < 3 || !sequential_.is_empty(), ConfigError,
               "ZeRO stage 3 needs a Sequential to run unit by unit (LibTorch modules have no forward hooks).",
               "make the root a torch::nn::Sequential or set ZeroOptions::sequential to one inside it");
  self_ = std::make_shared<ZeroEngine*>(this);
  build_units();
  install_hooks();
  peak_bytes_ = current_parameter_bytes();
}

ZeroEngine::~ZeroEngine() {
  *self_ = nullptr;
}

void ZeroEngine::build_units() {
  torch::NoGradGuard no_grad;
  // The unit candidates: children of the Sequential (or of the root).
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> candidates;
  std::string prefix = options_.sequential.empty() ? "" : options_.sequential + ".";
  const auto children = sequential_.is_empty() ? module_->named_children() : sequential_->named_children();
  for (const auto& child : children) candidates.emplace_back(prefix + child.key(), child.value());

  std::unordered_map<const c10::TensorImpl*, std::vector<std::size_t>> owners;
  std::vector<std::size_t> candidate_unit(candidates.size(), SIZE_MAX);
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const auto& [name, child] = candidates[i];
    if (options_.unit_policy && !options_.unit_policy(name, *child)) continue;
    if (child->parameters().empty()) continue;
    candidate_unit[i] = units_.size();
    units_.push_back(Unit{.name = name});
    for (const auto& p : child->parameters()) {
      auto& list = owners[p.unsafeGetTensorImpl()];
      if (list.empty() || list.back() != candidate_unit[i]) list.push_back(candidate_unit[i]);
    }
  }
  if (!sequential_.is_empty()) {
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      unit_of_child_.push_back(candidate_unit[i] == SIZE_MAX ? -1 : static_cast<int>(candidate_unit[i]));
    }
  }
  units_.push_back(Unit{.name = "<root>"});
  const std::size_t root = units_.size() - 1;

  // Parameters in the root's order, each once (a shared one has several names).
  std::unordered_map<const c10::TensorImpl*, bool> seen;
  std::optional<c10::ScalarType> dtype;
  for (const auto& item : module_->named_parameters()) {
    const at::Tensor& p = item.value();
    if (seen[p.unsafeGetTensorImpl()]) continue;
    seen[p.unsafeGetTensorImpl()] = true;
    DTRAIN_CHECK(!dtype || *dtype == p.scalar_type(), ConfigError,
                 "ShardedDataParallel needs parameters of one dtype; '" << item.key() << "' is " << p.scalar_type()
                                                                        << ", others " << *dtype << ".",
                 "convert the module (module->to(dtype)) and use MixedPrecisionPolicy for compute precision");
    DTRAIN_CHECK(!dtype || device_ == p.device(), ConfigError,
                 "ShardedDataParallel needs every parameter on one device; '" << item.key() << "' is on " << p.device()
                                                                              << ", others on " << device_ << ".",
                 "move the module to its rank's device (module->to(device)) before wrapping it");
    device_ = p.device();
    dtype = p.scalar_type();
    auto it = owners.find(p.unsafeGetTensorImpl());
    const std::size_t u = (it != owners.end() && it->second.size() == 1) ? it->second.front() : root;
    Unit& unit = units_[u];
    unit.params.push_back(FlatParam{.name = item.key(),
                                    .param = p,
                                    .shape = p.sizes().vec(),
                                    .offset = unit.numel,
                                    .numel = p.numel(),
                                    .trainable = p.requires_grad()});
    unit.numel += p.numel();
    if (p.requires_grad()) ++unit.trainable;
  }
  const c10::ScalarType original = dtype.value_or(c10::kFloat);
  param_dtype_ = options_.mixed_precision.param_dtype.value_or(original);
  reduce_dtype_ = options_.mixed_precision.reduce_dtype.value_or(param_dtype_);
  const bool casting = param_dtype_ != c10::kFloat || original != c10::kFloat;

  std::vector<at::Tensor> fulls;
  for (Unit& unit : units_) {
    unit.shard = (unit.numel + world_ - 1) / world_;
    unit.full = at::zeros({unit.shard * world_}, at::TensorOptions().dtype(param_dtype_).device(device_));
    for (FlatParam& fp : unit.params) {
      unit.full.narrow(0, fp.offset, fp.numel).copy_(fp.param.detach().reshape(-1));
      fp.param.set_data(unit.full.narrow(0, fp.offset, fp.numel).view(fp.shape));
    }
    if (unit.numel > 0) fulls.push_back(unit.full);
  }
  if (!fulls.empty() && world_ > 1) group_.broadcast_coalesced(fulls, 0).wait();  // rank 0's values everywhere
  if (!fulls.empty() && replicated()) options_.replicate_group->broadcast_coalesced(fulls, 0).wait();  // replica 0's

  for (std::size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    const std::int64_t begin = rank_ * unit.shard;
    at::Tensor mine = unit.full.narrow(0, begin, unit.shard);
    unit.chunk_is_view = options_.stage < 3 && !casting;
    unit.chunk = unit.chunk_is_view ? mine : mine.to(c10::kFloat).clone();
    unit.chunk_version = static_cast<std::int64_t>(unit.chunk._version());
    for (const FlatParam& fp : unit.params) {
      const std::int64_t lo = std::max(begin, fp.offset);
      const std::int64_t hi = std::min(begin + unit.shard, fp.offset + fp.numel);
      if (!fp.trainable || hi <= lo) continue;
      at::Tensor piece = unit.chunk.narrow(0, lo - begin, hi - lo);
      piece.set_requires_grad(true);
      unit.pieces.push_back(shards_.size());
      piece_chunk_offset_.push_back(lo - begin);
      shards_.push_back(
          ParameterShard{.name = fp.name, .parameter = fp.param, .shard = piece, .offset = lo - fp.offset});
    }
    if (options_.stage == 3) {
      free_storage(unit.full);
      unit.gathered = false;
    }
  }
  gradient_set_ = options_.mesh ? GradientSet::from_layouts(norm_layouts(*options_.mesh), *options_.mesh)
                                : GradientSet::sharded(shard_tensors(), group_);
  if (rank_ == 0) {
    std::int64_t total = 0;
    for (const Unit& unit : units_) total += unit.numel;
    DTRAIN_LOG(kInfo) << "ZeRO stage " << options_.stage << ": " << units_.size() << " units (root included), " << total
                      << " parameters, " << world_ << " ranks";
  }
}

std::vector<std::pair<at::Tensor, dist::Layout>> ZeroEngine::norm_layouts(const dist::DeviceMesh& mesh) const {
  // The mesh dimensions the sharding group spans, and this rank's row-major
  // index over them (its rank in mesh.join(shard_dims)).
  const std::vector<dist::MeshDim>& dims = mesh.dims();
  const std::vector<std::string>& names = options_.shard_dims;
  std::vector<std::size_t> spanned;
  int size = 1, index = 0;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    if (std::find(names.begin(), names.end(), dims[d].name) == names.end()) continue;
    spanned.push_back(d);
    size *= dims[d].size;
    index = index * dims[d].size + mesh.coordinates()[d];
  }
  std::string spelled;
  for (const std::string& name : names) spelled += (spelled.empty() ? "" : " x ") + name;
  DTRAIN_CHECK(size == world_ && index == rank_, ConfigError,
               "ZeRO shards over a group of " << world_ << " ranks (this one " << rank_ << "), which is not the "
                                              << spelled << " group of the mesh " << mesh.describe() << ".",
               "shard over mesh.join(ZeroOptions::shard_dims) of the mesh the parameters are laid out over");
  std::unordered_map<std::string, dist::Layout> by_name;
  for (auto& [name, layout] : dist::named_layouts(*module_, mesh)) by_name.emplace(name, std::move(layout));
  std::vector<std::pair<at::Tensor, dist::Layout>> out;
  out.reserve(shards_.size());
  for (const ParameterShard& piece : shards_) {
    dist::Layout layout = by_name.at(piece.name);
    for (std::size_t d : spanned) {
      DTRAIN_CHECK(layout.placements[d].kind == dist::Placement::Kind::kReplicate, ConfigError,
                   "parameter '" << piece.name << "' is laid out as " << layout.to_string() << ", already split over "
                                 << dims[d].name << ", which ZeRO shards itself.",
                   "declare the module's layouts over the other dimensions only (tensor-parallel layers: tp)");
      layout.placements[d] = dist::Placement::shard(0);
    }
    out.emplace_back(piece.shard, std::move(layout));
  }
  return out;
}

std::vector<at::Tensor> ZeroEngine::shard_tensors() const {
  std::vector<at::Tensor> out;
  out.reserve(shards_.size());
  for (const auto& s : shards_) out.push_back(s.shard);
  return out;
}

void ZeroEngine::install_hooks() {
  for (std::size_t u = 0; u < units_.size(); ++u) {
    for (const FlatParam& fp : units_[u].params) {
      if (!fp.trainable) continue;
      auto accumulator = torch::autograd::impl::grad_accumulator(fp.param);
      accumulator->add_pre_hook(std::make_unique<BeforeAccumulateHook>(self_));
      accumulator->add_post_hook(std::make_unique<GradReadyHook>(self_, u));
      units_[u].accumulators.push_back(std::move(accumulator));
    }
  }
  for (std::size_t u = 0; u + 1 < units_.size(); ++u) order_.push_back(units_.size() - 2 - u);
  order_.push_back(units_.size() - 1);
}

// ---- forward ----

void ZeroEngine::pre_forward() {
  in_backward_ = false;
  if (options_.stage == 3 || !dirty_) return;
  // Stages 1-2: the optimizer changed the chunks; every rank's reach every
  // rank. The root's and the first unit's gathers go out now, each later one
  // when forward reaches the unit before it (as stage 3's prefetch), so at
  // most two units' staging copies exist at once.
  dirty_ = false;
  for (Unit& unit : units_) unit.gathered = false;
  issue_gather(units_.size() - 1);
  if (units_.size() > 1) issue_gather(0);
}

void ZeroEngine::wait_all_gathered() {
  for (std::size_t u = 0; u < units_.size(); ++u) wait_gathered(u);
}

at::Tensor ZeroEngine::forward(const at::Tensor& input) {
  DTRAIN_CHECK(!sequential_.is_empty(), ConfigError,
               "ShardedDataParallel::forward runs a Sequential, and this module has none.",
               "set ZeroOptions::sequential, or call pre_forward() and the module's own forward (stages 1-2)");
  pre_forward();
  const bool grad = at::GradMode::is_enabled();
  const bool stage3 = options_.stage == 3;
  const std::size_t root = units_.size() - 1;
  if (stage3 && root > 0) {  // the root's gather and the first unit's go out together
    issue_gather(root);
    issue_gather(0);
  }
  wait_gathered(root);
  if (stage3) {
    for (auto& unit : units_) unit.input_done = false;
  }
  at::Tensor x = input;
  // A unit's output hook is registered after the next unit's input hook on the
  // same tensor: hooks run in registration order, and unit u+1 must be freed
  // (input hook) before unit u is gathered and u-1 prefetched (output hook).
  std::function<void()> pending_output_hook;
  std::size_t child = 0;
  for (auto& any : *sequential_) {
    const int u = unit_of_child_[child++];
    if (!stage3 && u >= 0) {
      wait_gathered(static_cast<std::size_t>(u));
      if (static_cast<std::size_t>(u) + 1 < root) issue_gather(static_cast<std::size_t>(u) + 1);
    }
    if (stage3 && u >= 0) {
      const auto uu = static_cast<std::size_t>(u);
      wait_gathered(uu);
      if (uu + 1 < root) issue_gather(uu + 1);  // prefetch
      if (grad && x.requires_grad()) {
        x.register_hook([token = self_, uu](const at::Tensor&) {
          if (*token != nullptr) (*token)->on_input_grad(uu);
        });
      }
    }
    if (pending_output_hook) std::exchange(pending_output_hook, nullptr)();
    x = any.forward(x);
    if (stage3 && u >= 0) {
      const auto uu = static_cast<std::size_t>(u);
      if (grad && x.requires_grad()) {
        pending_output_hook = [this, x, uu] {
          x.register_hook([token = self_, uu](const at::Tensor&) {
            if (*token != nullptr) (*token)->pre_backward(uu);
          });
        };
      }
      // The last unit's backward comes first: with grad it stays gathered
      // (freeing and gathering it again would only add a wait).
      const bool last = uu + 1 == root;
      if ((options_.reshard_after_forward && !(last && grad)) || !grad) reshard(uu);
    }
  }
  if (pending_output_hook) pending_output_hook();
  if (stage3 && !grad) reshard(root);
  note_memory();
  return x;
}

// ---- stage 3 gathers ----

void ZeroEngine::issue_gather(std::size_t u) {
  Unit& unit = units_[u];
  if (unit.gathered || unit.gathering) return;
  if (unit.numel == 0) {
    unit.gathered = true;
    return;
  }
  torch::NoGradGuard no_grad;
  allocate_storage(unit.full);
  if (unit.chunk_is_view) {
    unit.gather_input = unit.chunk.clone();  // the input may not alias the output
  } else {
    unit.gather_input = unit.chunk.scalar_type() == param_dtype_ ? unit.chunk : unit.chunk.to(param_dtype_);
  }
  unit.gather_work = group_.all_gather_into(unit.full, unit.gather_input);
  unit.gathering = true;
  note_memory();
}

void ZeroEngine::wait_gathered(std::size_t u) {
  Unit& unit = units_[u];
  if (unit.gathered) return;
  issue_gather(u);
  if (unit.gathering) {
    unit.gather_work.wait();
    unit.gathering = false;
    unit.gather_input = at::Tensor();
  }
  unit.gathered = true;
}

void ZeroEngine::reshard(std::size_t u) {
  Unit& unit = units_[u];
  if (options_.stage < 3 || full_parameter_guards > 0 || unit.numel == 0) return;
  if (unit.gathering) wait_gathered(u);
  if (!unit.gathered) return;
  free_storage(unit.full);
  unit.gathered = false;
}

// ---- the rest ----

void ZeroEngine::zero_grad() {
  for (auto& s : shards_) s.shard.mutable_grad().reset();
  for (Unit& unit : units_) {
    for (FlatParam& fp : unit.params) fp.param.mutable_grad().reset();
    if (unit.grad_flat.defined()) unit.grad_flat.zero_();
  }
}

void ZeroEngine::gather_all() {
  pre_forward();
  for (std::size_t u = 0; u < units_.size(); ++u) issue_gather(u);
  wait_all_gathered();
}

void ZeroEngine::release_all() {
  for (std::size_t u = 0; u < units_.size(); ++u) reshard(u);
}

std::map<std::string, at::Tensor> ZeroEngine::full_state_dict() {
  torch::NoGradGuard no_grad;
  ++full_parameter_guards;
  gather_all();
  std::map<std::string, at::Tensor> out;
  for (const Unit& unit : units_) {
    for (const FlatParam& fp : unit.params) {
      // Values from the fp32 chunks where they exist (mixed precision: the master weights).
      at::Tensor flat = unit.full.narrow(0, fp.offset, fp.numel).to(c10::kFloat).clone();
      out[fp.name] = flat.view(fp.shape);
    }
  }
  // Under mixed precision the masters are finer than `full`: gather them.
  if (param_dtype_ != c10::kFloat) {
    for (const Unit& unit : units_) {
      if (unit.numel == 0) continue;
      at::Tensor all = at::empty({unit.shard * world_}, at::TensorOptions().dtype(c10::kFloat).device(device_));
      at::Tensor mine = unit.chunk.clone();
      group_.all_gather_into(all, mine).wait();
      for (const FlatParam& fp : unit.params) out[fp.name] = all.narrow(0, fp.offset, fp.numel).view(fp.shape).clone();
    }
  }
  --full_parameter_guards;
  release_all();
  return out;
}

std::int64_t ZeroEngine::current_parameter_bytes() const {
  std::int64_t bytes = 0;
  for (const Unit& unit : units_) {
    bytes += storage_bytes(unit.full);
    if (!unit.chunk_is_view) bytes += storage_bytes(unit.chunk);
    if (unit.gather_input.defined() && !unit.gather_input.is_same(unit.chunk))
      bytes += storage_bytes(unit.gather_input);
  }
  return bytes;
}

void ZeroEngine::note_memory() {
  peak_bytes_ = std::max(peak_bytes_, current_parameter_bytes());
}

ZeroMemoryStats ZeroEngine::memory_stats() const {
  return {.parameter_bytes = current_parameter_bytes(), .peak_parameter_bytes = peak_bytes_};
}

}  // namespace dtrain::detail
