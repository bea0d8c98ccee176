// init_process_group and subgroups; the operations are in collectives.cpp and p2p.cpp.
#include "dtrain/comm/process_group.h"

#include <ATen/ops/cos.h>
#include <ATen/ops/erf.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/expm1.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log.h>
#include <ATen/ops/log1p.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/tanh.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "backends.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "flight_recorder.h"
#include "group_state.h"
#include "membership.h"
#include "shm_p2p.h"

namespace dtrain::dist {

std::string to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kGloo: return "gloo";
    case BackendKind::kNccl: return "nccl";
  }
  return "?";
}

BackendKind parse_backend(const std::string& name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "gloo") return BackendKind::kGloo;
  if (name == "nccl") return BackendKind::kNccl;
  throw ConfigError("unknown backend '" + name + "'.", "use auto, gloo or nccl");
}

namespace detail {
std::string describe(const GroupState& s) {
  return to_string(s.kind) + " group '" + s.name + "' (rank " + std::to_string(s.rank) + " of " +
         std::to_string(s.size) + ")";
}
}  // namespace detail

namespace {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

BackendKind resolve_backend(const GroupOptions& options) {
  BackendKind kind = options.backend;
  if (kind == BackendKind::kAuto) kind = options.device.is_cuda() ? BackendKind::kNccl : BackendKind::kGloo;
  if (kind == BackendKind::kNccl) detail::check_nccl_usable(options.device);
  return kind;
}

// Builds a group on `store` (this group's own key space) after the check-in.
ProcessGroup make_group(const Store& store, int rank, int size, GroupOptions options, std::vector<int> world_ranks,
                        const std::string& fingerprint) {
  const BackendKind kind = resolve_backend(options);
  const auto timeout = options.timeout.value_or(default_timeout());
  options.timeout = timeout;

  const bool shared_p2p = kind == BackendKind::kGloo && options.intra_host_shared_memory && size > 1;
  if (shared_p2p) detail::SharedMemoryP2P::announce(store.with_prefix("p2p"), rank);
  auto checkin_store = store.with_prefix("checkin");
  detail::check_in(checkin_store,
                   {.rank = rank, .size = size, .timeout = timeout, .group = options.name, .fingerprint = fingerprint});

  detail::BackendRequest request{.store = c10d_store(store.with_prefix("backend")),
                                 .rank = rank,
                                 .size = size,
                                 .timeout = timeout,
                                 .gloo_host = options.gloo_host,
                                 .device = options.device,
                                 .group_name = options.name};
  auto state = std::make_shared<detail::GroupState>();
  state->backend = kind == BackendKind::kNccl ? detail::make_nccl_backend(request) : detail::make_gloo_backend(request);
  state->rank = rank;
  state->size = size;
  state->kind = kind;
  state->device = options.device;
  state->timeout = timeout;
  state->name = options.name;
  state->world_ranks = std::move(world_ranks);
  state->store = store;
  state->identity = log::identity();
  state->options = std::move(options);
  if (detail::FlightRecorder::get() != nullptr) {
    state->flight = std::make_unique<detail::FlightCounters>();
    state->flight->group = std::make_shared<const detail::FlightGroup>(detail::FlightGroup{
        .name = state->name, .backend = to_string(kind), .rank = rank, .world_ranks = state->world_ranks});
    state->flight->sends.assign(static_cast<std::size_t>(size), 0);
    state->flight->recvs.assign(static_cast<std::size_t>(size), 0);
  }
  if (shared_p2p) {
    c10::intrusive_ptr<c10d::Backend> backend = state->backend;
    state->p2p = std::make_unique<detail::SharedMemoryP2P>(
        detail::SharedMemoryP2P::Options{
            .rank = rank, .size = size, .timeout = timeout, .store = store.with_prefix("p2p")},
        [backend](const at::Tensor& tensor, int peer, int tag) {
          std::vector<at::Tensor> tensors{tensor};
          return backend->send(tensors, peer, tag);
        },
        [backend](at::Tensor& tensor, int peer, int tag) {
          std::vector<at::Tensor> tensors{tensor};
          return backend->recv(tensors, peer, tag);
        });
  }
  return ProcessGroup(std::move(state));
}

std::vector<int> iota(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

// Note [Vector math warm-up]
// MKL's vector math (VML: ATen's exp, log, tanh, erf, ... on x86 CPUs)
// resolves each function's kernel, per precision, at that function's first
// call in a process, and not thread-safely: when several threads make the
// first calls at once (ranks as threads of one process, or one large exp
// split over OpenMP threads), now and then one chunk runs the low-accuracy
// kernel (~7e-5 relative, once; seen in context parallelism's softmax merge
// in about 1 of 20-50 fresh processes of 2-4 rank threads: a run no longer
// bit for bit the next; pytorch/pytorch#188792: oneMKL before 2025.0). So the
// first calls of the functions dtrain's models use are made once, here, by
// the first rank to join a world, in fp32 and fp64 on tensors too small to
// be split over threads; the other ranks' threads wait (std::call_once).
void warm_up_vector_math() {
  static std::once_flag once;
  std::call_once(once, [] {
    using Unary = at::Tensor (*)(const at::Tensor&);
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      const at::Tensor x = at::full({16}, 0.5, at::TensorOptions().dtype(dtype));
      for (const Unary f :
           {at::exp, at::log, at::log1p, at::expm1, at::tanh, at::erf, at::sqrt, at::rsqrt, at::sin, at::cos}) {
        static_cast<void>(f(x));
      }
    }
  });
}

ProcessGroup make_world(const Store& store, int rank, int world_size, GroupOptions options) {
  warm_up_vector_math();
  validate(EnvContract{.rank = rank, .world_size = world_size, .local_rank = 0, .local_world_size = 1});
  log::set_rank(rank, world_size);
  if (options.gloo_host.empty() && std::getenv("GLOO_SOCKET_IFNAME") == nullptr &&
      store.impl()->where == "in-memory store") {
    options.gloo_host = "127.0.0.1";  // ranks are threads of this process
  }
  auto group = make_group(store.with_prefix("dtrain/" + options.name), rank, world_size, options, iota(world_size), "");
  DTRAIN_LOG(kDebug) << "joined " << detail::describe(*group.state());
  return group;
}

}  // namespace

