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
// dropped). Clipping is Pipeline::clip_grad_norm_ (tied copies included);
// GradScaler's found-inf is combined over the world. Checkpoints: each rank
// saves its stages and optimizer as its per-rank part (StateScope::kPerRank),
// sharded stages gathered first; a run resumes on the same mesh.
#pragma once

#include <memory>

#include "dtrain/comm/mesh.h"
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

 private:
  void add_to(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer);
  std::shared_ptr<pipeline::Pipeline> pipe_;
  dist::ProcessGroup world_, pipeline_group_;
  int data_rank_ = 0, data_world_ = 1;
  int loss_rank_ = 0;  // the pipeline group's rank of the last stage
  std::shared_ptr<torch::nn::Module> holder_;
  const Checkpointer* added_to_ = nullptr;
};

}  // namespace dtrain
