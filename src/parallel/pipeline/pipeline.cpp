// The pipeline executor: runs this rank's action list of a schedule over its
// stages (see include/dtrain/parallel/pipeline/pipeline.h).
//
// Per (stage, micro-batch) it keeps the stage's input (a leaf requiring grad,
// so backward yields its gradient), its output (the scaled loss on the last
// stage) and the gradients flowing through. Backward is split the way
// torch.distributed.pipelining splits it: I = torch::autograd::grad of the
// output w.r.t. the input, keeping the graph, while hooks capture the
// gradients W needs; W = the weight side only, from those (Note [Weight
// backward from captured gradients] in split_backward.h).
#include "dtrain/parallel/pipeline/pipeline.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <ctime>
#include <map>
#include <sstream>
#include <tuple>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "split_backward.h"

namespace dtrain::pipeline {

namespace {

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Shape and dtype of a tensor as exchanged on the wire: [ndim, dtype, dims...].
constexpr int kMaxDims = 8;
constexpr int kMetaLength = 2 + kMaxDims;

std::vector<std::int64_t> meta_of(const at::Tensor& t) {
  DTRAIN_CHECK(t.dim() <= kMaxDims, ConfigError,
               "pipeline activations have at most " << kMaxDims << " dimensions, got " << t.sizes(),
               "reshape the activation between stages");
  std::vector<std::int64_t> meta(kMetaLength, 0);
  meta[0] = t.dim();
  meta[1] = static_cast<std::int64_t>(t.scalar_type());
  for (int d = 0; d < t.dim(); ++d) meta[2 + d] = t.size(d);
  return meta;
}

std::string describe(const std::vector<std::int64_t>& meta) {
  std::ostringstream out;
  out << c10::toString(static_cast<c10::ScalarType>(meta[1])) << "[";
  for (int d = 0; d < meta[0]; ++d) out << (d ? ", " : "") << meta[2 + d];
  out << "]";
  return out.str();
}

at::Tensor empty_of(const std::vector<std::int64_t>& meta, c10::Device device) {
  std::vector<std::int64_t> sizes(meta.begin() + 2, meta.begin() + 2 + meta[0]);
  return at::empty(sizes, at::TensorOptions(static_cast<c10::ScalarType>(meta[1])).device(device));
}

// Small integer messages live on the group's device: NCCL moves device
// tensors only.
at::Tensor meta_tensor(const std::vector<std::int64_t>& meta, c10::Device device) {
  return at::tensor(meta, at::kLong).to(device);
}

std::vector<std::int64_t> meta_from(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  return {c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel()};
}

}  // namespace

struct Pipeline::Impl {
  struct Micro {
    at::Tensor input, output, grad_output, grad_input;
    std::shared_ptr<detail::SplitBackward> split;  // between I and W
  };
  enum Tag { kActivation = 0, kGradient = 1, kMeta = 2, kTieGradient = 3, kTieWeight = 4 };
  explicit Impl(dist::ProcessGroup g) : group(std::move(g)) {}

  std::vector<PipelineStage> stages;
  dist::ProcessGroup group;
  PipelineOptions options;
  LossFn loss_fn;
  Schedule schedule, eval_schedule;
  int p = 1, n = 1, m = 1, rank = 0;
  std::map<int, std::size_t> local;  // stage -> index in stages
  std::vector<std::vector<at::Tensor>> stage_params;
  // Per local stage, its data-parallel applier (stage_sync.h), called at the
  // Note's fixed points; `begun`: begin_step called and end_step not yet.
  std::vector<std::unique_ptr<StageGradientSync>> syncs;
  std::vector<bool> begun;
  // Whether the appliers shard the stages' parameters over the data group
  // (every stage has the same applier): the optimizer then steps on shards.
  bool sharded = false;
  // Per local stage: the index in this rank's action list of its last B or W
  // (the backward that completes its gradients).
  std::vector<std::size_t> last_param_backward;
  std::size_t action_index = 0;  // of the action running (training)
  // Tied copies that are not among any local stage's module parameters
  // (the borrowers' copies): the appliers do not see them.
  std::vector<std::pair<std::size_t, std::size_t>> borrowed;  // (local stage, tie index)
  // The gradients counted on this rank; partials combine over the data group
  // (sharded stages), then the pipeline.
  GradientSet counted_gradients;
  // Agreed on the first training step: each received stage input's and each
  // sent stage output's meta, and the micro-batch input's.
  std::map<int, std::vector<std::int64_t>> input_meta, output_meta;
  std::optional<std::vector<std::int64_t>> batch_meta;
  std::vector<std::vector<Micro>> state;  // [local stage][micro]
  std::vector<std::pair<dist::Work, at::Tensor>> sends;
  // Receives posted ahead of their action (see Note [Receives posted ahead]).
  std::map<std::tuple<int, int, int>, std::pair<dist::Work, at::Tensor>> posted;
  std::vector<at::Tensor> micro_inputs, micro_targets, eval_outputs;
  at::Tensor loss_sum;
  amp::GradScaler* scaler = nullptr;
  bool training = true, exchange_meta = true;
  int in_flight = 0, peak = 0;
  std::vector<TracedAction> trace;
  int last_captured = 0;  // the running I's captured nodes (TracedAction::captured_nodes)

