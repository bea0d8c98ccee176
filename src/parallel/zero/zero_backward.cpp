// ZeroEngine's backward: gradient buffers, per-unit reduce-scatter as a
// unit's gradients complete, stage 3's gathers before each unit's backward
// (Note [ZeRO step] in sharded_data_parallel.cpp).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

#include "zero_engine.h"

namespace dtrain::detail {

// ---- backward ----

void ZeroEngine::begin_backward_if_needed() {
  if (in_backward_) return;
  in_backward_ = true;
  for (Unit& unit : units_) {
    unit.ready = 0;
    unit.launched = false;
    unit.replica_issued = false;
  }
  next_reduction_ = 0;
  next_replica_ = 0;
  if (options_.stage == 1) prepare_gradient_buffers();
  torch::autograd::Engine::get_default_engine().queue_callback([token = self_] {
    if (*token != nullptr) (*token)->finish_backward();
  });
}

// Stage 1 keeps the full gradient in one flat buffer per unit (the module's
// gradients are aliases into it, so autograd accumulates in place and the
// reduce-scatter reads it without a copy); after a synchronising backward the
// averaged slice of this rank is written back into it and the shards'
// gradients alias that slice. Called before the first gradient of a backward
// is accumulated: the buffer restarts from zero after a synchronised step.
void ZeroEngine::prepare_gradient_buffers() {
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    if (unit.trainable == 0) continue;
    if (!unit.grad_flat.defined()) {
      unit.grad_flat = at::zeros({unit.shard * world_}, at::TensorOptions().dtype(param_dtype_).device(device_));
    } else if (grads_consumed_) {
      for (std::size_t i : unit.pieces) {  // shard gradients kept past the step: detach them from the buffer
        at::Tensor& shard = shards_[i].shard;
        if (shard.grad().defined() && shard.grad().storage().is_alias_of(unit.grad_flat.storage())) {
          shard.mutable_grad() = shard.grad().clone();
        }
      }
      unit.grad_flat.zero_();
    }
    for (FlatParam& fp : unit.params) {
      if (!fp.trainable) continue;
      const at::Tensor& g = fp.param.grad();
      if (g.defined() && g.storage().is_alias_of(unit.grad_flat.storage())) continue;
      at::Tensor alias = alias_of(unit.grad_flat, fp.offset, fp.shape);
      if (g.defined()) alias.copy_(g);
      fp.param.mutable_grad() = alias;
    }
  }
  grads_consumed_ = false;
}

void ZeroEngine::pre_backward(std::size_t u) {
  begin_backward_if_needed();
  wait_gathered(u);
  if (u > 0) issue_gather(u - 1);  // prefetch the unit whose backward comes next
  note_memory();
}

void ZeroEngine::on_input_grad(std::size_t u) {
  Unit& unit = units_[u];
  unit.input_done = true;
  if (unit.ready >= unit.trainable) reshard(u);
}

void ZeroEngine::on_grad_ready(std::size_t u) {
  begin_backward_if_needed();
  Unit& unit = units_[u];
  ++unit.ready;
  if (unit.ready < unit.trainable) return;
  if (unit.input_done && u + 1 < units_.size()) reshard(u);
  launch_ready_reductions();
}

void ZeroEngine::launch_ready_reductions() {
  if (!sync) return;
  issue_finished_replica_reductions();
  while (next_reduction_ < order_.size()) {
    Unit& unit = units_[order_[next_reduction_]];
    if (unit.trainable > 0 && unit.ready < unit.trainable) return;
    if (unit.trainable > 0) launch_reduction(order_[next_reduction_]);
    ++next_reduction_;
  }
}

void ZeroEngine::launch_reduction(std::size_t u) {
  torch::NoGradGuard no_grad;
  Unit& unit = units_[u];
  if (options_.stage == 1 && unit.grad_flat.defined()) {
    unit.reduce_input =
        unit.grad_flat.scalar_type() == reduce_dtype_ ? unit.grad_flat : unit.grad_flat.to(reduce_dtype_);
  } else {
    // Stages 2-3: the gradients move into the reduction's input and the full ones are freed.
    unit.reduce_input = at::empty({unit.shard * world_}, at::TensorOptions().dtype(reduce_dtype_).device(device_));
    unit.reduce_input.narrow(0, unit.numel, unit.shard * world_ - unit.numel).zero_();  // padding
    for (FlatParam& fp : unit.params) {
      at::Tensor range = unit.reduce_input.narrow(0, fp.offset, fp.numel);
      if (!fp.trainable || !fp.param.grad().defined()) {
        range.zero_();
        continue;
      }
      range.copy_(fp.param.grad().reshape(-1));
      fp.param.mutable_grad().reset();
    }
  }
  unit.reduce_output = at::empty({unit.shard}, unit.reduce_input.options());
  unit.reduce_work = group_.reduce_scatter(unit.reduce_output, unit.reduce_input, dist::ReduceOp::kAvg);
  if (replicated()) unit.reduce_done = unit.reduce_work.future();
  unit.launched = true;
}

