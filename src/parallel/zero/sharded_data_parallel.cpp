// ShardedDataParallel: ZeRO stages 1-3 (see include/dtrain/parallel/zero/sharded_data_parallel.h).
//
// Note [ZeRO step]
// ----------------
// Layout. Each unit's parameters are copied into one flat buffer `full`
// (param dtype, world * shard elements, zero padding at the end) and each
// module parameter becomes a view into it (Tensor::set_data keeps the
// parameter's identity, so the module, its autograd leaves and anything
// holding the parameter keep working). Rank r owns elements
// [r * shard, (r + 1) * shard): its `chunk`, fp32. Stages 1-2 without casting
// use a view of `full` as the chunk (no extra memory: the optimizer writes the
// module's parameters directly); otherwise the chunk has its own storage
// (stage 3's shard; the fp32 master under mixed precision).
//
// Stage 3 frees a unit by dropping its storage's bytes (StorageImpl with 0
// bytes; the parameters' metadata stays) and gathers it by giving the storage
// fresh bytes and all-gathering every rank's chunk into them: views, and the
// tensors autograd saved in forward, see the new bytes, as in FSDP1.
//
// Forward (stage 3): the root unit (parameters outside units or shared by two)
// is gathered first and kept until the end of backward (it is used
// everywhere). Before unit u runs we wait for its gather and issue unit u+1's
// (prefetch), after it we free it (reshard_after_forward) and hook its output:
// the hook runs when the output's gradient is ready, i.e. just before unit u's
// backward, gathers u (waiting for the prefetch) and prefetches u-1. A hook on
// u's input tells when u's backward is over on the input path; when that and
// all of u's gradients are in, u is freed again (freeing at the last gradient
// alone could free a frozen parameter an earlier op of u still needs).
//
// Backward (all stages): a post-hook on each trainable parameter's gradient
// accumulator counts the unit's gradients; when all are in, the unit's
// gradients are reduce-scattered (average) into this rank's slice while
// backward goes on: stages 2-3 copy them into a flat buffer and free them;
// stage 1's module gradients already alias one flat buffer per unit (set up
// by a pre-hook before the first accumulation of a backward, zeroed after a
// synchronised step), which is reduced in place and keeps the full gradient
// as its formula says. Reductions are issued in one fixed order (units last
// to first, then the root), so every rank issues the same collectives in the
// same order whatever the order in which gradients arrive; a unit that
// completes early waits for those before it. At the end of backward (an
// engine callback) the units still missing (unused parameters, the root) are
// reduced, all reductions are waited for, and the shards' gradients alias the
// results (or add to gradients kept from an earlier backward).
//
// After the optimizer step: stage 3 has nothing to do (the next gather reads
// the chunks); stages 1-2 all-gather the chunks into `full` at the next
// forward (`dirty_`, set by a synchronising backward, so all ranks agree
// without asking each other), unit by unit with the next one prefetched.
#include "dtrain/parallel/zero/sharded_data_parallel.h"

#include "zero_engine.h"

namespace dtrain {

ShardedDataParallel::ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, dist::ProcessGroup group,
                                         ZeroOptions options)
    : engine_(std::make_unique<detail::ZeroEngine>(std::move(module), std::move(group), std::move(options))) {}

ShardedDataParallel::~ShardedDataParallel() = default;

at::Tensor ShardedDataParallel::forward(const at::Tensor& input) {
  return engine_->forward(input);
}
void ShardedDataParallel::pre_forward() {
  engine_->pre_forward();
  engine_->wait_all_gathered();
}
std::vector<at::Tensor> ShardedDataParallel::parameters() const {
  return engine_->shard_tensors();
}
const std::vector<ParameterShard>& ShardedDataParallel::parameter_shards() const {
  return engine_->shards();
}
const GradientSet& ShardedDataParallel::gradients() const {
  return engine_->gradients();
}
std::vector<std::pair<at::Tensor, dist::Layout>> ShardedDataParallel::norm_layouts(const dist::DeviceMesh& mesh) const {
  return engine_->norm_layouts(mesh);
}
void ShardedDataParallel::zero_grad() {
  engine_->zero_grad();
}
std::map<std::string, at::Tensor> ShardedDataParallel::full_state_dict() {
  return engine_->full_state_dict();
}
ZeroMemoryStats ShardedDataParallel::memory_stats() const {
  return engine_->memory_stats();
}
void ShardedDataParallel::reset_peak() {
  engine_->reset_peak();
}
const ZeroOptions& ShardedDataParallel::options() const {
  return engine_->options();
}
dist::ProcessGroup& ShardedDataParallel::group() {
  return engine_->group();
}
torch::nn::Module& ShardedDataParallel::module() {
  return engine_->module();
}

ShardedDataParallel::NoSync::NoSync(ShardedDataParallel& sdp) : sdp_(&sdp), previous_(sdp.engine_->sync) {
  sdp.engine_->sync = false;
}
ShardedDataParallel::NoSync::~NoSync() {
  sdp_->engine_->sync = previous_;
}

ShardedDataParallel::FullParameters::FullParameters(ShardedDataParallel& sdp) : sdp_(&sdp) {
  ++sdp.engine_->full_parameter_guards;
  sdp.engine_->gather_all();
}
ShardedDataParallel::FullParameters::~FullParameters() {
  if (--sdp_->engine_->full_parameter_guards == 0) sdp_->engine_->release_all();
}

}  // namespace dtrain
