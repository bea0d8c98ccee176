// DistributedDataParallel's engine: drives c10d's Reducer the way
// torch/nn/parallel/distributed.py does. See docs/ddp.md for the protocol.
#include <ATen/Functions.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <limits>
#include <mutex>
#include <unordered_map>

#include "../comm/c10d_access.h"
#include "comm_hooks.h"
#include "shm_allreduce.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/parallel/ddp.h"
#include "model_check.h"

namespace dtrain::detail {
namespace {

constexpr std::size_t kBroadcastBucketBytes = 250u * 1024 * 1024;

std::int64_t mib_to_bytes(double mib, const char* what) {
  DTRAIN_CHECK(mib > 0 && mib < 1e6, ConfigError, "DDPOptions::" << what << "=" << mib << " is not a positive size.",
               "give the cap in MiB, e.g. 25");
  return static_cast<std::int64_t>(mib * 1024 * 1024);
}

// Shared between an engine and the autograd sinks of its forward passes.
struct SinkState {
  std::weak_ptr<c10d::Reducer> reducer;
  bool static_graph = false;
  bool delay_enqueued = false;
};

// Autograd contexts store IValues only, so sinks find their engine's state
// through this registry by id; a sink outliving its engine finds nothing.
class SinkRegistry {
 public:
  static std::int64_t add(const std::shared_ptr<SinkState>& state) {
    std::lock_guard<std::mutex> lock(mutex());
    const std::int64_t id = next()++;
    states()[id] = state;
    return id;
  }
  static void remove(std::int64_t id) {
    std::lock_guard<std::mutex> lock(mutex());
    states().erase(id);
  }
  static std::shared_ptr<SinkState> find(std::int64_t id) {
    std::lock_guard<std::mutex> lock(mutex());
    auto it = states().find(id);
    return it == states().end() ? nullptr : it->second.lock();
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::int64_t& next() {
    static std::int64_t n = 0;
    return n;
  }
  static std::unordered_map<std::int64_t, std::weak_ptr<SinkState>>& states() {
    static std::unordered_map<std::int64_t, std::weak_ptr<SinkState>> s;
    return s;
  }
};

// Passes forward outputs through an autograd node so that (a) outputs unused
// by the loss get undefined gradients, which the Reducer handles
// (find_unused_parameters), and (b) with static_graph, the first backward
// queues the Reducer's delayed all-reduce to run after all gradients exist.
// torch DDP's _DDPSink.
struct DDPSink : public torch::autograd::Function<DDPSink> {
  // `inputs` is a TensorList: autograd treats only Tensors and TensorLists
  // (not std::vector) as differentiable inputs.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, std::int64_t state_id,
                                                at::TensorList inputs) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["state"] = state_id;
    torch::autograd::variable_list outputs;
    outputs.reserve(inputs.size());
    for (const auto& t : inputs) outputs.push_back(t.clone());
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = SinkRegistry::find(ctx->saved_data["state"].toInt());
    if (state && state->static_graph && !state->delay_enqueued) {
      if (auto reducer = state->reducer.lock()) {
        torch::autograd::Engine::get_default_engine().queue_callback([reducer] { reducer->delay_all_reduce(); });
        state->delay_enqueued = true;
      }
    }
    torch::autograd::variable_list out;
    out.reserve(grads.size() + 1);
    out.emplace_back();  // for `state_id`
    for (auto& g : grads) out.push_back(g);
    return out;
  }
};

}  // namespace

struct DDPEngine::State {
  std::shared_ptr<torch::nn::Module> module;
  dist::ProcessGroup group;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  DDPOptions options;
  c10::Device device{c10::kCPU};
  std::vector<at::Tensor> params;
  std::vector<std::string> param_names;
  std::vector<const void*> param_storage;  // data pointers at construction; see check_storage
  std::vector<at::Tensor> buffers;
  std::shared_ptr<c10d::Reducer> reducer;
  std::shared_ptr<c10d::Logger> logger;
  std::shared_ptr<SinkState> sink;
  std::int64_t sink_id = -1;
  bool require_backward_grad_sync = true;
  bool require_forward_param_sync = true;
  bool divide_by_initial_world_size = true;
  bool comm_hook_set = false;
  bool shared_memory = false;  // buckets are all-reduced through shared memory (see shm_allreduce.h)
  std::unique_ptr<SharedMemoryAllReduce> pending_shm;

