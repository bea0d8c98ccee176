// Checkpoint state keyed by layouts (see layout_state.h).
#include "dtrain/checkpoint/layout_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"

namespace dtrain {

namespace {

std::string key(std::size_t i, const char* what) {
  return "laid_out." + std::to_string(i) + "." + what;
}

// Whether this rank writes the tensor: the first rank along every mesh
// dimension that replicates it, so the saved boxes are disjoint.
bool writes(const std::string& name, const LaidOutTensor& t) {
  for (std::size_t d = 0; d < t.layout.placements.size(); ++d) {
    const auto kind = t.layout.placements[d].kind;
    DTRAIN_CHECK(kind != dist::Placement::Kind::kPartial, ConfigError,
                 "checkpoint: " << name << " is a partial sum (" << t.layout.to_string() << ").",
                 "reduce it before saving");
    if (kind == dist::Placement::Kind::kReplicate && t.coordinates.at(d) != 0) return false;
  }
  return true;
}

at::Tensor box_tensor(const dist::Box& box) {
  std::vector<std::int64_t> flat = box.offsets;
  flat.insert(flat.end(), box.sizes.begin(), box.sizes.end());
  return at::tensor(flat, at::kLong).view({2, static_cast<std::int64_t>(box.offsets.size())});
}

std::vector<std::int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.contiguous().to(at::kLong);
  return {c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel()};
}

// One saved part's index: name -> its position in the part.
std::map<std::string, std::size_t> names_in(torch::serialize::InputArchive& archive) {
  c10::IValue names;
  archive.read("laid_out.names", names);
  std::map<std::string, std::size_t> out;
  std::stringstream in(names.toStringRef());
  std::size_t i = 0;
  for (std::string name; std::getline(in, name);) out.emplace(name, i++);
  return out;
}

}  // namespace

LayoutState::LayoutState(std::function<LaidOutTensors()> collect, std::function<void()> after_load)
    : collect_(std::move(collect)), after_load_(std::move(after_load)) {}

void LayoutState::save_state(torch::serialize::OutputArchive& archive) const {
  std::string names;
  std::size_t i = 0;
  for (const auto& [name, t] : collect_()) {
    if (!writes(name, t)) continue;
    DTRAIN_CHECK(name.find('\n') == std::string::npos, ConfigError, "checkpoint: tensor name with a line break",
                 "name tensors without line breaks");
    const dist::Box box = t.layout.local_box(t.coordinates);
    DTRAIN_CHECK(t.local.numel() == box.numel(), ConfigError,
                 "checkpoint: " << name << " holds " << t.local.numel() << " elements, its layout "
                                << t.layout.to_string() << " gives this rank " << box.numel(),
                 "declare the layout the tensor has");
    archive.write(key(i, "values"), t.local.detach().reshape(box.sizes).cpu().clone());
    archive.write(key(i, "box"), box_tensor(box));
    archive.write(key(i, "global_shape"), at::tensor(t.layout.global_shape, at::kLong));
    names += (i == 0 ? "" : "\n") + name;
    ++i;
  }
  archive.write("laid_out.names", c10::IValue(names));
}

void LayoutState::load_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) {
  std::vector<std::map<std::string, std::size_t>> index;
  for (int r = 0; r < saved_world; ++r) index.push_back(names_in(part(r)));
  loaded_.clear();
  std::set<std::string> present;
  for (const auto& names : index)
    for (const auto& [name, i] : names) present.insert(name);
  loaded_.assign(present.begin(), present.end());

  c10::NoGradGuard no_grad;
  for (auto& [name, t] : collect_()) {
    if (!present.count(name)) {
      DTRAIN_CHECK(t.optional, DataError,
                   "the checkpoint has no " << name << " (saved by " << saved_world << " ranks).",
                   "resume with the model and optimizer that saved it");
      continue;
    }
    const dist::Box mine = t.layout.local_box(t.coordinates);
    at::Tensor target = t.local.view(mine.sizes);  // local's own storage
    at::Tensor staging = target.device().is_cpu() ? target : at::empty(mine.sizes, target.options().device(at::kCPU));
    std::int64_t covered = 0;
    for (int r = 0; r < saved_world; ++r) {
      const auto it = index[static_cast<std::size_t>(r)].find(name);
      if (it == index[static_cast<std::size_t>(r)].end()) continue;
      at::Tensor box_t, shape_t, values;
      part(r).read(key(it->second, "box"), box_t);
      part(r).read(key(it->second, "global_shape"), shape_t);
      const std::vector<std::int64_t> global = to_vector(shape_t);
      DTRAIN_CHECK(global == t.layout.global_shape, DataError,
                   "checkpoint: " << name << " was saved with the global shape " << at::IntArrayRef(global)
                                  << ", the model's is " << at::IntArrayRef(t.layout.global_shape) << ".",
                   "resume with the model configuration that saved it");
      const std::vector<std::int64_t> b = to_vector(box_t);
      const std::size_t dims = b.size() / 2;
      const dist::Box saved{.offsets = {b.begin(), b.begin() + static_cast<std::ptrdiff_t>(dims)},
                            .sizes = {b.begin() + static_cast<std::ptrdiff_t>(dims), b.end()}};
      if (!dist::intersect(saved, mine)) continue;
      part(r).read(key(it->second, "values"), values);
      covered += dist::copy_intersection(values.to(staging.scalar_type()), saved, staging, mine);
    }
    DTRAIN_CHECK(covered == mine.numel(), DataError,
                 "checkpoint: the saved parts of " << name << " cover " << covered << " of the " << mine.numel()
                                                   << " elements this rank needs.",
                 "the checkpoint is incomplete; resume from another one");
    if (!staging.is_same(target)) target.copy_(staging);
  }
  if (after_load_) after_load_();
}

