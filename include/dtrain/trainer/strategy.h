// What the Trainer needs from a parallelism strategy, and the strategies of
// today: one device, DataParallel, ModelParallel, DDP, and the hybrid (DDP
// over each rank's model-parallel split).
//
// A strategy owns the model's placement and its communication: it runs the
// training and evaluation forward, the backward, says when backward must not
// synchronise (accumulation), where gradients live (for clipping by global
// norm), which ranks must agree on skipped steps (GradScaler), which share of
// the data this rank reads, and what goes into a checkpoint. The sharded
// (ZeRO) and pipeline strategies implement the same interface: ZeRO returns
// sharded gradients (GradientSet::sharded), a found-inf group and sharded checkpoint state; a
// pipeline (pipeline_strategy.h), whose loss lives on its last stage, runs
// forward, loss and backward of its micro-batches in forward_backward.
//
// Every strategy is also usable without the Trainer: they are thin, and the
// pieces they call (DistributedDataParallel, DataParallel, no_sync,
// clip_grad_norm_, Checkpointer) are public.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/checkpoint/checkpointer.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/ft/replicas.h"
#include "dtrain/parallel/ddp/ddp.h"

namespace dtrain {

class Tracer;
class LayoutState;
namespace amp {
class GradScaler;
}

class Strategy {
 public:
  // Something that lives for a scope (e.g. DDP's no_sync).
  struct Scope {
    virtual ~Scope() = default;
  };

  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  // The module being trained (train()/eval() modes, its parameters' values).
  virtual torch::nn::Module& module() = 0;
  // The tensors the optimizer steps on: the module's parameters, or this
  // rank's shards of them (ZeRO).
  virtual std::vector<at::Tensor> parameters() { return module().parameters(); }
  // While the returned scope lives, module() holds the full, current
  // parameters (e.g. to read or export them); nullptr when it always does.
  // Collective where parameters are sharded: every rank calls it.
  virtual std::unique_ptr<Scope> full_parameters() { return nullptr; }
  // Where inputs are put and where outputs (and so targets) come out.
  virtual c10::Device input_device() const = 0;
  virtual c10::Device output_device() const = 0;