  int tag(Tag kind, int stage, int micro) const { return 1 + (int(kind) * n + stage) * m + micro; }
  // Ties: one tag per (kind, owner stage, tie index), above every activation tag.
  int tie_tag(Tag kind, int owner_stage, std::size_t index) const {
    return 1 + 3 * n * m + ((int(kind) - int(kTieGradient)) * n + owner_stage) * 64 + int(index);
  }
  bool data_parallel() const { return options.data_parallel_group && options.data_parallel_group->size() > 1; }
  bool remote(int stage) const { return schedule.rank_of_stage(stage) != rank; }
  Micro& at(int stage, int micro) { return state[local.at(stage)][micro]; }

  void run(const std::vector<Action>& actions);
  void forward(const Action& a);
  void backward(const Action& a);
  at::Tensor grad_of_output(int stage, int micro);
  void send(const Action& a);
  void recv(const Action& a);
  void post_ahead(const std::vector<Action>& actions, std::size_t from);
  void check_batch(const at::Tensor& micro_input);
  void finish_gradients();
  void exchange_ties();
  void refresh_borrowed_weights();
  void split_batch(const at::Tensor& input, const at::Tensor& target);
  void begin(std::size_t k);
  void end_all();
  void end_all_after_error() noexcept;
  std::vector<at::Tensor> parameters() const;
};

namespace {

// The gradients counted for global norms, from the parameters' layouts over
// `mesh` (PipelineOptions::mesh): what each stage's applier steps on, with
// its layout (a ZeRO stage's shards: norm_layouts()); stages partition the
// model over pp. The borrowers' tied copies are not among them, as below.
GradientSet laid_out_gradients(const std::vector<PipelineStage>& stages,
                               const std::vector<std::unique_ptr<StageGradientSync>>& syncs, dist::DeviceMesh& mesh) {
  DTRAIN_CHECK(mesh.has("pp"), ConfigError, "PipelineOptions::mesh " << mesh.describe() << " has no pp dimension.",
               "give the mesh whose pp group runs the pipeline");
  std::vector<std::pair<at::Tensor, dist::Layout>> laid_out;
  for (std::size_t k = 0; k < stages.size(); ++k) {
    if (ShardedDataParallel* engine = syncs[k]->zero_engine()) {
      for (auto& item : engine->norm_layouts(mesh)) laid_out.push_back(std::move(item));
      continue;
    }
    const dist::NamedLayouts layouts = dist::named_layouts(*stages[k].module, mesh);
    const auto params = stages[k].module->named_parameters();
    for (const at::Tensor& param : syncs[k]->parameters()) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (!params[i].value().is_same(param)) continue;
        laid_out.emplace_back(param, layouts[i].second);
        break;
      }
    }
  }
  return GradientSet::from_layouts(laid_out, mesh, {"pp"});
}

}  // namespace