  void use_shared_memory_if_pending() {
    if (!pending_shm || comm_hook_set) return;
    reducer->register_comm_hook(make_shared_memory_hook(std::move(pending_shm), group.size()));
    shared_memory = true;
    comm_hook_set = true;
  }
  bool forward_ran = false;

  void broadcast(std::vector<at::Tensor> tensors, int root) {
    if (tensors.empty() || group.size() == 1) return;
    torch::NoGradGuard no_grad;
    c10d::broadcast_coalesced(pg, tensors, kBroadcastBucketBytes, root);
  }

  bool will_sync_buffers() const {
    return require_forward_param_sync && options.broadcast_buffers && !buffers.empty() && group.size() > 1;
  }

  // The largest rank for which `candidate` holds (Join's authoritative copy).
  int find_common_rank(bool candidate) {
    at::Tensor rank = at::tensor({candidate ? group.rank() : -1}, at::TensorOptions().dtype(at::kInt).device(device));
    group.all_reduce(rank, dist::ReduceOp::kMax).wait();
    const int result = rank.item<int>();
    DTRAIN_INTERNAL_ASSERT(result >= 0, "no rank is a candidate for the common rank");
    return result;
  }

  // torch DDP's _check_global_requires_backward_grad_sync.
  bool global_requires_sync(bool joined) {
    at::Tensor flag =
        at::full({1}, !joined && require_backward_grad_sync ? 1.0 : 0.0, at::TensorOptions().device(device));
    auto work = group.all_reduce(flag);
    if (!joined) return false;  // non-joined ranks only fire the matching collective
    work.wait();
    return flag.item<double>() != 0.0;
  }
};

DDPEngine::DDPEngine(std::shared_ptr<torch::nn::Module> module, dist::ProcessGroup group, const DDPOptions& options)
    : state_(std::make_unique<State>(State{.module = std::move(module), .group = std::move(group)})) {
  auto& s = *state_;
  s.options = options;
  s.pg = dist::c10d_process_group(s.group);
  const std::int64_t bucket_bytes = mib_to_bytes(options.bucket_cap_mb, "bucket_cap_mb");
  const std::int64_t first_bucket_bytes = mib_to_bytes(options.first_bucket_cap_mb, "first_bucket_cap_mb");

  std::vector<NamedTensor> described;
  std::unordered_map<std::size_t, std::string> names;
  for (const auto& item : s.module->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    names[s.params.size()] = item.key();
    s.param_names.push_back(item.key());
    s.params.push_back(item.value());
    described.push_back({"parameter", item.key(), item.value()});
  }
  for (const auto& item : s.module->named_buffers()) {
    s.buffers.push_back(item.value());
    described.push_back({"buffer", item.key(), item.value()});
  }
  DTRAIN_CHECK(!s.params.empty(), ConfigError,
               "DistributedDataParallel got a module with no parameters that require gradients.",
               "wrap a module with trainable parameters");
  s.device = s.params.front().device();
  check_same_model_across_ranks(s.group, described);

  // Start from rank 0's replica.
  std::vector<at::Tensor> state_tensors = s.params;
  state_tensors.insert(state_tensors.end(), s.buffers.begin(), s.buffers.end());
  s.broadcast(state_tensors, 0);
  for (const auto& p : s.params) s.param_storage.push_back(p.data_ptr());

  // See Note [First-iteration buckets] in docs/ddp.md: without unused
  // parameters the first iteration uses one bucket, then buckets are rebuilt
  // in the order gradients actually became ready.
  std::vector<std::size_t> limits;
  if (options.static_graph || !options.find_unused_parameters) {
    limits = {std::numeric_limits<std::size_t>::max()};
  } else if (first_bucket_bytes < bucket_bytes) {
    limits = {static_cast<std::size_t>(first_bucket_bytes), static_cast<std::size_t>(bucket_bytes)};
  } else {
    limits = {static_cast<std::size_t>(bucket_bytes)};
  }
  auto [bucket_indices, per_bucket_limits] =
      c10d::compute_bucket_assignment_by_size(s.params, limits, std::vector<bool>(s.params.size(), false));
  std::reverse(bucket_indices.begin(), bucket_indices.end());

  s.reducer = std::make_shared<c10d::Reducer>(
      s.params, std::move(bucket_indices), s.pg, std::vector<bool>(s.params.size(), false), bucket_bytes,
      options.find_unused_parameters, options.gradient_as_bucket_view, std::move(names), first_bucket_bytes,
      /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
      /*bucket_bytes_cap_list=*/std::vector<std::int64_t>{});
  s.logger = std::make_shared<c10d::Logger>(s.reducer);
  s.reducer->set_logger(s.logger);
  s.logger->set_construction_data_and_log("dtrain::DistributedDataParallel", {}, -1, options.broadcast_buffers,
                                          /*has_sync_bn=*/false, options.static_graph);
  if (options.static_graph) s.reducer->set_static_graph();
  s.sink = std::make_shared<SinkState>(SinkState{.reducer = s.reducer, .static_graph = options.static_graph});
  s.sink_id = SinkRegistry::add(s.sink);
  if (options.comm_hook.kind != CommHookKind::kAllReduce) {
    set_comm_hook(options.comm_hook);
  } else if (options.intra_host_shared_memory && s.device.is_cpu()) {
    // Made here, where every rank takes part (create() is collective); the
    // hook is registered at the first forward or join, unless the user
    // registered a hook of their own by then (c10d takes one hook only).
    s.pending_shm = SharedMemoryAllReduce::create(s.group, s.group.timeout());
  }
}

