// DistributedDataParallel for LibTorch modules.
//
// One process per device, each with a replica of the module. The replicas
// start identical (parameters and buffers are broadcast from rank 0 at
// construction, after checking that every rank built the same model), and
// gradients are averaged across processes by bucketed all-reduce while
// backward is still running: each bucket's all-reduce starts as soon as all
// its gradients are ready. The optimizer step then sees averaged gradients.
//
//   auto world = dtrain::dist::init_process_group();
//   dtrain::DistributedDataParallel ddp(model, world);
//   torch::optim::SGD opt(ddp.module()->parameters(), 0.1);
//   for (...) { opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step(); }
//
// Bucketing is c10d's Reducer (the engine behind torch DDP), driven the way
// torch.nn.parallel.DistributedDataParallel drives it; every bucket is
// reduced by a communication hook (comm_hook.h) over dtrain's ProcessGroup,
// so failures surface as dtrain::CommunicationError. See docs/ddp.md.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/ddp/comm_hook.h"
#include "dtrain/parallel/ddp/join.h"

namespace dtrain {

struct DDPOptions {
  // Size cap of gradient buckets (MiB), and of the first bucket, which holds
  // the last layers' gradients (the first ready), so a small one starts
  // communication early.
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  // Detect parameters that get no gradient in an iteration (costs a graph
  // traversal per iteration); without it, such a parameter makes backward fail.
  bool find_unused_parameters = false;
  // Gradients are views into the communication buckets (saves one copy and memory).
  bool gradient_as_bucket_view = false;
  // Broadcast buffers (e.g. BatchNorm statistics) from rank 0 before each forward.
  bool broadcast_buffers = true;
  // The set of used parameters and the graph do not change between iterations.
  bool static_graph = false;
  // How each gradient bucket is reduced (see comm_hook.h); null: averaged
  // through the group by the Reducer itself (1/size multiplied in as each
  // gradient is copied into its bucket; hooks::all_reduce()'s rounding),
  // which takes shared memory for CPU ranks on one host
  // (GroupOptions::intra_host_shared_memory).
  std::shared_ptr<CommHook> comm_hook;
};

namespace detail {

// The untyped machinery behind DistributedDataParallel<M>.
class DDPEngine : public Joinable {
 public:
  DDPEngine(std::shared_ptr<torch::nn::Module> module, dist::ProcessGroup group, const DDPOptions& options);
  ~DDPEngine() override;

  void pre_forward();
  std::vector<at::Tensor> post_forward(std::vector<at::Tensor> outputs);

  bool require_backward_grad_sync() const;
  void set_require_backward_grad_sync(bool sync);
  void set_comm_hook(std::shared_ptr<CommHook> hook);
  const DDPOptions& options() const;
  void zero_grad(bool set_to_none);
  // Sizes in bytes of the current gradient buckets, in communication order.
  std::vector<std::size_t> bucket_sizes() const;

  void join_main_hook() override;
  void join_post_hook(bool is_last_joiner) override;
  dist::ProcessGroup& join_group() override;
  c10::Device join_device() const override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

template <typename T>
std::shared_ptr<torch::nn::Module> as_module_ptr(const T& module) {
  if constexpr (requires { module.ptr(); }) {
    return module.ptr();
  } else {
    return module;
  }
}

}  // namespace detail

// Disables gradient synchronisation while alive: backward accumulates
// gradients locally, and the first backward after it ends reduces the sum.
class NoSync {
 public:
  explicit NoSync(detail::DDPEngine& engine) : engine_(&engine), previous_(engine.require_backward_grad_sync()) {
    engine.set_require_backward_grad_sync(false);
  }
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;
  ~NoSync() { engine_->set_require_backward_grad_sync(previous_); }

 private:
  detail::DDPEngine* engine_;
  bool previous_;
};

// `ModuleHolder` is a LibTorch module holder (what TORCH_MODULE declares) or a
// std::shared_ptr to a module; its forward() may return a Tensor, a
// std::vector<Tensor> or a std::tuple of Tensors.
template <typename ModuleHolder>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleHolder module, dist::ProcessGroup group, const DDPOptions& options = {})
      : module_(std::move(module)),
        engine_(std::make_unique<detail::DDPEngine>(detail::as_module_ptr(module_), std::move(group), options)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    engine_->pre_forward();
    return post_forward(module_->forward(std::forward<Args>(args)...));
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  ModuleHolder& module() { return module_; }
  // Clears the gradients of the wrapped module's parameters. Use it instead of
  // torch::optim::Optimizer::zero_grad with gradient_as_bucket_view: LibTorch's
  // optimizers detach_() gradients, which views of DDP's buckets forbid.
  void zero_grad(bool set_to_none = true) { engine_->zero_grad(set_to_none); }
  // Gradient accumulation: `{ auto guard = ddp.no_sync(); ...backward()...; }`.
  [[nodiscard]] NoSync no_sync() { return NoSync(*engine_); }
  // Replaces the communication hook (the default averages); call before the
  // first forward, on every rank.
  void register_comm_hook(std::shared_ptr<CommHook> hook) { engine_->set_comm_hook(std::move(hook)); }
  // For Join: `dtrain::Join join({&ddp.joinable()})`.
  Joinable& joinable() { return *engine_; }
  detail::DDPEngine& engine() { return *engine_; }

 private:
  at::Tensor post_forward(at::Tensor output) { return engine_->post_forward({std::move(output)}).front(); }
  std::vector<at::Tensor> post_forward(std::vector<at::Tensor> outputs) {
    return engine_->post_forward(std::move(outputs));
  }
  template <typename... Ts>
  std::tuple<Ts...> post_forward(std::tuple<Ts...> outputs) {
    static_assert((std::is_same_v<Ts, at::Tensor> && ...), "DDP forward outputs must be Tensors");
    auto flat = std::apply([](auto&... t) { return std::vector<at::Tensor>{t...}; }, outputs);
    flat = engine_->post_forward(std::move(flat));
    std::size_t i = 0;
    std::apply([&](auto&... t) { ((t = flat[i++]), ...); }, outputs);
    return outputs;
  }

  ModuleHolder module_;
  std::unique_ptr<detail::DDPEngine> engine_;
};

}  // namespace dtrain