bool LayoutState::loaded(const std::string& name) const {
  return std::find(loaded_.begin(), loaded_.end(), name) != loaded_.end();
}

namespace {

// One parameter's optimizer state as laid-out tensors; the Adam step as an
// int64 [1] replicated tensor, moved into the state after load.
struct OptimizerFields {
  torch::optim::Optimizer* optimizer = nullptr;
  std::vector<std::pair<torch::optim::OptimizerParamState*, at::Tensor>> steps;  // of the last collect

  template <typename State>
  void add_adam(const std::string& name, const at::Tensor& p, const LaidOutTensor& like, const dist::DeviceMesh& mesh,
                bool amsgrad, bool create, LaidOutTensors& out) {
    auto& states = optimizer->state();
    auto it = states.find(p.unsafeGetTensorImpl());
    if (it == states.end()) {
      if (!create) return;
      auto s = std::make_unique<State>();
      s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
      s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      if (amsgrad) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      it = states.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
    }
    auto& s = static_cast<State&>(*it->second);
    auto field = [&](const char* what, const at::Tensor& t) {
      if (!t.defined()) return;
      LaidOutTensor f = like;
      f.local = t;
      f.optional = true;
      out.emplace_back("optimizer." + name + "." + what, f);
    };
    field("exp_avg", s.exp_avg());
    field("exp_avg_sq", s.exp_avg_sq());
    field("max_exp_avg_sq", s.max_exp_avg_sq());
    const at::Tensor step = at::full({1}, s.step(), at::kLong);
    steps.emplace_back(&s, step);
    out.emplace_back("optimizer." + name + ".step", LaidOutTensor{.local = step,
                                                                  .layout = dist::Layout::replicated(mesh, {1}),
                                                                  .coordinates = like.coordinates,
                                                                  .optional = true});
  }

  void add(const std::string& name, const at::Tensor& p, const LaidOutTensor& like, const dist::DeviceMesh& mesh,
           bool create, LaidOutTensors& out) {
    if (auto* adamw = dynamic_cast<torch::optim::AdamW*>(optimizer)) {
      const bool amsgrad = static_cast<const torch::optim::AdamWOptions&>(adamw->defaults()).amsgrad();
      add_adam<torch::optim::AdamWParamState>(name, p, like, mesh, amsgrad, create, out);
    } else if (auto* adam = dynamic_cast<torch::optim::Adam*>(optimizer)) {
      const bool amsgrad = static_cast<const torch::optim::AdamOptions&>(adam->defaults()).amsgrad();
      add_adam<torch::optim::AdamParamState>(name, p, like, mesh, amsgrad, create, out);
    } else if (dynamic_cast<torch::optim::SGD*>(optimizer) != nullptr) {
      auto& states = optimizer->state();
      auto it = states.find(p.unsafeGetTensorImpl());
      if (it == states.end()) {
        if (!create) return;
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
        it = states.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
      }
      const at::Tensor& buffer = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
      if (!buffer.defined()) return;
      LaidOutTensor f = like;
      f.local = buffer;
      f.optional = true;
      out.emplace_back("optimizer." + name + ".momentum_buffer", f);
    } else {
      DTRAIN_CHECK(false, ConfigError,
                   "layout checkpoints save the state of Adam, AdamW and SGD; this optimizer is none of them.",
                   "use one of them, or save its state with add_state");
    }
  }
};

}  // namespace

std::shared_ptr<LayoutState> layout_state(torch::nn::Module& module, const dist::DeviceMesh& mesh,
                                          torch::optim::Optimizer* optimizer) {
  auto fields = std::make_shared<OptimizerFields>();
  fields->optimizer = optimizer;
  auto loading = std::make_shared<bool>(false);
  auto collect = [&module, &mesh, fields, loading] {
    LaidOutTensors out;
    const auto params = module.named_parameters();
    fields->steps.clear();
    for (const auto& [name, layout] : dist::named_layouts(module, mesh)) {
      const at::Tensor& p = params[name];
      LaidOutTensor t{.local = p, .layout = layout, .coordinates = mesh.coordinates()};
      out.emplace_back("model." + name, t);
      if (fields->optimizer) fields->add(name, p, t, mesh, *loading, out);
    }
    return out;
  };
  auto after_load = [fields, loading] {
    for (auto& [state, step] : fields->steps) {
      if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(state)) adamw->step(step.item<std::int64_t>());
      if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(state)) adam->step(step.item<std::int64_t>());
    }
    *loading = false;
  };
  // Loading creates the optimizer state a fresh optimizer lacks; saving
  // writes only what exists.
  class ModuleLayoutState : public LayoutState {
   public:
    ModuleLayoutState(std::function<LaidOutTensors()> c, std::function<void()> a, std::shared_ptr<bool> loading)
        : LayoutState(std::move(c), std::move(a)), loading_(std::move(loading)) {}
    void load_parts(const std::function<torch::serialize::InputArchive&(int)>& part, int saved_world) override {
      *loading_ = true;
      LayoutState::load_parts(part, saved_world);
    }

   private:
    std::shared_ptr<bool> loading_;
  };
  return std::make_shared<ModuleLayoutState>(collect, after_load, loading);
}

}  // namespace dtrain