DDPEngine::~DDPEngine() {
  SinkRegistry::remove(state_->sink_id);
}

void DDPEngine::pre_forward() {
  auto& s = *state_;
  s.use_shared_memory_if_pending();
  s.forward_ran = true;
  // A parameter whose storage was swapped (Module::load does set_ on each
  // parameter) silently stops being averaged: ranks would drift apart.
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    DTRAIN_CHECK(s.params[i].data_ptr() == s.param_storage[i], ConfigError,
                 "parameter '" << s.param_names[i]
                               << "' got new storage after DistributedDataParallel wrapped the module (for example "
                                  "from torch::nn::Module::load, which set_()s every parameter); its gradients would "
                                  "no longer be averaged across ranks.",
                 "load weights before wrapping, or copy into the parameters in place (param.copy_(value) under "
                 "NoGradGuard), as dtrain::Checkpointer does");
  }
  const bool grad = at::GradMode::is_enabled();
  if (grad && s.require_backward_grad_sync) s.reducer->prepare_for_forward();

  if (auto work = notify_join_context(); work.impl()) {
    s.reducer->set_forward_pass_work_handle(dist::c10d_work(work), s.divide_by_initial_world_size);
  }
  if (grad && s.reducer->rebuild_buckets()) {
    DTRAIN_LOG(kDebug) << "DDP gradient buckets rebuilt in backward order";
  }
  if (s.will_sync_buffers()) {
    const int root = join_config().enable ? s.find_common_rank(true) : 0;
    s.broadcast(s.buffers, root);
  }
  if (join_config().enable) s.global_requires_sync(/*joined=*/false);
}

std::vector<at::Tensor> DDPEngine::post_forward(std::vector<at::Tensor> outputs) {
  auto& s = *state_;
  if (at::GradMode::is_enabled() && s.require_backward_grad_sync) {
    s.require_forward_param_sync = true;
    if (s.options.find_unused_parameters && !s.options.static_graph) {
      s.reducer->prepare_for_backward(outputs);
    } else {
      s.reducer->prepare_for_backward({});
    }
  } else {
    s.require_forward_param_sync = false;
  }
  const bool sink = (s.options.find_unused_parameters && !s.options.static_graph) ||
                    (s.options.static_graph && !s.sink->delay_enqueued);
  if (!sink) return outputs;
  // Only outputs with a gradient history pass through the sink.
  std::vector<std::size_t> positions;
  torch::autograd::variable_list through;
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad()) {
      positions.push_back(i);
      through.push_back(outputs[i]);
    }
  }
  if (through.empty()) return outputs;
  auto passed = DDPSink::apply(s.sink_id, at::TensorList(through));
  for (std::size_t k = 0; k < positions.size(); ++k) outputs[positions[k]] = passed[k];
  return outputs;
}