Pipeline::Pipeline(std::vector<PipelineStage> stages, dist::ProcessGroup group, PipelineOptions options, LossFn loss_fn)
    : impl_(std::make_unique<Impl>(group)) {
  Impl& s = *impl_;
  s.p = group.size();
  s.rank = group.rank();
  s.m = options.micro_batches;
  const int v = static_cast<int>(stages.size());
  DTRAIN_CHECK(v >= 1, ConfigError, "pipeline rank " << s.rank << " got no stages",
               "give every rank of the pipeline group its stages (schedule.stages_of_rank)");
  // Every rank must run the same schedule: compare (kind, v, m) once.
  const at::Tensor mine = at::tensor({std::int64_t(options.schedule), std::int64_t(v), std::int64_t(s.m)}, at::kLong);
  for (const at::Tensor& gathered : group.all_gather(mine.to(group.device()))) {
    const at::Tensor other = gathered.to(at::kCPU);
    DTRAIN_CHECK(at::equal(other, mine), ConfigError,
                 "pipeline ranks disagree on (schedule, stages per rank, micro-batches): this rank has "
                     << mine << ", another " << other,
                 "build every rank's Pipeline with the same options and the same number of stages");
  }
  s.schedule = make_schedule({.kind = options.schedule, .ranks = s.p, .stages_per_rank = v, .micro_batches = s.m});
  s.n = s.schedule.stage_count();
  // Evaluation: GPipe's order of the same placement, forwards only.
  Schedule gpipe =
      add_communication({.kind = ScheduleKind::kGPipe, .ranks = s.p, .stages_per_rank = v, .micro_batches = s.m}, [&] {
        std::vector<std::vector<Action>> compute(s.p);
        for (int r = 0; r < s.p; ++r) {
          for (int st = r; st < s.n; st += s.p) {
            for (int i = 0; i < s.m; ++i) compute[r].push_back({ActionKind::kForward, st, i});
          }
        }
        return compute;
      }());
  s.eval_schedule = gpipe;
  const std::vector<int> mine_stages = s.schedule.stages_of_rank(s.rank);
  for (std::size_t k = 0; k < mine_stages.size(); ++k) s.local[mine_stages[k]] = k;
  for (const PipelineStage& stage : stages) {
    std::vector<at::Tensor> params;
    for (const at::Tensor& param : stage.module->parameters()) {
      if (param.requires_grad()) params.push_back(param);
    }
    for (const TiedParameter& tied : stage.tied) {
      if (tied.owner) continue;          // already among the module's parameters
      params.push_back(tied.parameter);  // so backward (inputs = parameters) reaches it
    }
    s.stage_params.push_back(std::move(params));
  }
  s.stages = std::move(stages);
  s.options = std::move(options);
  s.loss_fn = std::move(loss_fn);
  const std::vector<Action>& actions = s.schedule.actions[s.rank];
  s.last_param_backward.assign(s.stages.size(), actions.size());
  for (std::size_t k = 0; k < actions.size(); ++k) {
    const std::size_t stage = s.local.at(actions[k].stage);
    if (actions[k].kind == ActionKind::kBackward || actions[k].kind == ActionKind::kBackwardWeight)
      s.last_param_backward[stage] = k;
  }
  for (std::size_t k = 0; k < s.stages.size(); ++k) {
    for (std::size_t j = 0; j < s.stages[k].tied.size(); ++j) {
      const at::Tensor& param = s.stages[k].tied[j].parameter;
      bool in_module = false;
      for (const PipelineStage& stage : s.stages) {
        for (const at::Tensor& p : stage.module->parameters()) in_module = in_module || p.is_same(param);
      }
      if (!in_module) s.borrowed.emplace_back(k, j);
    }
  }
  auto& dp = s.options.data_parallel_group;
  DTRAIN_CHECK(s.options.stage_sync, ConfigError, "PipelineOptions::stage_sync is empty",
               "leave the default (ddp_stage_sync()) or set an applier from stage_sync.h");
  for (const PipelineStage& stage : s.stages) s.syncs.push_back(s.options.stage_sync(stage.module, dp));
  s.begun.assign(s.stages.size(), false);
  s.sharded = s.syncs.front()->sharded();
  if (s.data_parallel()) {
    // The borrowers' copies start alike on every replica, like the modules.
    at::NoGradGuard no_grad;
    for (const auto& [k, j] : s.borrowed) dp->broadcast(s.stages[k].tied[j].parameter, 0).wait();
  }
  // Global norms: each parameter once over the pipeline (tied copies on their
  // owner); sharded, each shard once over the data group too.
  std::vector<at::Tensor> counted;
  for (const auto& sync : s.syncs) {
    for (const at::Tensor& param : sync->parameters()) counted.push_back(param);
  }
  if (s.options.mesh) {
    s.counted_gradients = laid_out_gradients(s.stages, s.syncs, *s.options.mesh);
  } else if (s.sharded) {
    s.counted_gradients = GradientSet{std::move(counted), {*dp, s.group}};
  } else {
    s.counted_gradients = GradientSet::sharded(std::move(counted), s.group);
  }
}

// begin_step once per step (or evaluation) per local stage, at its first use.
void Pipeline::Impl::begin(std::size_t k) {
  if (begun[k]) return;
  begun[k] = true;
  syncs[k]->begin_step(training);
}

void Pipeline::Impl::end_all() {
  for (std::size_t k = 0; k < syncs.size(); ++k) {
    if (!begun[k]) continue;
    begun[k] = false;
    syncs[k]->end_step();
  }
}

// A step or evaluation that threw still ends its stages' scopes (ZeRO's
// no-sync and gathered parameters): the next one begins them afresh instead
// of running inside the failed one's. The first error is the one reported.
void Pipeline::Impl::end_all_after_error() noexcept {
  for (std::size_t k = 0; k < syncs.size(); ++k) {
    if (!begun[k]) continue;
    begun[k] = false;
    try {
      syncs[k]->end_step();
    } catch (const std::exception& e) {
      DTRAIN_LOG(kWarning) << "pipeline stage " << k << " did not end its step cleanly after an error: " << e.what();
    }
  }
}