// ---- ProcessGroup ----

int ProcessGroup::rank() const {
  return state_->rank;
}
int ProcessGroup::size() const {
  return state_->size;
}
BackendKind ProcessGroup::backend() const {
  return state_->kind;
}
c10::Device ProcessGroup::device() const {
  return state_->device;
}
std::chrono::milliseconds ProcessGroup::timeout() const {
  return state_->timeout;
}
const std::string& ProcessGroup::name() const {
  return state_->name;
}
const std::vector<int>& ProcessGroup::world_ranks() const {
  return state_->world_ranks;
}

Traffic traffic(const ProcessGroup& group) {
  const detail::GroupState& s = *group.state();
  Traffic out;
  for (int k = 0; k < kOpKinds; ++k) {
    out.by_kind[k].ops = s.traffic[static_cast<std::size_t>(2 * k)].load(std::memory_order_relaxed);
    out.by_kind[k].bytes = s.traffic[static_cast<std::size_t>(2 * k + 1)].load(std::memory_order_relaxed);
  }
  return out;
}

namespace detail {
void rename_group(GroupState& state, std::string name) {
  state.name = std::move(name);
  if (state.flight) {
    auto renamed = std::make_shared<FlightGroup>(*state.flight->group);
    renamed->name = state.name;
    state.flight->group = std::move(renamed);
  }
}
}  // namespace detail

std::optional<ProcessGroup> ProcessGroup::new_group(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  DTRAIN_CHECK(!ranks.empty(), ConfigError, "new_group got an empty rank list.", "list at least one rank");
  DTRAIN_CHECK(std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end(), ConfigError,
               "new_group got a rank list with duplicates.", "list each rank once");
  DTRAIN_CHECK(ranks.front() >= 0 && ranks.back() < state_->size, ConfigError,
               "new_group got rank " << (ranks.front() < 0 ? ranks.front() : ranks.back()) << ", which is not in "
                                     << detail::describe(*state_) << ".",
               "list ranks in 0.." << state_->size - 1);
  std::string fingerprint;
  for (int r : ranks) fingerprint += (fingerprint.empty() ? "" : ",") + std::to_string(r);

  const int id = state_->subgroups_created++;
  Store sub = state_->store.with_prefix("sub" + std::to_string(id));
  GroupOptions options = state_->options;
  options.name = state_->name + "/sub" + std::to_string(id);
  // Every rank of this group (members or not) agrees on the list first, so a
  // mismatch fails fast instead of leaving members waiting on a backend.
  auto agree = sub.with_prefix("agree");
  detail::check_in(agree, {.rank = state_->rank,
                           .size = state_->size,
                           .timeout = state_->timeout,
                           .group = options.name,
                           .fingerprint = fingerprint});
  const auto it = std::find(ranks.begin(), ranks.end(), state_->rank);
  if (it == ranks.end()) return std::nullopt;
  std::vector<int> world;
  world.reserve(ranks.size());
  for (int r : ranks) world.push_back(state_->world_ranks[static_cast<size_t>(r)]);
  return make_group(sub.with_prefix("group"), static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()),
                    options, std::move(world), fingerprint);
}

// ---- init ----

ProcessGroup init_process_group(const Store& store, int rank, int world_size, const GroupOptions& options) {
  return make_world(store, rank, world_size, options);
}

ProcessGroup init_process_group(const EnvContract& contract, const GroupOptions& options) {
  validate(contract);
  log::set_rank(contract.rank, contract.world_size);
  GroupOptions resolved = options;
  resolved.timeout = options.timeout.value_or(default_timeout());
  resolve_backend(resolved);  // fail on e.g. nccl-without-CUDA before touching the network
  if (resolved.gloo_host.empty() && std::getenv("GLOO_SOCKET_IFNAME") == nullptr && is_loopback(contract.master_addr)) {
    resolved.gloo_host = "127.0.0.1";
  }
  // Under torchrun the agent hosts the store and keeps it across restarts:
  // nobody hosts, and each round works under its own prefix (torch's layout).
  Store store = Store::tcp({.host = contract.master_addr,
                            .port = contract.master_port,
                            .is_server = contract.rank == 0 && !contract.agent_store,
                            .timeout = *resolved.timeout});
  return make_world(store.with_prefix("/worker/attempt_" + std::to_string(contract.restart_count)), contract.rank,
                    contract.world_size, resolved);
}

ProcessGroup init_process_group(const GroupOptions& options) {
  return init_process_group(read_env_contract(), options);
}

}  // namespace dtrain::dist