  // The training forward (through the strategy's communication).
  virtual at::Tensor forward(const at::Tensor& input) = 0;
  // The evaluation forward (no gradients, model in eval mode); default
  // forward(). An undefined result: the outputs are on another rank (a
  // pipeline's last stage), and this rank adds nothing to the metrics.
  virtual at::Tensor eval_forward(const at::Tensor& input) { return forward(input); }
  // The part of a batch's targets that this rank's outputs hold, which the
  // loss and the accuracy compare them with; default all of it, or what
  // cut_targets() set (context parallelism keeps this rank's rows of the
  // sequence).
  virtual at::Tensor local_target(const at::Tensor& target) { return target_cut_ ? target_cut_(target) : target; }
  // For a model that keeps part of every sequence (context parallelism
  // inside tp, ZeRO or pipeline stages: dtrain::parallelize sets it): the
  // rows of a target its outputs hold.
  void cut_targets(std::function<at::Tensor(const at::Tensor&)> cut) { target_cut_ = std::move(cut); }
  // Whether the forward is collective over data-parallel ranks (ZeRO
  // all-gathers parameters in it): evaluation then runs as many forwards on
  // every rank, a rank with fewer batches repeating one it leaves uncounted.
  virtual bool collective_forward() const { return false; }
  // Backward of a (scaled) loss; default loss.backward().
  virtual void backward(const at::Tensor& loss) { loss.backward(); }
  // Strategies that cannot hand the Trainer an output to take the loss of
  // (a pipeline computes it on its last stage) return true and implement
  // forward_backward; the Trainer then calls it once per step instead of
  // forward, loss and backward (and refuses accumulation: the strategy
  // micro-batches itself).
  virtual bool fuses_loss() const { return false; }
  // Whether every training batch must have the same size (a pipeline agrees
  // its shapes once); the Trainer then drops an epoch's last, partial batch.
  virtual bool needs_whole_batches() const { return false; }
  // Forward, loss and backward of `scaler`-scaled loss of one batch; returns
  // the batch's (unscaled, detached) loss on every rank of the strategy.
  virtual at::Tensor forward_backward(const at::Tensor& /*input*/, const at::Tensor& /*target*/,
                                      amp::GradScaler* /*scaler*/) {
    return {};
  }
  // While the returned scope lives, backward does not synchronise gradients
  // (accumulation's first k-1 micro-batches); nullptr when nothing syncs.
  virtual std::unique_ptr<Scope> no_sync() { return nullptr; }
  virtual void zero_grad(torch::optim::Optimizer& optimizer) { optimizer.zero_grad(); }
  // Whether the parameters' gradients may be replaced by other tensors
  // between backward and the optimizer step: nothing of the strategy holds
  // them (DDP's bucket views, ZeRO's shards and a pipeline's copies do) and
  // zero_grad sets them to none. The fault-tolerant step then makes them
  // views of the cross-replica mean (FaultTolerantOptions::gradients_as_buffer_views).
  virtual bool gradients_replaceable() const { return false; }
  // How this rank's gradients combine into the global norm.
  virtual GradientSet gradients() { return GradientSet::replicated(module().parameters()); }
  // Clips by global norm (returns the norm before clipping); strategies with
  // gradient copies outside gradients() (a pipeline's tied weights) scale those too.
  virtual at::Tensor clip_grad_norm(double max_norm) { return clip_grad_norm_(gradients(), max_norm); }
  // Ranks whose GradScaler found-inf flags must be combined (nullopt: the
  // gradients are identical where they are checked, e.g. after DDP's all-reduce).
  virtual std::optional<dist::ProcessGroup> found_inf_group() { return std::nullopt; }

  // The data-parallel position of this rank: which share of each epoch it reads.
  virtual int data_rank() const { return 0; }
  virtual int data_world() const { return 1; }
  // All ranks of the run (checkpoints, evaluation and metric reductions); nullopt: one process.
  virtual std::optional<dist::ProcessGroup> group() { return std::nullopt; }

  // Saves and loads the model and optimizer. By default as a laid-out state
  // (trainer/resharding.h): module()'s parameters and buffers under their
  // names, replicated over group() (its rank 0 writes), with the optimizer's
  // per-parameter state; loads a checkpoint of any plan whose names are
  // module()'s (laid out or ZeRO chunks), and this strategy's model.pt.
  virtual void save(Checkpointer& checkpointer, const TrainingState& state, torch::optim::Optimizer& optimizer);
  virtual std::optional<TrainingState> load(Checkpointer& checkpointer, torch::optim::Optimizer& optimizer);

  // What a fault-tolerant replica group's live recovery copies from the
  // same rank of a live peer group (TrainerOptions::fault_tolerance), with
  // `extra` (the Trainer's scaler and schedule) in the same archive. By
  // default module()'s parameters and buffers and the optimizer's state,
  // which holds for strategies whose module() has the full parameters;
  // ZeRO copies this rank's shards and their optimizer state.
  virtual ft::ReplicaState replica_state(torch::optim::Optimizer& optimizer, ft::ReplicaState extra);

  // Observing communication for the trace timeline (called before the first
  // forward); default: nothing to observe.
  virtual void set_tracer(Tracer* /*tracer*/) {}

 private:
  std::shared_ptr<LayoutState> laid_out_state(torch::optim::Optimizer& optimizer);
  std::function<at::Tensor(const at::Tensor&)> target_cut_;  // cut_targets()
  std::shared_ptr<LayoutState> laid_out_;                    // the default save's state, for laid_out_optimizer_
  const torch::optim::Optimizer* laid_out_optimizer_ = nullptr;
};

// The model on one device (or as it is).
template <typename Holder>
class SingleDeviceStrategy : public Strategy {
 public:
  SingleDeviceStrategy(Holder module, c10::Device device) : module_(std::move(module)), device_(device) {}
  std::string name() const override { return "single"; }
  bool gradients_replaceable() const override { return true; }
  torch::nn::Module& module() override { return *detail::as_module_ptr(module_); }
  c10::Device input_device() const override { return device_; }
  c10::Device output_device() const override { return device_; }
  at::Tensor forward(const at::Tensor& input) override { return module_->forward(input); }