Pipeline::~Pipeline() = default;
Pipeline::Pipeline(Pipeline&&) noexcept = default;
Pipeline& Pipeline::operator=(Pipeline&&) noexcept = default;

void Pipeline::Impl::split_batch(const at::Tensor& input, const at::Tensor& target) {
  micro_inputs.clear();
  micro_targets.clear();
  auto split = [&](const at::Tensor& t, const char* what, std::vector<at::Tensor>& out) {
    DTRAIN_CHECK(t.defined() && t.dim() >= 1 && t.size(0) % m == 0 && t.size(0) >= m, ConfigError,
                 "pipeline " << what << " of shape " << (t.defined() ? t.sizes() : at::IntArrayRef{})
                             << " does not split into " << m << " equal micro-batches along dim 0",
                 "use a batch size that is a multiple of the number of micro-batches");
    out = t.chunk(m, 0);
  };
  if (!remote(0)) split(input, "input", micro_inputs);
  if (!remote(n - 1) && training) split(target, "target", micro_targets);
  check_batch(micro_inputs.empty() ? at::Tensor() : micro_inputs.front());
}

// Every step: the first stage's rank tells every rank the micro-batch's
// meta; a change from the agreed one fails on all ranks alike.
void Pipeline::Impl::check_batch(const at::Tensor& micro_input) {
  at::Tensor meta = micro_input.defined()
                        ? meta_tensor(meta_of(micro_input), group.device())
                        : at::zeros({kMetaLength}, at::TensorOptions(at::kLong).device(group.device()));
  if (p > 1) group.broadcast(meta, schedule.rank_of_stage(0)).wait();
  const std::vector<std::int64_t> now = meta_from(meta);
  if (!training) return;  // evaluation agrees on its own shapes each call
  if (!batch_meta) {
    batch_meta = now;
    return;
  }
  DTRAIN_CHECK(*batch_meta == now, ConfigError,
               "pipeline micro-batch changed from " << describe(*batch_meta) << " to " << describe(now)
                                                    << "; shapes are agreed at the first step",
               "keep the batch size fixed (drop the last partial batch), or build a new Pipeline");
}

at::Tensor Pipeline::step(const at::Tensor& input, const at::Tensor& target, amp::GradScaler* scaler) {
  Impl& s = *impl_;
  s.training = true;
  s.scaler = scaler;
  // Ranks without the loss still need the scaler's scale (created by its
  // first scale()) for unscale_; it evolves alike on every stage because
  // found-inf is reduced over found_inf_group.
  if (scaler && s.remote(s.n - 1)) scaler->scale(at::zeros({}, at::TensorOptions().device(s.group.device())));
  s.split_batch(input, target);
  if (s.sharded) s.refresh_borrowed_weights();
  s.exchange_meta = s.output_meta.empty() && s.input_meta.empty();
  s.loss_sum = at::Tensor();
  try {
    s.run(s.schedule.actions[s.rank]);
  } catch (...) {
    s.end_all_after_error();
    s.scaler = nullptr;
    throw;
  }
  s.exchange_meta = false;
  s.end_all();
  s.finish_gradients();
  s.scaler = nullptr;
  return s.remote(s.n - 1) ? at::Tensor() : s.loss_sum;
}

at::Tensor Pipeline::forward(const at::Tensor& input) {
  Impl& s = *impl_;
  at::NoGradGuard no_grad;
  s.training = false;
  s.split_batch(input, at::Tensor());
  if (s.sharded) s.refresh_borrowed_weights();
  s.exchange_meta = true;
  s.eval_outputs.clear();
  // Evaluation agrees on its own shapes; training's stay as they were.
  auto saved_input_meta = s.input_meta, saved_output_meta = s.output_meta;
  auto restore = [&] {
    s.input_meta = std::move(saved_input_meta);
    s.output_meta = std::move(saved_output_meta);
    s.training = true;
  };
  try {
    s.run(s.eval_schedule.actions[s.rank]);
  } catch (...) {
    s.end_all_after_error();
    restore();
    throw;
  }
  s.end_all();
  restore();
  return s.eval_outputs.empty() ? at::Tensor() : at::cat(s.eval_outputs, 0);
}

