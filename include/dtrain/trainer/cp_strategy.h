// Context parallelism through the Trainer: a module whose attention runs over
// the mesh's `cp` dimension (nn::cp::causal_attention), every parameter
// replicated, optionally with data-parallel replicas over `dp_replicate`.
//
//   auto mesh = std::make_shared<dist::DeviceMesh>(world, {{"dp_replicate", 2}, {"cp", 2}});
//   gpt::CpGpt model(gpt::apply_cp(layers, (*mesh)["cp"]));  // any cp module
//   auto s = std::make_shared<ContextParallelStrategy<gpt::CpGpt>>(
//       model, mesh, device, [cp = (*mesh)["cp"]](const at::Tensor& t) { return gpt::cp_targets(t, cp); });
//
// Contracts:
//  - the mesh has `cp`, and besides it only `dp_replicate` (tp, ZeRO and
//    pipelines do not compose with it here; ParallelPlan::validate refuses
//    them);
//  - the data rank and world are the dp_replicate coordinate and size: every
//    rank of a cp group reads the same batch, and the module keeps its own
//    rows of each sequence (as gpt::apply_cp's embedding does);
//  - `local_target` cuts the targets alike, for the loss and the accuracy;
//  - the loss's value should be averaged over cp (nn::cp::mean_loss) and its
//    gradient be this rank's own: gradients are then averaged by DDP over
//    dp_replicate x cp (parameters are Replicate on cp), which makes them the
//    whole batch's;
//  - forward and backward are collective over cp, so evaluation runs as many
//    forwards on every rank (collective_forward);
//  - checkpoints are the DDP strategy's (replicated parameters, rank 0 writes).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "dtrain/comm/mesh.h"
#include "dtrain/error.h"
#include "dtrain/trainer/strategy.h"

namespace dtrain {

namespace detail {
inline dist::ProcessGroup checked_cp_group(dist::DeviceMesh& mesh) {
  DTRAIN_CHECK(mesh.has("cp"), ConfigError,
               "ContextParallelStrategy needs a mesh with a cp dimension; this one is " << mesh.describe() << ".",
               "build the mesh with {\"cp\", degree}");
  for (const auto& d : mesh.dims())
    DTRAIN_CHECK(d.name == "cp" || d.name == "dp_replicate", ConfigError,
                 "ContextParallelStrategy composes cp with dp_replicate only; the mesh has " << d.name << ".",
                 "put the data-parallel ranks on dp_replicate (DDP)");
  return mesh.join({"dp_replicate", "dp_shard", "cp"});
}
}  // namespace detail

template <typename Holder>
class ContextParallelStrategy : public DdpStrategy<Holder> {
 public:
  using TargetCut = std::function<at::Tensor(const at::Tensor&)>;
  // `module`: this rank's context-parallel model on `mesh`; `cut`: the rows of
  // a [B, T] target this rank's outputs hold. Collective over the mesh (DDP
  // broadcasts the parameters from its first rank).
  ContextParallelStrategy(Holder module, std::shared_ptr<dist::DeviceMesh> mesh, c10::Device device, TargetCut cut,
                          const DDPOptions& options = {})
      : DdpStrategy<Holder>(std::move(module), detail::checked_cp_group(*mesh), device, device, options),
        mesh_(std::move(mesh)),
        cut_(std::move(cut)) {}
  std::string name() const override { return "cp"; }
  at::Tensor local_target(const at::Tensor& target) override { return cut_(target); }
  bool collective_forward() const override { return true; }
  int data_rank() const override { return mesh_->coordinate("dp_replicate"); }
  int data_world() const override { return mesh_->size("dp_replicate"); }
  dist::DeviceMesh& mesh() { return *mesh_; }

 private:
  std::shared_ptr<dist::DeviceMesh> mesh_;
  TargetCut cut_;
};

}  // namespace dtrain
