// Checkpoint state keyed by layouts (see layout_state.h).
#include "dtrain/checkpoint/layout_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/accumulate.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/log.h"

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

// One saved part's index: each entry's name and position in the part (a
// name appears once per box it was written as: flat ranges).
std::vector<std::pair<std::string, std::size_t>> names_in(torch::serialize::InputArchive& archive) {
  c10::IValue names;
  archive.read("laid_out.names", names);
  std::vector<std::pair<std::string, std::size_t>> out;
  std::stringstream in(names.toStringRef());
  std::size_t i = 0;
  for (std::string name; std::getline(in, name);) out.emplace_back(name, i++);
  return out;
}

// Elements [begin, end) (row-major) of a box of sizes `sizes`, from
// dimension `d` on, inside the run `at` (offsets of the dimensions before
// `d` fixed, the rest 0): appends the boxes, relative to the box's origin.
void append_runs(const std::vector<std::int64_t>& sizes, std::size_t d, std::vector<std::int64_t> at,
                 std::int64_t begin, std::int64_t end, std::vector<dist::Box>& out) {
  if (begin >= end) return;
  std::int64_t inner = 1;
  for (std::size_t k = d + 1; k < sizes.size(); ++k) inner *= sizes[k];
  // One box of whole rows [first, last) of dimension d, of full later dimensions.
  const auto rows = [&](std::int64_t first, std::int64_t last) {
    dist::Box b{.offsets = at, .sizes = std::vector<std::int64_t>(sizes.size(), 1)};
    b.offsets[d] = first;
    b.sizes[d] = last - first;
    for (std::size_t k = d + 1; k < sizes.size(); ++k) b.sizes[k] = sizes[k];
    out.push_back(std::move(b));
  };
  std::int64_t first = begin / inner;
  const std::int64_t last = end / inner, head = begin % inner, tail = end % inner;
  if (first == last) {  // inside one row
    at[d] = first;
    append_runs(sizes, d + 1, at, head, tail, out);
    return;
  }
  if (head != 0) {
    at[d] = first;
    append_runs(sizes, d + 1, at, head, inner, out);
    ++first;
  }
  if (last > first) rows(first, last);
  if (tail != 0) {
    at[d] = last;
    append_runs(sizes, d + 1, at, 0, tail, out);
  }
}

// The tensors with flat ranges replaced by one tensor per box of the range:
// a view of `local`'s elements of that box (so a load fills `local`).
LaidOutTensors expand_flat_ranges(LaidOutTensors tensors) {
  LaidOutTensors out;
  out.reserve(tensors.size());
  for (auto& [name, t] : tensors) {
    if (!t.flat_range) {
      out.emplace_back(name, std::move(t));
      continue;
    }
    const LaidOutTensor::FlatRange range = *t.flat_range;
    DTRAIN_CHECK(t.local.numel() == range.size && t.local.is_contiguous(), ConfigError,
                 "checkpoint: " << name << " holds " << t.local.numel()
                                << (t.local.is_contiguous() ? "" : " non-contiguous") << " elements, its flat range "
                                << range.size,
                 "give flat ranges as contiguous tensors of the range's size");
    const dist::Box whole = t.box ? *t.box : t.layout.local_box(t.coordinates);
    const at::Tensor flat = t.local.view({-1});
    std::int64_t at_element = 0;
    for (dist::Box& b : flat_range_boxes(whole, range.begin, range.size)) {
      LaidOutTensor piece = t;
      piece.flat_range.reset();
      piece.local = flat.narrow(0, at_element, b.numel());
      at_element += b.numel();
      piece.box = std::move(b);
      out.emplace_back(name, std::move(piece));
    }
  }
  return out;
}

}  // namespace

std::vector<dist::Box> flat_range_boxes(const dist::Box& box, std::int64_t begin, std::int64_t size) {
  DTRAIN_CHECK(begin >= 0 && size >= 0 && begin + size <= box.numel(), ConfigError,
               "flat range [" << begin << ", " << begin + size << ") outside a box of " << box.numel() << " elements",
               "give a range inside the tensor's box");
  std::vector<dist::Box> out;
  if (size == 0) return out;
  if (box.sizes.empty()) return {box};  // a scalar
  append_runs(box.sizes, 0, std::vector<std::int64_t>(box.sizes.size(), 0), begin, begin + size, out);
  for (dist::Box& b : out)
    for (std::size_t d = 0; d < b.offsets.size(); ++d) b.offsets[d] += box.offsets[d];
  return out;
}

