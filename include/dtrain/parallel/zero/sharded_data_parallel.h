// Sharded data parallelism: ZeRO stages 1-3 (FSDP-style) over LibTorch modules.
//
// Like DDP every rank trains the whole model on its own batch, but the
// optimizer state (stage 1), the gradients (stage 2) and the parameters
// (stage 3) are split over the ranks, so per-rank memory falls with the
// number of ranks (see docs/zero.md for the formulas and measurements).
//
//   auto world = dtrain::dist::init_process_group();
//   dtrain::ShardedDataParallel sdp(model.ptr(), world, {.stage = 3, .sequential = "layers"});
//   torch::optim::AdamW opt(sdp.parameters(), 1e-3);   // this rank's shards only
//   for (...) { opt.zero_grad(); loss_fn(sdp(x), y).backward(); opt.step(); }
//
// Sharding units: the model's parameters are grouped into units (by default
// each child of the Sequential that forward runs, e.g. each transformer
// block; or those chosen by ZeroOptions::unit_policy). Parameters in no unit,
// or registered in two units (a shared parameter), form the root unit. Each
// unit's parameters are flattened into one buffer padded to N equal slices;
// rank r owns slice r (its "chunk") and the optimizer steps on the pieces of
// the chunk that belong to trainable parameters (parameters()).
//
// One step, per stage (Note [ZeRO step] in src/parallel/zero/sharded_data_parallel.cpp):
//  - forward: stage 3 all-gathers a unit just before it runs (the next unit's
//    gather prefetched) and frees it after (reshard_after_forward); stages 1-2
//    keep full parameters and all-gather the updated chunks once, before the
//    first forward after an optimizer step changed them.
//  - backward: as soon as every gradient of a unit has been accumulated, the
//    unit's gradients are reduce-scattered (averaged) into this rank's chunk,
//    overlapping the rest of backward; stages 2-3 free the full gradients
//    then, stage 1 keeps them (its formula's full gradient). Stage 3
//    all-gathers each unit again before its backward (next one prefetched)
//    and frees it after.
//  - step: the optimizer updates this rank's chunk only.
//
// Forward runs the Sequential at ZeroOptions::sequential (in the root module)
// child by child: LibTorch modules have no forward hooks, so this is where the
// strategy sees unit boundaries. Stages 1-2 also work for any module:
// call pre_forward() and then the module's own forward.
//
// Contracts: every rank builds the same model (rank 0's parameters are
// broadcast at construction); all ranks run the same forwards and backwards;
// the module's parameters must not be replaced (their storage is managed
// here: views into the unit buffers; stage 3 frees them between uses).
// Buffers (e.g. BatchNorm statistics) are not synchronised.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/dist/layout.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtrain {

// Mixed precision (FSDP2's MixedPrecisionPolicy): full parameters are kept
// and computed in param_dtype, gradients are reduced in reduce_dtype, and the
// chunks the optimizer steps on stay fp32 (master weights).
struct MixedPrecisionPolicy {
  std::optional<c10::ScalarType> param_dtype;   // unset: the parameters' own (no casting)
  std::optional<c10::ScalarType> reduce_dtype;  // unset: param_dtype
};

struct ZeroOptions {
  int stage = 3;  // 1: optimizer state sharded; 2: + gradients; 3: + parameters
  // Name (in the root module) of the Sequential forward() runs child by child;
  // empty: the root itself, which must then be a Sequential.
  std::string sequential;
  // Which children of that Sequential are units, by qualified name (e.g.
  // "layers.block0"). Unset: every child. Others' parameters go to the root unit.
  std::function<bool(const std::string& name, const torch::nn::Module& module)> unit_policy;
  // Stage 3: free a unit's full parameters after its forward (all-gather again
  // for backward). False keeps them from forward to backward: less
  // communication, the whole model's parameters at the peak.
  bool reshard_after_forward = true;
  MixedPrecisionPolicy mixed_precision;
  // HSDP (the mesh's dp_replicate): the ranks holding this rank's shard in the
  // other replicas of the sharding group. Each unit's gradient, once
  // reduce-scattered over the sharding group, is averaged over these ranks too,
  // so every replica steps on the same shard; replicas start from replica 0's
  // parameters. Unset: one replica. Sharded checkpoints refuse it (not yet
  // written once per shard).
  std::optional<dist::ProcessGroup> replicate_group;
  // The mesh the module's parameters are laid out over, for a module whose
  // parameters are not all replicated (tensor-parallel layers, whose
  // dist::Layouts say Shard on tp). `group` must then be
  // mesh.join(shard_dims): the units flatten this rank's tp-local parameters
  // as they are and reduce over the sharding group only (the tp layers' own
  // communication makes each tp rank's gradient of its part complete), and
  // gradients() combines partial norms over the sharding group and over
  // every dimension sharding some parameter (GradientSet::from_layouts on
  // norm_layouts()). Unset: every parameter is replicated outside the
  // sharding group (GradientSet::sharded over it).
  std::optional<dist::DeviceMesh> mesh;
  // The mesh dimensions the sharding group spans (with `mesh`, and for
  // norm_layouts()): dp_shard, or dp_shard and cp for context-parallel ranks,
  // whose gradients (parameters Replicate on cp) ZeRO then averages too.
  std::vector<std::string> shard_dims = {"dp_shard"};
};

