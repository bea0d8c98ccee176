// Private to parallel/zero/: the units and the per-step machinery behind
// ShardedDataParallel (see Note [ZeRO step] in sharded_data_parallel.cpp).
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../../core/torch_compat.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"

namespace dtrain::detail {

// Storage helpers (zero_engine.cpp). Stage 3 frees a unit by giving its
// buffer's storage 0 bytes (the tensors over it keep their metadata) and
// gathers it into fresh bytes of the same storage.
void free_storage(const at::Tensor& t);
void allocate_storage(const at::Tensor& t);
std::int64_t storage_bytes(const at::Tensor& t);
// A tensor over `base`'s storage from element `offset`, contiguous, of `sizes`:
// an alias autograd does not know as a view (Optimizer::zero_grad detach_()es
// gradients, which it refuses for views).
at::Tensor alias_of(const at::Tensor& base, std::int64_t offset, at::IntArrayRef sizes);

// A parameter's place in its unit's flat buffer.
struct FlatParam {
  std::string name;
  at::Tensor param;  // the module's parameter (its data: a view into Unit::full)
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;  // in the unit's flat buffer
  std::int64_t numel = 0;
  bool trainable = false;
};

// A sharding unit: parameters flattened into `full` ([world * shard] elements,
// padded), of which this rank owns [rank * shard, (rank + 1) * shard): `chunk`.
struct Unit {
  std::string name;
  std::vector<FlatParam> params;
  std::int64_t numel = 0;  // unpadded
  std::int64_t shard = 0;  // elements per rank (numel / world, rounded up)
  at::Tensor full;         // param dtype; stage 3: storage freed while resharded
  at::Tensor chunk;        // fp32 master or a view of `full` (stages 1-2, no casting)
  bool chunk_is_view = false;
  std::int64_t chunk_version = 0;  // chunk._version() when `full` last matched it
  // pieces of trainable parameters in the chunk: index into ZeroEngine::shards_
  std::vector<std::size_t> pieces;
  std::int64_t trainable = 0;  // parameters expecting a gradient

  // stage 3 gather state
  bool gathered = true;
  bool gathering = false;
  dist::Work gather_work;
  at::Tensor gather_input;  // cast chunk handed to all_gather_into

  // per-backward state
  std::int64_t ready = 0;  // trainable parameters whose gradient has been accumulated
  bool launched = false;
  dist::Work reduce_work;
  dist::Future reduce_done;     // HSDP: completes with reduce_work (polled, Note [HSDP replica all-reduce])
  bool replica_issued = false;  // HSDP: the all-reduce over the replicas is issued (replica_work)
  dist::Work replica_work;
  at::Tensor reduce_input, reduce_output;
  at::Tensor grad_flat;     // stage 1: the full gradient, [world * shard] (module gradients alias it)
  bool input_done = false;  // stage 3: the gradient of the unit's input has been computed
  std::vector<compat::NodePtr> accumulators;
};

class ZeroEngine {
 public:
  ZeroEngine(std::shared_ptr<torch::nn::Module> module, dist::ProcessGroup group, ZeroOptions options);
  ~ZeroEngine();

  at::Tensor forward(const at::Tensor& input);
  void pre_forward();
  void zero_grad();
  void gather_all();  // FullParameters, full_state_dict
  void release_all();
  std::vector<at::Tensor> shard_tensors() const;
  std::map<std::string, at::Tensor> full_state_dict();

  // called from autograd hooks
  void on_grad_ready(std::size_t unit);
  void pre_backward(std::size_t unit);
  void on_input_grad(std::size_t unit);
  void begin_backward_if_needed();
  void wait_all_gathered();
  void finish_backward();

  std::vector<Unit>& units() { return units_; }
  std::vector<ParameterShard>& shards() { return shards_; }
  std::int64_t piece_chunk_offset(std::size_t shard) const { return piece_chunk_offset_[shard]; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  const ZeroOptions& options() const { return options_; }
  dist::ProcessGroup& group() { return group_; }
  // HSDP: ZeroOptions::replicate_group is set and spans several replicas.
  bool replicated() const { return options_.replicate_group && options_.replicate_group->size() > 1; }
  torch::nn::Module& module() { return *module_; }
  const GradientSet& gradients() const { return gradient_set_; }
  std::vector<std::pair<at::Tensor, dist::Layout>> norm_layouts(const dist::DeviceMesh& mesh) const;
  ZeroMemoryStats memory_stats() const;
  void reset_peak() { peak_bytes_ = current_parameter_bytes(); }
  bool sync = true;
  int full_parameter_guards = 0;
  // Stages 1-2: the chunks changed (optimizer step, checkpoint load): all-gather before the next use.
  void mark_dirty() { dirty_ = options_.stage < 3; }

 private:
  void build_units();
  void install_hooks();
  void prepare_gradient_buffers();
  // stage 3
  void issue_gather(std::size_t unit);
  void wait_gathered(std::size_t unit);
  void reshard(std::size_t unit);
  void launch_ready_reductions();
  void launch_reduction(std::size_t unit);
  void complete_reduction(std::size_t unit);
  void issue_finished_replica_reductions();
  std::int64_t current_parameter_bytes() const;
  void note_memory();

  std::shared_ptr<torch::nn::Module> module_;
  torch::nn::Sequential sequential_{nullptr};
  dist::ProcessGroup group_;
  ZeroOptions options_;
  int rank_ = 0;
  int world_ = 1;
  c10::ScalarType param_dtype_ = c10::kFloat;
  c10::ScalarType reduce_dtype_ = c10::kFloat;
  // Where every parameter, and so every flat buffer (gathered units, gradient
  // and reduction buffers), lives: the module's device.
  c10::Device device_ = c10::kCPU;
  std::vector<Unit> units_;         // sequential units in forward order, then the root unit (last)
  std::vector<int> unit_of_child_;  // per child of the Sequential: its unit, or -1
  std::vector<ParameterShard> shards_;
  GradientSet gradient_set_;
  std::vector<std::size_t> order_;                // reduction order: sequential units last to first, then the root
  std::size_t next_reduction_ = 0;                // index into order_
  std::size_t next_replica_ = 0;                  // HSDP: index into order_ of the next replica all-reduce
  std::vector<std::int64_t> piece_chunk_offset_;  // per shard: its first element in the unit's chunk
  bool in_backward_ = false;
  bool dirty_ = false;
  bool grads_consumed_ = false;        // stage 1: the gradient buffers were reduced; restart them at the next backward
  std::shared_ptr<ZeroEngine*> self_;  // hooks hold it; null once this engine is gone
  std::int64_t peak_bytes_ = 0;
};

}  // namespace dtrain::detail