// Note [HSDP replica all-reduce]
// Under HSDP a unit's reduce-scatter output (the sharding group's average) is
// then averaged over the replicas by an all-reduce on the replicate group.
// That all-reduce can only start once the reduce-scatter is done, and every
// rank of a replicate group must issue them in the same order (the groups'
// reduce-scatters finish in different orders on different ranks, and Gloo
// pairs operations by order). So they are issued in reduction order only:
// while backward runs, each time a unit's gradients complete, the finished
// reduce-scatters at the head of that order get their all-reduce (polled,
// never waited on), which then runs beside the remaining backward; the end
// of backward issues the rest, in the same order, and waits for all.
void ZeroEngine::issue_finished_replica_reductions() {
  if (!replicated()) return;
  while (next_replica_ < next_reduction_) {
    Unit& unit = units_[order_[next_replica_]];
    if (unit.launched && !unit.replica_issued) {
      if (!unit.reduce_done->completed() || unit.reduce_done->hasError())
        return;  // errors surface in complete_reduction's wait
      unit.replica_work = options_.replicate_group->all_reduce(unit.reduce_output, dist::ReduceOp::kAvg);
      unit.replica_issued = true;
    }
    ++next_replica_;
  }
}

void ZeroEngine::complete_reduction(std::size_t u) {
  torch::NoGradGuard no_grad;
  Unit& unit = units_[u];
  unit.reduce_work.wait();
  unit.reduce_input = at::Tensor();
  // HSDP: the sharding group's average, averaged over the replicas (Note
  // [HSDP replica all-reduce]); completions run in reduction order, so every
  // unit before this one has issued its all-reduce.
  if (replicated()) {
    if (!unit.replica_issued) {
      unit.replica_work = options_.replicate_group->all_reduce(unit.reduce_output, dist::ReduceOp::kAvg);
      unit.replica_issued = true;
    }
    unit.replica_work.wait();
    unit.reduce_done.reset();
  }
  // Shard gradients stay in a 16-bit reduce dtype (the ZeRO paper's mixed-
  // precision Adam counts 2 bytes for them; the reduced values are those
  // anyway, and optimizers upcast per operation against the fp32 masters);
  // wider reduce dtypes arrive as the masters' fp32.
  at::Tensor result = unit.reduce_output.element_size() < 4 ? unit.reduce_output : unit.reduce_output.to(c10::kFloat);
  unit.reduce_output = at::Tensor();
  if (options_.stage == 1 && unit.grad_flat.defined() && unit.grad_flat.scalar_type() == result.scalar_type()) {
    // this rank's averaged slice back into the full gradient buffer (see prepare_gradient_buffers)
    unit.grad_flat.narrow(0, rank_ * unit.shard, unit.shard).copy_(result);
    result = unit.grad_flat.narrow(0, rank_ * unit.shard, unit.shard);
  }
  // Shard gradients alias the result (no copy), or accumulate into gradients
  // kept from an earlier backward, as autograd does.
  for (std::size_t i : unit.pieces) {
    at::Tensor& shard = shards_[i].shard;
    if (shard.grad().defined()) {
      shard.mutable_grad().add_(result.narrow(0, piece_chunk_offset_[i], shard.numel()));
    } else {
      shard.mutable_grad() = alias_of(result, piece_chunk_offset_[i], shard.sizes());
    }
  }
  unit.launched = false;
}

void ZeroEngine::finish_backward() {
  in_backward_ = false;
  if (sync) {
    for (; next_reduction_ < order_.size(); ++next_reduction_) {
      const std::size_t u = order_[next_reduction_];
      if (units_[u].trainable > 0) launch_reduction(u);
    }
    for (std::size_t u : order_) {
      if (units_[u].launched) complete_reduction(u);
    }
    dirty_ = options_.stage < 3;
    grads_consumed_ = true;
  }
  for (std::size_t u = 0; u < units_.size(); ++u) reshard(u);
  note_memory();
}

}  // namespace dtrain::detail
