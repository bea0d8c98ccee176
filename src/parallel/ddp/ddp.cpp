// DistributedDataParallel's engine: drives c10d's Reducer the way
// torch/nn/parallel/distributed.py does. See docs/ddp.md for the protocol.
#include <ATen/Functions.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <limits>
#include <mutex>
#include <unordered_map>

#include "../../comm/reducer_group.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "model_check.h"

namespace dtrain::detail {
namespace {

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
                                                 const torch::autograd::variable_list& grads) {
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

// The Reducer's hook slot, filled with a dtrain::CommHook.
class HookAdapter : public c10d::CommHookInterface {
 public:
  HookAdapter(std::shared_ptr<CommHook> hook, dist::ProcessGroup group)
      : hook_(std::move(hook)), group_(std::move(group)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& b) override {
    GradBucket bucket{.index = b.getIndex(),
                      .is_last = b.isLast(),
                      .buffer = b.getBufferRef(),
                      .gradients = b.getGradients(),
                      .parameters = b.getParameters()};
    auto future = hook_->run(group_, bucket);
    DTRAIN_CHECK(future, ConfigError, "a DDP communication hook returned no future for bucket " << bucket.index << ".",
                 "return the future of the bucket's reduction, e.g. group.all_reduce(bucket.buffer).future()");
    return future;
  }
  at::Tensor parseHookResult(const c10::IValue& result) override {
    DTRAIN_CHECK(result.isTensor(), ConfigError,
                 "a DDP communication hook's future completed with a " << result.tagKind() << ", not a tensor.",
                 "complete it with the reduced bucket buffer");
    return result.toTensor();
  }

 private:
  std::shared_ptr<CommHook> hook_;
  dist::ProcessGroup group_;
};

}  // namespace

struct DDPEngine::State {
  std::shared_ptr<torch::nn::Module> module;
  dist::ProcessGroup group;
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
  std::shared_ptr<CommHook> hook;  // installed at the first forward or join
  bool hook_installed = false;
  bool forward_ran = false;
  // The join context's all-reduce of this iteration (waited on at the next forward).
  dist::Work join_notice;

  // Without a hook the Reducer averages by itself: it multiplies by
  // 1/world while copying each gradient into its bucket (one pass over the
  // gradients fewer than a hook's) and sums the bucket through
  // process_group_for_reducer, i.e. this group's transport and error
  // reporting, as everything else it sends. With gradient_as_bucket_view the
  // Reducer would divide in place instead once gradients alias their bucket
  // (another rounding, varying by step), so there hooks::all_reduce(), which
  // multiplies as the copy does, keeps one rounding (torch DDP's default
  // path, bit for bit, in both cases).
  void install_hook() {
    if (hook_installed) return;
    if (hook || options.gradient_as_bucket_view) {
      reducer->register_comm_hook(std::make_unique<HookAdapter>(hook ? hook : hooks::all_reduce(), group));
    }
    hook_installed = true;
  }

  void broadcast(std::vector<at::Tensor> tensors, int root) {
    if (tensors.empty() || group.size() == 1) return;
    torch::NoGradGuard no_grad;
    group.broadcast_coalesced(tensors, root).wait();
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
  s.hook = options.comm_hook;
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
      s.params, std::move(bucket_indices), dist::detail::process_group_for_reducer(s.group),
      std::vector<bool>(s.params.size(), false), bucket_bytes, options.find_unused_parameters,
      options.gradient_as_bucket_view, std::move(names), first_bucket_bytes,
      /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
      /*bucket_bytes_cap_list=*/std::vector<std::int64_t>{});
  s.logger = std::make_shared<c10d::Logger>(s.reducer);
  s.reducer->set_logger(s.logger);
  s.logger->set_construction_data_and_log("dtrain::DistributedDataParallel", {}, -1, options.broadcast_buffers,
                                          /*has_sync_bn=*/false, options.static_graph);
  if (options.static_graph) s.reducer->set_static_graph();
  s.sink = std::make_shared<SinkState>(SinkState{.reducer = s.reducer, .static_graph = options.static_graph});
  s.sink_id = SinkRegistry::add(s.sink);
}

DDPEngine::~DDPEngine() {
  SinkRegistry::remove(state_->sink_id);
}

void DDPEngine::pre_forward() {
  auto& s = *state_;
  s.install_hook();
  s.forward_ran = true;
  s.join_notice.wait();
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

  // The average is over the whole group: a rank that has joined contributes
  // zeros (see join.h), so the notice's count is not needed for dividing.
  s.join_notice = notify_join_context();
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

void DDPEngine::set_comm_hook(std::shared_ptr<CommHook> hook) {
  auto& s = *state_;
  DTRAIN_CHECK(hook, ConfigError, "register_comm_hook got a null hook.", "pass e.g. dtrain::hooks::bf16_compress()");
  DTRAIN_CHECK(!s.forward_ran && !s.hook_installed, ConfigError,
               "a DDP communication hook must be set before the first forward.",
               "register the hook right after constructing DistributedDataParallel, on every rank");
  DTRAIN_CHECK(!s.hook, ConfigError, "this DDP already has a communication hook.",
               "register one hook per DistributedDataParallel");
  s.hook = std::move(hook);
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
  s.install_hook();
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
  for (auto& f : pending) f->waitAndThrow();
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
}  // namespace dtrain::detail