void Pipeline::Impl::run(const std::vector<Action>& actions) {
  state.assign(stages.size(), std::vector<Micro>(m));
  sends.clear();
  trace.clear();
  in_flight = peak = 0;
  posted.clear();
  for (std::size_t k = 0; k < actions.size(); ++k) {
    const Action& a = actions[k];
    action_index = k;
    post_ahead(actions, k);
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = options.record_trace ? thread_cpu_seconds() : 0;
    last_captured = 0;
    switch (a.kind) {
      case ActionKind::kForward: forward(a); break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
      case ActionKind::kBackwardWeight: backward(a); break;
      case ActionKind::kSendActivation:
      case ActionKind::kSendGradient: send(a); break;
      case ActionKind::kRecvActivation:
      case ActionKind::kRecvGradient: recv(a); break;
    }
    if (options.record_trace && a.is_compute())
      trace.push_back({.action = a,
                       .start = start,
                       .end = std::chrono::steady_clock::now(),
                       .cpu_seconds = thread_cpu_seconds() - cpu_start,
                       .captured_nodes = last_captured});
  }
  for (auto& [work, tensor] : sends) work.wait();
  sends.clear();
  state.clear();
}

void Pipeline::Impl::forward(const Action& a) {
  Micro& mb = at(a.stage, a.micro);
  at::Tensor x;
  if (a.stage == 0) {
    x = micro_inputs[a.micro];
  } else if (!remote(a.stage - 1)) {
    // The previous stage is on this rank: a fresh leaf, as if received, so
    // each stage's backward stays its own (and I/W split per stage).
    x = at(a.stage - 1, a.micro).output.detach();
    if (training) x.requires_grad_(true);
    mb.input = x;
  } else {
    x = mb.input;
  }
  const std::size_t k = local.at(a.stage);
  begin(k);
  at::Tensor out = syncs[k]->forward(x);
  if (a.stage == n - 1) {
    if (!training) {
      eval_outputs.push_back(out);
      return;
    }
    at::Tensor loss = loss_fn(out, micro_targets[a.micro]);
    const at::Tensor detached = loss.detach() / m;
    loss_sum = loss_sum.defined() ? loss_sum + detached : detached;
    out = loss / m;
    if (scaler) out = scaler->scale(out);
  }
  mb.output = out;
  if (training) peak = std::max(peak, ++in_flight);
}

at::Tensor Pipeline::Impl::grad_of_output(int stage, int micro) {
  if (stage == n - 1) return at::Tensor();  // the scalar loss
  if (remote(stage + 1)) return at(stage, micro).grad_output;
  return at(stage + 1, micro).grad_input;
}

void Pipeline::Impl::backward(const Action& a) {
  Micro& mb = at(a.stage, a.micro);
  DTRAIN_INTERNAL_ASSERT(mb.output.defined(), "pipeline backward of " << to_string(a) << " before its forward");
  const at::Tensor grad = grad_of_output(a.stage, a.micro);
  std::vector<at::Tensor> grads;
  if (grad.defined()) grads.push_back(grad);
  const std::size_t k = local.at(a.stage);
  const std::vector<at::Tensor>& params = stage_params[k];
  const bool has_input = a.stage > 0 && mb.input.defined() && mb.input.requires_grad();
  const bool last = action_index == last_param_backward[k];
  // One autograd run where the applier needs it (see Note [Stage gradients
  // over the data-parallel group] in stage_sync.h).
  if (last && syncs[k]->before_last_backward()) mb.split.reset();
  if (a.kind == ActionKind::kBackwardInput) {
    if (has_input) {
      mb.split = detail::SplitBackward::prepare(mb.output, mb.input, params);
      last_captured = mb.split ? mb.split->captured_nodes() : 0;
      mb.grad_input = torch::autograd::grad({mb.output}, {mb.input}, grads, /*retain_graph=*/true)[0];
    }
    return;  // the graph stays for W
  }
  if (a.kind == ActionKind::kBackward) {
    std::vector<at::Tensor> inputs = params;
    if (has_input) inputs.push_back(mb.input);
    torch::autograd::backward({mb.output}, grads, /*retain_graph=*/false, /*create_graph=*/false, inputs);
    if (has_input) mb.grad_input = mb.input.grad();
  } else if (mb.split) {
    mb.split->backward_weights();
    mb.split.reset();
  } else if (!params.empty()) {
    torch::autograd::backward({mb.output}, grads, /*retain_graph=*/false, /*create_graph=*/false, params);
  }
  // The activations of this micro-batch on this stage are no longer needed.
  mb.output = at::Tensor();
  mb.input = at::Tensor();
  mb.grad_output = at::Tensor();
  if (a.stage + 1 < n && !remote(a.stage + 1)) at(a.stage + 1, a.micro).grad_input = at::Tensor();
  --in_flight;
}

