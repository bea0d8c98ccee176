// The Trainer's strategy for pipeline parallelism, on a data x pipeline mesh:
//
//   dtrain::dist::DeviceMesh mesh(world, {{"pp", 2}, {"dp_replicate", 2}});
//   auto pipe = std::make_shared<dtrain::pipeline::Pipeline>(my_stages, mesh["pp"],
//       dtrain::pipeline::PipelineOptions{.micro_batches = 4,
//                                         .data_parallel_group = mesh.join({"dp_replicate", "dp_shard"})},
//       loss_fn);
//   auto strategy = std::make_shared<dtrain::PipelineStrategy>(pipe, mesh);
//   torch::optim::AdamW opt(strategy->parameters(), 1e-3);
//   dtrain::Trainer trainer(strategy, opt, data, {.batch_size = 64, .accumulate = 1});
//   trainer.set_loss(loss_fn);   // the same loss, for evaluation on the last stage
//
// Every rank of a pipeline reads the same batches (its replica's share: the
// mesh's data index; an epoch's last, partial batch is dropped, since the
// pipeline's shapes are fixed); the first stage uses the inputs, the last the targets.
// One Trainer step is one Pipeline::step (its micro-batches are the
// accumulation, so TrainerOptions::accumulate must be 1); the loss is
// broadcast from the last stage over the pipeline, so every rank reports it.
// Evaluation runs the pipeline forward and counts on the last stage's rank
// (a batch not divisible into the micro-batches is padded and the padding
// dropped). Stages of a tp/cp split (dtrain::parallelize) run on the mesh:
// the targets reach the last stage through local_target (cut_targets: this
// rank's rows under cp), and cp ranks are replicas of the stages'
// parameters. Clipping is Pipeline::clip_grad_norm_ (tied copies included);
// GradScaler's found-inf is combined over the world. Checkpoints: laid out
// (trainer/resharding.h), each stage's parameters and optimizer state under
// the whole model's names (name_parameters), written by the first replica of
// the stage, so a run resumes under any plan (another cut, pp or dp width,
// one process, ZeRO, HSDP) and any plan's checkpoint resumes here. Stages
// of tp parts write each tp rank's part with its tp placement (the layouts
// given to name_parameters), so they reshard to other tp degrees and plans
// as TensorParallelStrategy's do; ZeRO stages of tp parts write each
// piece as the flat range of its tp part (Note [ZeRO pieces of tp parts]).
// Sharded
// (ZeRO 1-3) stages save each rank's pieces of their parameters and
// optimizer state, laid out under the same names (every data rank writes
// its own), and load through their whole state, so they reshard the same
// way; their checkpoints from before (per-rank parts) resume on the same
// mesh.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/checkpoint/layout_state.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/trainer/strategy.h"

namespace dtrain {

namespace pipeline {
class Pipeline;
}

class PipelineStrategy : public Strategy {
 public:
  // `mesh` is the one `pipe` was built on (its pipeline and data groups).
  PipelineStrategy(std::shared_ptr<pipeline::Pipeline> pipe, dist::DeviceMesh& mesh);
  ~PipelineStrategy() override;

  std::string name() const override;
  torch::nn::Module& module() override;
  std::vector<at::Tensor> parameters() override;
  std::unique_ptr<Scope> full_parameters() override;
  c10::Device input_device() const override;
  c10::Device output_device() const override;
  at::Tensor forward(const at::Tensor& input) override;
  at::Tensor eval_forward(const at::Tensor& input) override;
  // With sharded stages: their forward all-gathers over the data group.
  bool collective_forward() const override;
  bool fuses_loss() const override { return true; }
  bool needs_whole_batches() const override { return true; }
  at::Tensor forward_backward(const at::Tensor& input, const at::Tensor& target, amp::GradScaler* scaler) override;
  void zero_grad(torch::optim::Optimizer& optimizer) override;
  GradientSet gradients() override;
  at::Tensor clip_grad_norm(double max_norm) override;
  std::optional<dist::ProcessGroup> found_inf_group() override { return world_; }
  int data_rank() const override { return data_rank_; }
  int data_world() const override { return data_world_; }
  std::optional<dist::ProcessGroup> group() override { return world_; }
  void save(Checkpointer& checkpointer, const TrainingState& state, torch::optim::Optimizer& optimizer) override;
  std::optional<TrainingState> load(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer) override;

  pipeline::Pipeline& pipe() { return *pipe_; }
  // Names this rank's stage parameters (and buffers, and borrowed tied
  // copies) in checkpoints by their names in `whole`, the unsplit model whose
  // modules the stages share (`prefix` before each: "layers." for a model that
  // holds them as "layers"). Without it they are "stage<s>.<name in the
  // stage>", which resume only under the same cut. Call before the first
  // save or load; `whole` is read here only. Stages of tp parts: `whole` is
  // the tp split whose layers the stages are, and `layouts` its
  // dist::named_layouts (taken before other stages' parameters were
  // released); each parameter is saved and loaded as its tp part of the
  // global tensor.
  void name_parameters(const torch::nn::Module& whole, const std::string& prefix = "",
                       const dist::NamedLayouts* layouts = nullptr);

 private:
  std::vector<LaidOutParameter> laid_out_parameters();
  std::shared_ptr<LayoutState> laid_out_state(torch::optim::Optimizer& optimizer);
  std::shared_ptr<LayoutState> sharded_reader(torch::optim::Optimizer& optimizer);
  void check_checkpointable() const;
  // This tp rank's part of `parameter` holding `local`, over {copies, tp}
  // (its tp placement, Replicate for what tp does not split; rank `copy` of
  // the `copies` ranks holding the same piece).
  LaidOutTensor tp_part(const at::Tensor& parameter, at::Tensor local, int copy = 0, int copies = 1) const;
  std::string global_name(const at::Tensor& t, const std::string& local) const;
  std::shared_ptr<pipeline::Pipeline> pipe_;
  dist::ProcessGroup world_, pipeline_group_;
  int data_rank_ = 0, data_world_ = 1;
  int replica_ = 0, replicas_ = 1;  // over dp_replicate x dp_shard x cp: the stages' copies
  bool tensor_parallel_ = false;    // stages of tp parts
  int tp_rank_ = 0, tp_size_ = 1;
  std::map<const void*, dist::Layout> tp_layouts_;  // by TensorImpl, over {replicas, tp}: name_parameters
  int loss_rank_ = 0;                               // the pipeline group's rank of the last stage
  std::shared_ptr<torch::nn::Module> holder_;
  std::map<const void*, std::string> global_names_;  // by TensorImpl, from name_parameters
  std::vector<std::string> whole_names_;
  std::shared_ptr<LayoutState> laid_out_;
};

}  // namespace dtrain