LayoutState::LayoutState(std::function<LaidOutTensors()> collect, std::function<void()> after_load)
    : collect_(std::move(collect)), after_load_(std::move(after_load)) {}

void LayoutState::save_state(torch::serialize::OutputArchive& archive) const {
  std::string names;
  std::size_t i = 0;
  for (const auto& [name, t] : expand_flat_ranges(collect_())) {
    if (!t.saved || !writes(name, t)) continue;
    DTRAIN_CHECK(name.find('\n') == std::string::npos, ConfigError, "checkpoint: tensor name with a line break",
                 "name tensors without line breaks");
    const dist::Box box = t.box ? *t.box : t.layout.local_box(t.coordinates);
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
  Pieces pieces;
  for (int r = 0; r < saved_world; ++r) {
    for (const auto& [name, i] : names_in(part(r))) {
      at::Tensor box_t, shape_t;
      part(r).read(key(i, "box"), box_t);
      part(r).read(key(i, "global_shape"), shape_t);
      const std::vector<std::int64_t> b = to_vector(box_t);
      const auto dims = static_cast<std::ptrdiff_t>(b.size() / 2);
      pieces[name].push_back({.box = {.offsets = {b.begin(), b.begin() + dims}, .sizes = {b.begin() + dims, b.end()}},
                              .global_shape = to_vector(shape_t),
                              .values = [&part, r, i = i] {
                                at::Tensor values;
                                part(r).read(key(i, "values"), values);
                                return values;
                              }});
    }
  }
  std::vector<std::string> saved;
  for (const auto& [name, p] : pieces) saved.push_back(name);
  load_pieces(
      [&pieces](const std::string& name) -> const std::vector<Piece>* {
        const auto it = pieces.find(name);
        return it == pieces.end() ? nullptr : &it->second;
      },
      saved, "saved by " + std::to_string(saved_world) + " ranks");
}

void LayoutState::load_whole(const std::function<at::Tensor(const std::string&)>& whole,
                             const std::vector<std::string>& saved) {
  // Looked up by the targets' names as the load collects them (a fresh
  // optimizer's state exists only then).
  Pieces pieces;
  load_pieces(
      [&](const std::string& name) -> const std::vector<Piece>* {
        if (auto it = pieces.find(name); it != pieces.end()) return &it->second;
        const at::Tensor w = whole(name);
        if (!w.defined()) return nullptr;
        const std::vector<std::int64_t> shape(w.sizes().begin(), w.sizes().end());
        auto& p = pieces[name];
        p.push_back({.box = {.offsets = std::vector<std::int64_t>(shape.size(), 0), .sizes = shape},
                     .global_shape = shape,
                     .values = [w] { return w; }});
        return &p;
      },
      saved, "consolidated");
}

// Note [Another shape of the same tensor]: plans may lay a tensor out in
// shapes of the same elements: tensor parallelism saves a fused QKV weight
// [3C, C] as [3, C, C] (its column split takes one box per rank only in that
// shape), one process as [3C, C]. Saved pieces in another global shape with
// as many elements (row-major, as the tensors are) are read when one side is
// whole: a rank holding the whole tensor reads it in the saved shape (its
// local viewed so), and a saved piece that is the whole tensor is read in the
// model's shape. Parts on both sides, in two shapes, are refused: a box of
// one shape is not one box of the other.
LayoutState::Frame LayoutState::frame_of(const std::string& name, const LaidOutTensor& t, const dist::Box& mine,
                                         const std::vector<Piece>& pieces) {
  const std::vector<std::int64_t>& model = t.layout.global_shape;
  const std::vector<std::int64_t>& saved = pieces.front().global_shape;
  for (const Piece& piece : pieces)
    DTRAIN_CHECK(piece.global_shape == saved, DataError,
                 "checkpoint: " << name << " was saved in two global shapes, " << at::IntArrayRef(saved) << " and "
                                << at::IntArrayRef(piece.global_shape) << ".",
                 "the checkpoint is damaged or mixes two runs; resume from another one");
  if (saved == model) return {.mine = mine, .shape = model};
  const auto whole = [](const std::vector<std::int64_t>& s) {
    return dist::Box{.offsets = std::vector<std::int64_t>(s.size(), 0), .sizes = s};
  };
  const auto is_whole = [&](const dist::Box& b, const std::vector<std::int64_t>& s) {
    return b.sizes == s && b.offsets == whole(s).offsets;
  };
  DTRAIN_CHECK(c10::multiply_integers(saved) == c10::multiply_integers(model), DataError,
               "checkpoint: " << name << " was saved with the global shape " << at::IntArrayRef(saved)
                              << ", the model's is " << at::IntArrayRef(model) << ".",
               "resume with the model configuration that saved it");
  if (is_whole(mine, model)) return {.mine = whole(saved), .shape = saved};
  if (pieces.size() == 1 && is_whole(pieces.front().box, saved))
    return {.mine = mine, .shape = model, .reshape_pieces = true};
  DTRAIN_CHECK(
      false, DataError,
      "checkpoint: " << name << " was saved in parts of the global shape " << at::IntArrayRef(saved)
                     << ", and this rank holds a part of it in the shape " << at::IntArrayRef(model)
                     << "; a part of one shape is not a box of the other.",
      "resume under a plan that holds the tensor whole (one process, DDP, ZeRO), save, and reshard from there");
  return {};
}

// A ZeRO piece of a whole tensor is a run of its row-major elements, saved
// flat; a tensor-parallel rank holds a box of the model's shape. A run is at
// most 2 x dims - 1 boxes of that shape (flat_range_boxes), so flat pieces are
// read as those boxes, each a slice of the piece's values (read once, then
// shared by its boxes).
std::vector<LayoutState::Piece> LayoutState::in_model_shape(const std::vector<Piece>& pieces,
                                                            const std::vector<std::int64_t>& model) {
  if (pieces.empty() || pieces.front().global_shape.size() != 1 || model.size() < 2 ||
      pieces.front().global_shape[0] != c10::multiply_integers(model))
    return pieces;
  const dist::Box whole{.offsets = std::vector<std::int64_t>(model.size(), 0), .sizes = model};
  std::vector<Piece> out;
  for (const Piece& piece : pieces) {
    if (piece.global_shape != pieces.front().global_shape) return pieces;  // frame_of names the damage
    auto flat = std::make_shared<at::Tensor>();
    std::int64_t at_element = 0;
    for (dist::Box& b : flat_range_boxes(whole, piece.box.offsets[0], piece.box.sizes[0])) {
      const std::int64_t start = at_element;
      at_element += b.numel();
      std::vector<std::int64_t> sizes = b.sizes;
      out.push_back({.box = std::move(b), .global_shape = model, .values = [flat, read = piece.values, start, sizes] {
                       if (!flat->defined()) *flat = read().reshape({-1});
                       return flat->narrow(0, start, c10::multiply_integers(sizes)).view(sizes);
                     }});
    }
  }
  return out;
}

// Note [Checking before filling]: the first pass reads only each piece's box
// and global shape and checks every target; only when all fit does the second
// pass read values and copy them in, so a checkpoint of another model leaves
// the model, the optimizer state and the run's position as they were.
void LayoutState::load_pieces(const std::function<const std::vector<Piece>*(const std::string&)>& find,
                              const std::vector<std::string>& saved, const std::string& source) {
  if (known_) {
    for (const std::string& name : saved) {
      DTRAIN_CHECK(known_(name), DataError,
                   "checkpoint (" << source << ") holds " << name << ", which this model does not have.",
                   "resume with the model configuration that saved it");
    }
  }
  bool ok = false;
  begin_load();
  struct End {
    LayoutState* self;
    const bool* ok;
    ~End() { self->end_load(*ok); }
  } end{this, &ok};
  LaidOutTensors targets = expand_flat_ranges(collect_());
  // A target's saved pieces in the model's shape (nullopt: none saved).
  const auto saved_for = [&find](const std::string& name, const LaidOutTensor& t) -> std::optional<std::vector<Piece>> {
    const std::vector<Piece>* pieces = find(name);
    if (pieces == nullptr) return std::nullopt;
    return in_model_shape(*pieces, t.layout.global_shape);
  };
  std::vector<std::string> found;
  for (const auto& [name, t] : targets) {
    const std::optional<std::vector<Piece>> saved_pieces = saved_for(name, t);
    if (!saved_pieces) {
      DTRAIN_CHECK(t.optional, DataError, "the checkpoint has no " << name << " (" << source << ").",
                   "resume with the model and optimizer that saved it");
      continue;
    }
    const dist::Box mine = t.box ? *t.box : t.layout.local_box(t.coordinates);
    DTRAIN_CHECK(t.local.numel() == mine.numel(), ConfigError,
                 "checkpoint: " << name << " holds " << t.local.numel() << " elements, its layout "
                                << t.layout.to_string() << " gives this rank " << mine.numel(),
                 "declare the layout the tensor has");
    const Frame frame = frame_of(name, t, mine, *saved_pieces);
    std::int64_t covered = 0;
    found.push_back(name);
    for (const Piece& piece : *saved_pieces)
      if (const auto overlap = dist::intersect(frame.box_of(piece), frame.mine)) covered += overlap->numel();
    DTRAIN_CHECK(covered == frame.mine.numel(), DataError,
                 "checkpoint: the saved parts of " << name << " cover " << covered << " of the " << frame.mine.numel()
                                                   << " elements this rank needs.",
                 "the checkpoint is incomplete; resume from another one");
  }
  c10::NoGradGuard no_grad;
  for (auto& [name, t] : targets) {
    const std::optional<std::vector<Piece>> saved_pieces = saved_for(name, t);
    if (!saved_pieces) continue;
    const Frame frame = frame_of(name, t, t.box ? *t.box : t.layout.local_box(t.coordinates), *saved_pieces);
    const dist::Box& mine = frame.mine;
    at::Tensor target = t.local.view(mine.sizes);  // local's own storage
    at::Tensor staging = target.device().is_cpu() ? target : at::empty(mine.sizes, target.options().device(at::kCPU));
    for (const Piece& piece : *saved_pieces) {
      const dist::Box box = frame.box_of(piece);
      if (!dist::intersect(box, mine)) continue;
      at::Tensor values = piece.values();
      if (frame.reshape_pieces) values = values.reshape(frame.shape);
      dist::copy_intersection(values.to(staging.scalar_type()), box, staging, mine);
    }
    if (!staging.is_same(target)) target.copy_(staging);
  }
  loaded_ = saved.empty() ? found : saved;
  if (after_load_) after_load_();
  ok = true;
  DTRAIN_LOG(kInfo) << "loaded " << targets.size() << " laid-out tensors (" << source << ")";
}

bool LayoutState::loaded(const std::string& name) const {
  return std::find(loaded_.begin(), loaded_.end(), name) != loaded_.end();
}

namespace {

// One parameter's optimizer state as laid-out tensors; the Adam step as an
// int64 [1] replicated tensor, moved into the state after load. States a load
// creates are recorded, and removed again if that load fails.
struct OptimizerFields {
  torch::optim::Optimizer* optimizer = nullptr;
  std::vector<std::pair<torch::optim::OptimizerParamState*, at::Tensor>> steps;  // of the last collect
  std::vector<void*> created;                                                    // by the load under way

  template <typename State>
  void add_adam(const std::string& name, const at::Tensor& p, const LaidOutTensor& like, bool amsgrad, bool create,
                LaidOutTensors& out) {
    auto& states = optimizer->state();
    auto it = states.find(p.unsafeGetTensorImpl());
    if (it == states.end()) {
      if (!create) return;
      auto s = std::make_unique<State>();
      s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
      s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      if (amsgrad) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      it = states.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
      created.push_back(p.unsafeGetTensorImpl());
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
    // The step is the same on every rank holding a piece: replicated over
    // the parameter's mesh, written once (by the rank at its origin).
    std::vector<dist::Placement> replicate(like.layout.mesh.size(), dist::Placement::replicate());
    out.emplace_back("optimizer." + name + ".step",
                     LaidOutTensor{.local = step,
                                   .layout = {.mesh = like.layout.mesh, .placements = replicate, .global_shape = {1}},
                                   .coordinates = like.coordinates,
                                   .optional = true,
                                   .saved = like.saved &&
                                            (!like.box || like.box->offsets ==
                                                              std::vector<std::int64_t>(like.box->offsets.size(), 0)) &&
                                            (!like.flat_range || like.flat_range->begin == 0)});
  }

  void add(const std::string& name, const at::Tensor& p, const LaidOutTensor& like, bool create, LaidOutTensors& out) {
    if (auto* adamw = dynamic_cast<torch::optim::AdamW*>(optimizer)) {
      const bool amsgrad = static_cast<const torch::optim::AdamWOptions&>(adamw->defaults()).amsgrad();
      add_adam<torch::optim::AdamWParamState>(name, p, like, amsgrad, create, out);
    } else if (auto* adam = dynamic_cast<torch::optim::Adam*>(optimizer)) {
      const bool amsgrad = static_cast<const torch::optim::AdamOptions&>(adam->defaults()).amsgrad();
      add_adam<torch::optim::AdamParamState>(name, p, like, amsgrad, create, out);
    } else if (dynamic_cast<torch::optim::SGD*>(optimizer) != nullptr) {
      auto& states = optimizer->state();
      auto it = states.find(p.unsafeGetTensorImpl());
      if (it == states.end()) {
        if (!create) return;
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
        it = states.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
        created.push_back(p.unsafeGetTensorImpl());
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

// Loading creates the optimizer state a fresh optimizer lacks (and removes
// it again when the load fails); saving writes only what exists.
class ParameterLayoutState : public LayoutState {
 public:
  ParameterLayoutState(std::function<LaidOutTensors()> collect, std::function<void()> after_load,
                       std::shared_ptr<bool> loading, std::shared_ptr<OptimizerFields> fields)
      : LayoutState(std::move(collect), std::move(after_load)),
        loading_(std::move(loading)),
        fields_(std::move(fields)) {}

 protected:
  void begin_load() override {
    *loading_ = true;
    fields_->created.clear();
  }
  void end_load(bool loaded) override {
    *loading_ = false;
    if (!loaded && fields_->optimizer)
      for (void* impl : fields_->created) fields_->optimizer->state().erase(impl);
    fields_->created.clear();
  }

 private:
  std::shared_ptr<bool> loading_;
  std::shared_ptr<OptimizerFields> fields_;
};

}  // namespace

std::shared_ptr<LayoutState> parameter_state(std::function<std::vector<LaidOutParameter>()> parameters,
                                             torch::optim::Optimizer* optimizer, std::vector<std::string> model_names) {
  auto fields = std::make_shared<OptimizerFields>();
  fields->optimizer = optimizer;
  auto loading = std::make_shared<bool>(false);
  auto collect = [parameters = std::move(parameters), fields, loading] {
    LaidOutTensors out;
    fields->steps.clear();
    for (LaidOutParameter& p : parameters()) {
      if (p.buffer) p.tensor.optional = true;
      out.emplace_back("model." + p.name, p.tensor);
      if (fields->optimizer && !p.buffer) fields->add(p.name, p.tensor.local, p.tensor, *loading, out);
    }
    return out;
  };
  auto after_load = [fields] {
    for (auto& [state, step] : fields->steps) {
      if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(state)) adamw->step(step.item<std::int64_t>());
      if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(state)) adam->step(step.item<std::int64_t>());
    }
  };
  auto state = std::make_shared<ParameterLayoutState>(collect, after_load, loading, fields);
  if (!model_names.empty()) state->set_known(known_model_names(model_names));
  return state;
}

std::function<bool(const std::string&)> known_model_names(const std::vector<std::string>& model_names) {
  std::set<std::string> known(model_names.begin(), model_names.end());
  return [known = std::move(known)](const std::string& name) {
    const bool model = name.rfind("model.", 0) == 0, opt = name.rfind("optimizer.", 0) == 0;
    if (model) return known.count(name.substr(6)) > 0;
    if (!opt) return false;
    const std::string rest = name.substr(10);
    const auto dot = rest.rfind('.');
    return dot != std::string::npos && known.count(rest.substr(0, dot)) > 0;
  };
}

std::shared_ptr<LayoutState> layout_state(torch::nn::Module& module, const dist::DeviceMesh& mesh,
                                          torch::optim::Optimizer* optimizer, const std::string& name_prefix) {
  return parameter_state(
      [&module, &mesh, name_prefix] {
        std::vector<LaidOutParameter> out;
        const auto params = module.named_parameters();
        for (const auto& [name, layout] : dist::named_layouts(module, mesh))
          out.push_back({.name = name_prefix + name,
                         .tensor = {.local = params[name], .layout = layout, .coordinates = mesh.coordinates()}});
        return out;
      },
      optimizer,
      [&module, &name_prefix] {
        std::vector<std::string> names;
        for (const auto& item : module.named_parameters()) names.push_back(name_prefix + item.key());
        return names;
      }());
}

}  // namespace dtrain