 private:
  Holder module_;
  c10::Device device_;
};

// Any forward with given devices: DataParallel, ModelParallel, or a user's own.
class ForwardStrategy : public Strategy {
 public:
  struct Parts {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    std::function<at::Tensor(const at::Tensor&)> forward;
    c10::Device input_device{c10::kCPU};
    c10::Device output_device{c10::kCPU};
  };
  explicit ForwardStrategy(Parts parts) : parts_(std::move(parts)) {}
  std::string name() const override { return parts_.name; }
  torch::nn::Module& module() override { return *parts_.module; }
  c10::Device input_device() const override { return parts_.input_device; }
  c10::Device output_device() const override { return parts_.output_device; }
  at::Tensor forward(const at::Tensor& input) override { return parts_.forward(input); }

 private:
  Parts parts_;
};

namespace detail {
// Wraps `inner` (null: hooks::all_reduce()) so each bucket's reduction is a
// span in `tracer`'s timeline; the bucket's future completes after the span is
// recorded, so it ends before backward does.
std::shared_ptr<CommHook> traced_hook(std::shared_ptr<CommHook> inner, Tracer* tracer);
}  // namespace detail

// DistributedDataParallel over `module` (a plain module, or a ModelParallel
// split for the hybrid); evaluation bypasses DDP.
template <typename Holder>
class DdpStrategy : public Strategy {
 public:
  DdpStrategy(Holder module, dist::ProcessGroup group, c10::Device input_device, c10::Device output_device,
              const DDPOptions& options = {})
      : module_(module),
        group_(group),
        input_device_(input_device),
        output_device_(output_device),
        hook_(options.comm_hook),
        bucket_views_(options.gradient_as_bucket_view),
        ddp_(std::move(module), std::move(group), options) {}
  std::string name() const override { return "ddp"; }
  torch::nn::Module& module() override { return *detail::as_module_ptr(module_); }
  c10::Device input_device() const override { return input_device_; }
  c10::Device output_device() const override { return output_device_; }
  at::Tensor forward(const at::Tensor& input) override { return ddp_(input); }
  at::Tensor eval_forward(const at::Tensor& input) override { return module_->forward(input); }
  std::unique_ptr<Scope> no_sync() override {
    struct Guard : Scope {
      explicit Guard(DistributedDataParallel<Holder>& ddp) : guard(ddp.no_sync()) {}
      NoSync guard;
    };
    return std::make_unique<Guard>(ddp_);
  }
  // With gradient_as_bucket_view gradients are views of DDP's buckets, which
  // LibTorch optimizers' zero_grad (detach_) must not touch.
  void zero_grad(torch::optim::Optimizer& optimizer) override {
    if (bucket_views_) {
      ddp_.zero_grad();
    } else {
      optimizer.zero_grad();
    }
  }
  int data_rank() const override { return group_.rank(); }
  int data_world() const override { return group_.size(); }
  std::optional<dist::ProcessGroup> group() override { return group_; }
  void set_tracer(Tracer* tracer) override {
    if (tracer != nullptr) ddp_.register_comm_hook(detail::traced_hook(hook_, tracer));
  }
  DistributedDataParallel<Holder>& ddp() { return ddp_; }

 private:
  Holder module_;
  dist::ProcessGroup group_;
  c10::Device input_device_;
  c10::Device output_device_;
  std::shared_ptr<CommHook> hook_;
  bool bucket_views_;
  DistributedDataParallel<Holder> ddp_;
};

}  // namespace dtrain