// One trainable parameter's piece in this rank's chunk.
struct ParameterShard {
  std::string name;         // the parameter's name in the root module
  at::Tensor parameter;     // the module's (full) parameter
  at::Tensor shard;         // 1-D piece the optimizer steps on (fp32 master under mixed precision)
  std::int64_t offset = 0;  // first element of the parameter (flattened) the piece holds
};

// Bytes of parameter storage this rank holds (full unit buffers while
// gathered, chunks, gather staging), read from the storages themselves.
struct ZeroMemoryStats {
  std::int64_t parameter_bytes = 0;
  std::int64_t peak_parameter_bytes = 0;  // since construction or reset_peak()
};

namespace detail {
class ZeroEngine;
}

class ShardedDataParallel {
 public:
  ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, dist::ProcessGroup group, ZeroOptions options = {});
  template <typename Holder>
  requires requires(const Holder& h) { h.ptr(); }
  ShardedDataParallel(const Holder& module, dist::ProcessGroup group, ZeroOptions options = {})
      : ShardedDataParallel(module.ptr(), std::move(group), std::move(options)) {}
  ~ShardedDataParallel();
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

  // Runs the Sequential (see ZeroOptions::sequential) on `input`.
  at::Tensor forward(const at::Tensor& input);
  at::Tensor operator()(const at::Tensor& input) { return forward(input); }
  // For a module run by its own forward (stages 1-2): brings the full
  // parameters up to date after an optimizer step. forward() calls it.
  void pre_forward();

  // The tensors the optimizer steps on: this rank's pieces of trainable parameters.
  std::vector<at::Tensor> parameters() const;
  const std::vector<ParameterShard>& parameter_shards() const;
  // Global-norm clipping over the shards: clip_grad_norm_(sdp.gradients(), 1.0).
  const GradientSet& gradients() const;
  // Each of parameters() with its parameter's layout over `mesh`
  // (dist::named_layouts of the module) with the placements on the sharding
  // group's dimensions (ZeroOptions::shard_dims) made Shard(0), since the
  // pieces are disjoint over that group: what GradientSet::from_layouts needs
  // for global norms (a pipeline's over all its stages). Not for resharding
  // (the global shape stays the parameter's). ConfigError unless the group
  // is mesh.join(shard_dims) (its size and this rank's index there).
  std::vector<std::pair<at::Tensor, dist::Layout>> norm_layouts(const dist::DeviceMesh& mesh) const;
  // Clears the shards' gradients and any full gradients kept (stage 1, no_sync).
  void zero_grad();

  // Gradient accumulation: backward under no_sync() only accumulates full,
  // unsharded gradients (memory: one full gradient per rank, as DDP); the
  // first backward after it reduce-scatters the sum.
  class NoSync {
   public:
    explicit NoSync(ShardedDataParallel& sdp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    ShardedDataParallel* sdp_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // The full, unsharded parameters by name on every rank (fp32 CPU copies):
  // the consolidated state dict, e.g. for inference. Collective.
  std::map<std::string, at::Tensor> full_state_dict();
  // Stage 3: gathers every unit and keeps it until the guard ends (e.g. for
  // evaluation through the module's own forward or for reading weights).
  // Collective; no-op for stages 1-2 beyond pre_forward().
  class FullParameters {
   public:
    explicit FullParameters(ShardedDataParallel& sdp);
    ~FullParameters();
    FullParameters(const FullParameters&) = delete;
    FullParameters& operator=(const FullParameters&) = delete;

   private:
    ShardedDataParallel* sdp_;
  };
  [[nodiscard]] FullParameters full_parameters() { return FullParameters(*this); }

  ZeroMemoryStats memory_stats() const;
  void reset_peak();

  const ZeroOptions& options() const;
  dist::ProcessGroup& group();
  torch::nn::Module& module();
  detail::ZeroEngine& engine() { return *engine_; }

 private:
  std::unique_ptr<detail::ZeroEngine> engine_;
};

}  // namespace dtrain