void Pipeline::Impl::send(const Action& a) {
  Micro& mb = at(a.stage, a.micro);
  const bool activation = a.kind == ActionKind::kSendActivation;
  const int peer = schedule.rank_of_stage(activation ? a.stage + 1 : a.stage - 1);
  at::Tensor t = (activation ? mb.output : mb.grad_input).detach().contiguous();
  if (activation) {
    const std::vector<std::int64_t> meta = meta_of(t);
    auto agreed = output_meta.find(a.stage);
    if (exchange_meta || agreed == output_meta.end()) {
      if (a.micro == 0) {
        at::Tensor header = meta_tensor(meta, group.device());
        sends.emplace_back(group.isend(header, peer, tag(kMeta, a.stage + 1, 0)), header);
      }
      output_meta[a.stage] = meta;
    } else {
      DTRAIN_CHECK(agreed->second == meta, ConfigError,
                   "pipeline stage " << a.stage << "'s output for micro-batch " << a.micro << " is " << describe(meta)
                                     << ", but " << describe(agreed->second) << " was agreed at the first step",
                   "a stage's output shape must not change while the micro-batch shape stays the same");
    }
  } else if (!t.defined()) {
    t = at::zeros_like(mb.input);  // the input did not reach the output: a zero gradient
  }
  const int receiving_stage = activation ? a.stage + 1 : a.stage - 1;
  sends.emplace_back(group.isend(t, peer, tag(activation ? kActivation : kGradient, receiving_stage, a.micro)), t);
  if (!activation) mb.grad_input = at::Tensor();
}

// Note [Receives posted ahead]
// Gloo moves a message once its receive is posted. Posting each receive only
// when its action comes would add a round trip (the receiver's "ready", then
// the data) to every hop of the pipeline's critical path; instead the
// receives of the next kLookahead actions are posted early, into buffers of
// the agreed shapes, so data lands while this rank computes. Before shapes
// are agreed (the first step) receives are posted at their action. Between
// stages on one host the group's shared-memory rings carry the data instead
// (src/comm/shm_p2p.cpp): a send lands in the ring whether or not its receive
// is posted, and posting ahead only fixes the buffers early.
constexpr std::size_t kLookahead = 8;

void Pipeline::Impl::post_ahead(const std::vector<Action>& actions, std::size_t from) {
  if (exchange_meta) return;
  for (std::size_t k = from; k < std::min(actions.size(), from + kLookahead); ++k) {
    const Action& a = actions[k];
    const bool activation = a.kind == ActionKind::kRecvActivation;
    if (!activation && a.kind != ActionKind::kRecvGradient) continue;
    const auto key = std::make_tuple(int(a.kind), a.stage, a.micro);
    if (posted.count(key)) continue;
    const auto& metas = activation ? input_meta : output_meta;
    auto meta = metas.find(a.stage);
    if (meta == metas.end()) continue;
    at::Tensor buffer = empty_of(meta->second, group.device());
    const int peer = schedule.rank_of_stage(activation ? a.stage - 1 : a.stage + 1);
    dist::Work work = group.irecv(buffer, peer, tag(activation ? kActivation : kGradient, a.stage, a.micro));
    posted.emplace(key, std::make_pair(std::move(work), buffer));
  }
}

void Pipeline::Impl::recv(const Action& a) {
  Micro& mb = at(a.stage, a.micro);
  const bool activation = a.kind == ActionKind::kRecvActivation;
  at::Tensor buffer;
  auto ahead = posted.find(std::make_tuple(int(a.kind), a.stage, a.micro));
  if (ahead != posted.end()) {
    buffer = ahead->second.second;
    ahead->second.first.wait();
    posted.erase(ahead);
  } else {
    const int peer = schedule.rank_of_stage(activation ? a.stage - 1 : a.stage + 1);
    if (activation && exchange_meta && a.micro == 0) {
      at::Tensor header = at::empty({kMetaLength}, at::TensorOptions(at::kLong).device(group.device()));
      group.recv(header, peer, tag(kMeta, a.stage, 0));
      input_meta[a.stage] = meta_from(header);
    }
    buffer = empty_of((activation ? input_meta : output_meta).at(a.stage), group.device());
    group.recv(buffer, peer, tag(activation ? kActivation : kGradient, a.stage, a.micro));
  }
  if (activation) {
    if (training && at::isFloatingType(buffer.scalar_type())) buffer.requires_grad_(true);
    mb.input = buffer;
  } else {
    mb.grad_output = buffer;
  }
}

// After the appliers' end_step (the modules' gradients averaged over the
// data group, or reduce-scattered into shards): the borrowers' tied copies,
// which no applier sees, are averaged here where parameters are replicated
// (one coalesced all-reduce; sharded, see exchange_ties()), then the two
// ranks of each tie combine their (averaged) gradients (averaging is linear,
// so the order does not matter).
void Pipeline::Impl::finish_gradients() {
  if (data_parallel() && !sharded) {
    std::vector<at::Tensor> grads;
    for (const auto& [k, j] : borrowed) {
      const at::Tensor& param = stages[k].tied[j].parameter;
      if (!param.grad().defined()) param.mutable_grad() = at::zeros_like(param);
      grads.push_back(param.grad());
    }
    if (!grads.empty()) options.data_parallel_group->all_reduce_coalesced(grads, dist::ReduceOp::kAvg).wait();
  }
  exchange_ties();
}