bool DDPEngine::require_backward_grad_sync() const {
  return state_->require_backward_grad_sync;
}
void DDPEngine::set_require_backward_grad_sync(bool sync) {
  state_->require_backward_grad_sync = sync;
}
const DDPOptions& DDPEngine::options() const {
  return state_->options;
}

void DDPEngine::zero_grad(bool set_to_none) {
  for (auto& p : state_->params) {
    at::Tensor& grad = p.mutable_grad();
    if (!grad.defined()) continue;
    if (set_to_none) {
      grad = at::Tensor();
    } else {
      // In place: with gradient_as_bucket_view the gradient is a view of a
      // communication bucket and must stay one (no detach_, unlike torch::optim).
      grad.requires_grad_(false);
      grad.zero_();
    }
  }
}

void DDPEngine::set_comm_hook(const CommHook& hook) {
  auto& s = *state_;
  DTRAIN_CHECK(!s.forward_ran, ConfigError, "a DDP communication hook must be set before the first forward.",
               "register the hook right after constructing DistributedDataParallel, on every rank");
  DTRAIN_CHECK(!s.comm_hook_set, ConfigError, "this DDP already has a communication hook.",
               "register one hook per DistributedDataParallel");
  switch (hook.kind) {
    case CommHookKind::kAllReduce: return;
    case CommHookKind::kFp16: s.reducer->register_builtin_comm_hook(c10d::BuiltinCommHookType::FP16_COMPRESS); break;
    case CommHookKind::kBf16: s.reducer->register_comm_hook(make_bf16_hook(s.pg)); break;
    case CommHookKind::kPowerSgd: s.reducer->register_comm_hook(make_powersgd_hook(s.pg, hook.powersgd)); break;
  }
  s.options.comm_hook = hook;
  s.comm_hook_set = true;
  s.pending_shm.reset();
}

bool DDPEngine::uses_shared_memory() const {
  return state_->shared_memory;
}

std::vector<std::size_t> DDPEngine::bucket_sizes() const {
  std::vector<std::size_t> sizes;
  for (const auto& bucket : state_->reducer->get_grad_buckets(/*return_zero_tensors=*/true)) {
    sizes.push_back(static_cast<std::size_t>(bucket.getBuffer().nbytes()));
  }
  return sizes;
}

// ---- Join ----

void DDPEngine::join_main_hook() {
  auto& s = *state_;
  s.use_shared_memory_if_pending();
  s.reducer->rebuild_buckets();
  if (s.will_sync_buffers()) s.broadcast(s.buffers, s.find_common_rank(false));
  const bool sync = s.global_requires_sync(/*joined=*/true);
  s.require_forward_param_sync = sync;
  if (!sync) return;
  // Match each bucket's all-reduce in the order the Reducer issues them,
  // contributing zeros.
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> pending;
  for (auto& bucket : s.reducer->get_grad_buckets(/*return_zero_tensors=*/true)) {
    pending.push_back(s.reducer->run_comm_hook(bucket));
  }
  for (auto& f : pending) f->wait();
  if (s.options.find_unused_parameters) {
    at::Tensor used = s.reducer->get_local_used_map_on_device();
    s.group.all_reduce(used).wait();
  }
  s.reducer->push_rebuilt_params_for_all_indices();
}

void DDPEngine::join_post_hook(bool is_last_joiner) {
  auto& s = *state_;
  const int root = s.find_common_rank(is_last_joiner);
  std::vector<at::Tensor> tensors = s.params;
  if (s.options.broadcast_buffers) tensors.insert(tensors.end(), s.buffers.begin(), s.buffers.end());
  s.broadcast(tensors, root);
}

dist::ProcessGroup& DDPEngine::join_group() {
  return state_->group;
}
c10::Device DDPEngine::join_device() const {
  return state_->device;
}
void DDPEngine::set_divide_by_initial_world_size(bool divide) {
  state_->divide_by_initial_world_size = divide;
}

}  // namespace dtrain::detail
