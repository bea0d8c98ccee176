// parallelize: the appliers' table and what they share (see parallelize.h).
#include "dtrain/trainer/parallelize.h"

#include <torch/nn/functional/loss.h>

#include <unordered_set>

#include "appliers.h"
#include "dtrain/error.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace dtrain {

namespace detail {

LayerStackImpl::LayerStackImpl(torch::nn::Sequential layers_in, std::string name,
                               std::function<void(torch::nn::Sequential&)> retie)
    : layers(std::move(layers_in)), name_(std::move(name)), retie_(std::move(retie)) {
  if (!name_.empty()) {
    register_module(name_, layers);
    return;
  }
  for (const auto& child : layers->named_children()) register_module(child.key(), child.value());
}

std::shared_ptr<torch::nn::Module> LayerStackImpl::clone(const std::optional<c10::Device>& device) const {
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(layers->clone(device));
  torch::nn::Sequential copied(copy);
  if (retie_) retie_(copied);
  return std::make_shared<LayerStackImpl>(copied, name_, retie_);
}

ModelLossFn ApplyContext::loss() const {
  if (parts.loss) return parts.loss;
  return
      [](const at::Tensor& out, const at::Tensor& target) { return torch::nn::functional::cross_entropy(out, target); };
}

Parallelized trained_module_is_whole(std::shared_ptr<Strategy> strategy, std::shared_ptr<torch::nn::Module> whole,
                                     std::function<at::Tensor(const at::Tensor&)> forward_whole) {
  Parallelized r;
  r.strategy = strategy;
  r.is_matrix = [](const at::Tensor& p) { return p.dim() >= 2; };
  r.whole = std::move(whole);
  r.forward_whole = std::move(forward_whole);
  r.full_weights = [s = strategy.get()] { return s->full_parameters(); };
  return r;
}

std::function<bool(const at::Tensor&)> shards_of_matrices(const std::vector<ShardedDataParallel*>& sharded) {
  auto matrices = std::make_shared<std::unordered_set<const void*>>();
  for (const ShardedDataParallel* sdp : sharded)
    for (const auto& s : sdp->parameter_shards())
      if (s.parameter.dim() >= 2) matrices->insert(s.shard.unsafeGetTensorImpl());
  return [matrices](const at::Tensor& p) { return matrices->count(p.unsafeGetTensorImpl()) > 0; };
}

std::function<at::Tensor(const at::Tensor&)> forward_on(LayerStack module, c10::Device device) {
  return [module, device](const at::Tensor& x) mutable { return module->forward(x.to(device)); };
}

namespace {

// Tried in this order; the first that handles the plan builds it. An axis
// that composes with the ones below it applies them itself: the pipeline
// cuts the tp/cp split (split_model) into stages with ZeRO or DDP per stage;
// tp and cp wrap their split in ZeRO or DDP.
const Applier kAppliers[] = {
    {"pipeline", [](const ParallelPlan& p) { return p.pp > 1; }, apply_pipeline},
    {"tp", [](const ParallelPlan& p) { return p.tp > 1; }, apply_tp},
    {"cp", [](const ParallelPlan& p) { return p.cp > 1; }, apply_cp},
    {"zero", [](const ParallelPlan& p) { return p.dp_shard > 1 || p.zero_stage > 0; }, apply_zero},
    {"ddp", [](const ParallelPlan& p) { return p.dp_replicate > 1; }, apply_ddp},
    {"local", [](const ParallelPlan&) { return true; }, apply_local},
};

}  // namespace
}  // namespace detail

Parallelized parallelize(const ModelParts& parts, const ParallelPlan& plan, std::optional<dist::ProcessGroup> world,
                         const ParallelizeOptions& options) {
  DTRAIN_CHECK(parts.layers, ConfigError, "parallelize: ModelParts::layers is not set.",
               "give a function that builds the model's layers");
  const int ranks = world ? world->size() : 1;
  DTRAIN_CHECK(plan.world() == ranks, ConfigError,
               "parallelize: the plan's degrees make " << plan.world() << " ranks, but the run has " << ranks << ".",
               "validate the plan for this world (ParallelPlan::validate) and pass the run's group");
  DTRAIN_CHECK(options.local != LocalSplit::kDataParallel || ranks == 1, ConfigError,
               "DataParallel splits one process's batch over its devices; this run has " << ranks << " processes.",
               "use DataParallel in one process, or a plan's dp_replicate across processes");
  const detail::ApplyContext context{.parts = parts, .plan = plan, .world = world, .options = options};
  for (const detail::Applier& a : detail::kAppliers) {
    if (!a.handles(plan)) continue;
    Parallelized r = a.apply(context);
    r.applier = a.name;
    if (!r.loss) r.loss = context.loss();
    return r;
  }
  DTRAIN_INTERNAL_ASSERT(false, "no applier for the plan");
  return {};
}

}  // namespace dtrain