// Replicated: each tie's two ranks swap their gradients and both add.
// Sharded, the owner's copy is a module parameter its applier has
// reduce-scattered into shards, so the borrower (whose copy is not stepped:
// parameters() leaves it out) sends its data-averaged gradient to the owner,
// whose applier adds it to its shards' pieces (add_gradient); the borrower's
// copy then gets the owner's weight at the start of each step
// (refresh_borrowed_weights).
void Pipeline::Impl::exchange_ties() {
  for (std::size_t k = 0; k < stages.size(); ++k) {
    const int stage = schedule.stages_of_rank(rank)[k];
    for (std::size_t j = 0; j < stages[k].tied.size(); ++j) {
      const TiedParameter& tied = stages[k].tied[j];
      at::Tensor param = tied.parameter;
      const int peer = schedule.rank_of_stage(tied.other_stage);
      if (peer == rank) continue;  // both stages here: one tensor, autograd summed it
      const int t = tie_tag(kTieGradient, tied.owner ? stage : tied.other_stage, j);
      if (sharded) {
        if (!tied.owner) {
          if (!param.grad().defined()) param.mutable_grad() = at::zeros_like(param);
          options.data_parallel_group->all_reduce(param.mutable_grad(), dist::ReduceOp::kAvg).wait();
          group.send(param.mutable_grad(), peer, t);
          param.mutable_grad() = at::Tensor();  // not stepped, so nobody else clears it
          continue;
        }
        at::Tensor other = at::empty(param.sizes(), param.options());
        group.recv(other, peer, t);
        syncs[k]->add_gradient(param, other);
        continue;
      }
      if (!param.grad().defined()) param.mutable_grad() = at::zeros_like(param);
      at::Tensor other = at::empty_like(param.grad());
      // One exchange, both ways at once; a + b == b + a in IEEE arithmetic,
      // so both copies get bitwise the same sum.
      at::Tensor mine = param.grad().contiguous();
      dist::Work sent = group.isend(mine, peer, t);
      group.recv(other, peer, t);
      sent.wait();
      param.mutable_grad().copy_(mine + other);
    }
  }
}

// Sharded: the owner's applier brings its full parameters up to date (after
// an optimizer step changed the shards) and the owner sends each tied weight
// to its borrower, which copies it into its copy before anything runs.
void Pipeline::Impl::refresh_borrowed_weights() {
  for (std::size_t k = 0; k < stages.size(); ++k) {
    const int stage = schedule.stages_of_rank(rank)[k];
    for (std::size_t j = 0; j < stages[k].tied.size(); ++j) {
      const TiedParameter& tied = stages[k].tied[j];
      const int peer = schedule.rank_of_stage(tied.other_stage);
      if (peer == rank) continue;
      const int t = tie_tag(kTieWeight, tied.owner ? stage : tied.other_stage, j);
      at::NoGradGuard no_grad;
      if (tied.owner) {
        begin(k);
        syncs[k]->gather_parameters();
        group.send(tied.parameter.detach().contiguous(), peer, t);
      } else {
        at::Tensor weight = at::empty_like(tied.parameter);
        group.recv(weight, peer, t);
        tied.parameter.detach().copy_(weight);
      }
    }
  }
}

std::vector<at::Tensor> Pipeline::parameters() const {
  return impl_->parameters();
}

std::vector<at::Tensor> Pipeline::Impl::parameters() const {
  std::vector<at::Tensor> all;
  if (sharded) {
    for (const auto& sync : syncs) {
      for (const at::Tensor& shard : sync->parameters()) all.push_back(shard);
    }
    return all;
  }
  for (const auto& params : stage_params) {
    for (const at::Tensor& param : params) {
      const bool seen = std::any_of(all.begin(), all.end(), [&](const at::Tensor& t) { return t.is_same(param); });
      if (!seen) all.push_back(param);
    }
  }
  return all;
}

const GradientSet& Pipeline::gradient_set() const {
  return impl_->counted_gradients;
}

void Pipeline::zero_grad() {
  Impl& s = *impl_;
  for (const auto& sync : s.syncs) sync->zero_grad();
  // The borrowers' copies; the owners' are module parameters, cleared above
  // by their applier (which may keep them as views of its buffers).
  for (const auto& [k, j] : s.borrowed) s.stages[k].tied[j].parameter.mutable_grad() = at::Tensor();
}

std::vector<ShardedDataParallel*> Pipeline::sharded_stages() {
  std::vector<ShardedDataParallel*> all;
  for (auto& sync : impl_->syncs) {
    if (ShardedDataParallel* engine = sync->zero_engine()) all.push_back(engine);
  }
  return all;
}

std::vector<std::size_t> plan_stages(const torch::nn::Sequential& layers, int stage_count, std::vector<LayerCost> costs,
                                     const std::vector<std::int64_t>& budgets) {
  const auto count = static_cast<int>(layers->size());
  DTRAIN_CHECK(stage_count >= 1 && count >= stage_count, ConfigError,
               "cannot cut " << count << " layers into " << stage_count << " pipeline stages",
               "use at most as many stages (ranks x stages per rank) as layers");
  if (costs.empty()) {
    const auto named = layers->named_children();
    for (const auto& item : named) {
      LayerCost cost{.name = item.key()};
      for (const at::Tensor& param : item.value()->parameters()) cost.bytes += param.numel() * param.element_size();
      costs.push_back(cost);
    }
  }
  Placement plan = plan_placement(costs, static_cast<std::size_t>(stage_count), budgets);
  std::vector<std::size_t> stage_of = plan.device_of_layer;
  // The planner may leave a device empty; a stage needs a layer. Shift
  // boundaries so that stage k starts no earlier than layer k and no later
  // than count - (stage_count - k).
  std::vector<int> first(stage_count, count);
  for (int l = count - 1; l >= 0; --l) first[stage_of[l]] = l;
  for (int k = stage_count - 1; k >= 0; --k) {
    if (k + 1 < stage_count) first[k] = std::min(first[k], first[k + 1] - 1);
    first[k] = std::min(first[k], count - (stage_count - k));
  }
  first[0] = 0;
  for (int k = 1; k < stage_count; ++k) first[k] = std::max(first[k], first[k - 1] + 1);
  for (int k = 0; k < stage_count; ++k) {
    const int end = k + 1 < stage_count ? first[k + 1] : count;
    for (int l = first[k]; l < end; ++l) stage_of[l] = static_cast<std::size_t>(k);
  }
  return stage_of;
}

std::vector<torch::nn::Sequential> split_stages(const torch::nn::Sequential& layers,
                                                const std::vector<std::size_t>& stage_of_layer) {
  DTRAIN_CHECK(stage_of_layer.size() == layers->size(), ConfigError,
               "stage assignment has " << stage_of_layer.size() << " entries for " << layers->size() << " layers",
               "give one stage index per layer");
  const std::size_t count = stage_of_layer.empty() ? 0 : stage_of_layer.back() + 1;
  std::vector<torch::nn::Sequential> stages(count);
  const auto named = layers->named_children();
  std::size_t l = 0;
  for (auto it = layers->begin(); it != layers->end(); ++it, ++l) {
    DTRAIN_CHECK(l == 0 || stage_of_layer[l] == stage_of_layer[l - 1] || stage_of_layer[l] == stage_of_layer[l - 1] + 1,
                 ConfigError, "stage assignment is not contiguous at layer " << l,
                 "stages take consecutive runs of layers, in order");
    stages[stage_of_layer[l]]->push_back(named[l].key(), *it);
  }
  return stages;
}

at::Tensor Pipeline::clip_grad_norm_(double max_norm, const ClipGradNormOptions& options) {
  const GradientSet& counted = gradient_set();
  at::Tensor norm = dtrain::clip_grad_norm_(counted, max_norm, options);
  // Sharded: the borrowers' copies are not stepped, and the owners' module
  // gradients may alias the shards' (stage 1): nothing more to scale.
  if (impl_->sharded) return norm;
  // clip.cpp's factor, spelled the same way, for the copies it did not see.
  const at::Tensor factor = at::clamp(norm.add(1e-6).reciprocal().mul(max_norm), std::nullopt, 1.0);
  const std::vector<at::Tensor>& seen = counted.parameters;
  at::NoGradGuard no_grad;
  for (const PipelineStage& stage : impl_->stages) {
    for (const TiedParameter& tied : stage.tied) {
      const at::Tensor& param = tied.parameter;
      const bool clipped = std::any_of(seen.begin(), seen.end(), [&](const at::Tensor& t) { return t.is_same(param); });
      if (!clipped && param.grad().defined()) param.grad().mul_(factor.to(param.grad().scalar_type()));
    }
  }
  return norm;
}

const Schedule& Pipeline::schedule() const {
  return impl_->schedule;
}
const std::vector<PipelineStage>& Pipeline::stages() const {
  return impl_->stages;
}
const dist::ProcessGroup& Pipeline::group() const {
  return impl_->group;
}
int Pipeline::peak_activations() const {
  return impl_->peak;
}
const std::vector<TracedAction>& Pipeline::trace() const {
  return impl_->trace;
}

}  // namespace dtrain::pipeline
