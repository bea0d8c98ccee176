// The cost model: memory by rank, step time by replay (cost_model.h).
#include "dtrain/plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <tuple>

#include "dtrain/error.h"
#include "dtrain/plan/replay.h"
#include "layer_cost.h"
#include "replay_memo.h"

namespace dtrain::plan {

std::string format_bytes(double bytes) {
  // GiB from 1 GiB up, else MiB, else KiB: a small model's "0.0 GiB" told a
  // user nothing (the exact byte count is beside it where it matters).
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB"};
  int unit = 0;
  double value = bytes / 1024.0;
  while (unit < 2 && std::abs(value) >= 1024.0) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", value, kUnits[unit]);
  return buf;
}

// Note [Activation memory]
// Per token of one layer, in bytes at 2 bytes per element (Korthikanti et
// al. 2022, section 4, generalised to grouped KV heads and gated MLPs):
//  - replicated across tp unless sequence parallel ("R"): the two norms'
//    inputs 4h, the QKV and MLP inputs 2h each, dropout masks 2h (1 byte
//    each); eager kernels also keep each norm's fp32 input (8h in all);
//  - divided by tp ("S"): Q, K, V 2(h + 2kv), the attention output 2h, the
//    MLP's inner activations 4f (GeLU: its input and output), 6f (fused
//    SwiGLU) or 8f (eager SwiGLU);
//  - scores, materialised attention only: softmax output, dropout mask and
//    output, 5 a s per token (divided by tp); flash keeps 4 a (log-sum-exp).
// For GPT (kv = h, f = 4h) that is sbh(34 + 5as/h) without parallelism and
// sbh/t (34 + 5as/h) with tp = t and sequence parallelism. Selective
// recompute drops the scores (Megatron) or, with flash attention, keeps only
// the layer input, the attention output and every second GEMM output
// (torchtitan's op-level policy); full recompute keeps the layer input (2h).
double layer_activation_bytes(const ModelSpec& m, const ActivationShape& a) {
  const double e = a.bytes_per_element, t = a.tp, h = m.hidden, kv = m.kv_width(), f = m.ffn;
  const double tokens = static_cast<double>(a.micro_batch) * m.seq / a.cp;
  const double r_div = a.sequence_parallel ? t : 1;
  const bool eager = m.kernels == Kernels::kEager, flash = m.attention == Attention::kFlash;
  const double mlp = m.gated_mlp ? (eager ? 8 : 6) * f : 4 * f;
  // Eager kernels keep each norm's fp32 input only where activations are
  // 16-bit (autocast's cast); in fp32 that input is the one counted above.
  const double r_none = 8 * h * e / 2 + (m.dropout ? 2 * h : 0) + (eager && e == 2 ? 8 * h : 0);
  const double s_none = (2 * (h + 2 * kv) + 2 * h + mlp) * e / 2;
  const double scores = flash ? 4.0 * m.heads : static_cast<double>(m.heads) * m.seq * (m.dropout ? 2 * e + 1 : e);
  switch (a.recompute) {
    case Recompute::kNone: return tokens * (r_none / r_div + (s_none + scores) / t);
    case Recompute::kFull: return tokens * h * e / r_div;
    case Recompute::kSelective:
      if (!flash) return tokens * (r_none / r_div + s_none / t);
      return tokens * ((2 * h + 2 * h) * e / 2 / r_div +
                       ((2 * h + 0.5 * (2 * h + 4 * kv + (m.gated_mlp ? 4 : 2) * f)) * e / 2 + scores) / t);
  }
  return 0;
}

// Note [Captured gradients]
// The split backward (src/parallel/pipeline/split_backward.h) runs I as the
// input's gradient only and keeps, for W, the gradient arriving at each node
// of the input path that also leads to weights: per token of one layer, the
// two norms' outputs 2h (divided by tp under sequence parallelism), the
// column-parallel GEMMs' outputs, QKV (h + 2kv) and the MLP's input f (2f
// gated), divided by tp, and the row-parallel GEMMs' outputs, the attention
// projection's and the MLP's, h each (before their all-reduce every tp rank
// holds all of h). Bias additions are not counted (a bias fused into its
// GEMM adds no node).
double layer_captured_gradient_bytes(const ModelSpec& m, const ActivationShape& a) {
  const double e = a.bytes_per_element, t = a.tp, h = m.hidden, kv = m.kv_width(), f = m.ffn;
  const double tokens = static_cast<double>(a.micro_batch) * m.seq / a.cp;
  const double r_div = a.sequence_parallel ? t : 1;
  return tokens * e * (2 * h / r_div + (h + 2 * kv + (m.gated_mlp ? 2 : 1) * f) / t + 2 * h);
}

// The nodes of a layer whose output gradient the split backward captures
// (as above): the two norms, QKV, the attention projection, the MLP's up
// (and gate) and down GEMMs. The last stage adds the final norm and the
// output layer (2).
namespace {
int captured_nodes_per_layer(const ModelSpec& m) {
  return 6 + (m.gated_mlp ? 1 : 0);
}
}  // namespace

// Note [Gradient lifetimes]
// When gradients exist, under dtrain's engines (CostOptions::
// ddp_buckets_copy_gradients; measured per phase on examples/gpt):
//  - the Trainer's zero_grad sets gradients to none before each step, so a
//    DDP (or tp, cp, single) rank holds none at the start of its first
//    backward, where activations peak, only DDP's buckets, which live with
//    the engine; a pipeline stage's appear at its first B (or W) of the step;
//  - ZeRO-1 keeps one flat full-gradient buffer per unit for the engine's
//    life (the module's gradients alias it), reduced in place; the reduce-
//    scatter's output, a shard, is copied back into it but stays held by
//    the reduce-scatter's Work until the next backward replaces it;
//  - ZeRO-2 moves a unit's gradients into its reduce-scatter input when
//    they are complete (no copy beside them); the output, its shards'
//    gradients, stays held likewise, zero_grad notwithstanding;
//  - ZeRO-3: as ZeRO-2, and the unit's unsharded gradient among its buffers.
// Megatron's gradients are views of one buffer that lives through the step.

namespace {

struct BytesPerParam {
  double weights, grads, optimizer;
};

BytesPerParam bytes_per_param(const ParallelPlan& p, const CostOptions& o) {
  if (p.precision == "fp32" || o.weights == WeightLayout::kFp32Master) return {4, 4, 8};
  return {2, 2, 12};
}

// Note [Pipeline memory from the action list]
// What dtrain's executor (src/parallel/pipeline/pipeline.cpp) holds on a
// rank, walked over the rank's action list (its order is fixed whatever the
// durations, so the walk is done once per schedule):
//  - a (stage, micro-batch)'s activations from its F to its B, or under the
//    split backward (ZB) to its W: I keeps the graph (retain_graph) for W;
//  - under ZB, from I to W, the gradients I captured where the input path
//    meets the weights (each weight GEMM's and norm's output gradient), from
//    which W runs (split_backward.h); not on the first stage, whose input is
//    token ids: its I does nothing and its W runs the whole backward;
//  - boundary tensors (one micro-batch's tokens x hidden): a stage's output
//    sent to the next rank, from its F to the end of the step (the executor
//    waits for its sends, and so keeps their tensors, at the end of the
//    step); a gradient sent to the previous rank, from its B or I to the end
//    of the step; a receive buffer, from when it is posted (kLookahead
//    actions ahead, Note [Receives posted ahead]) to its F (then it is the
//    stage's input, among the activations) or, for a gradient, to the end
//    of the B or W that uses it;
//  - during a B (an I, or the first stage's W), the backward's working
//    memory (Holding::backward, Note [Backward working memory]);
//  - the stages whose gradients exist: from a stage's first B (or W) on,
//    until zero_grad at the next step (Note [Gradient lifetimes]).
// Each moment's holdings are counts; the estimate weighs them with the
// layer shapes and takes the largest sum. The moments no other one
// dominates are kept (a handful per rank).
constexpr std::size_t kExecutorLookahead = 8;  // pipeline.cpp's kLookahead
constexpr double kMetaBytes = 80;              // a pipeline step's small exchanges: ~10 int64 or one float

struct Holding {
  int acts = 0;           // (stage, micro-batch) activation sets
  int last_acts = 0;      // of them, the last stage's (logits and loss)
  int captures = 0;       // ZB: (stage, micro-batch)s between I and W
  int last_captures = 0;  // of them, the last stage's (the logits' gradient)
  int boundary = 0;       // tokens x hidden tensors: sent, received, posted
  // Inside a backward (its working memory): 0 no, 1 of a stage, 2 of the
  // last stage (whose working memory also holds the logits' gradient).
  int backward = 0;
  int grads = 0;  // the rank's stages whose gradients exist (from their first B or W)
  bool dominated_by(const Holding& o) const {
    return acts <= o.acts && last_acts <= o.last_acts && captures <= o.captures && last_captures <= o.last_captures &&
           boundary <= o.boundary && backward <= o.backward && grads <= o.grads;
  }
};

// Note [Undominated moments]
// A rank's moments (one per action) are kept when no other moment holds as
// much of everything, and of equal moments only the first: moment k stays
// unless an earlier one holds at least as much or a later one holds at least
// as much and more of something. Kept as they come, that is a front: a new
// moment is dropped when one on the front holds at least as much (the earlier
// moment that did is on it, or was dropped for one that holds more still),
// else it drops the front's moments it holds more than and joins at the end.
// The front stays a handful long, so a rank of a long schedule costs its
// length times that, not its length squared (71 % of the search's time for
// GPT 145.6B on 1,024 GPUs: thousands of micro-batches on up to 64 ranks).
// The kept moments and their order are those of comparing every pair.
void keep_if_undominated(std::vector<Holding>& front, const Holding& h) {
  for (const Holding& f : front)
    if (h.dominated_by(f)) return;
  std::erase_if(front, [&](const Holding& f) { return f.dominated_by(h); });
  front.push_back(h);
}

std::vector<Holding> walk_holdings(const pipeline::Schedule& s, int rank) {
  using pipeline::ActionKind;
  const auto& list = s.actions[rank];
  const int n = s.stage_count();
  auto remote = [&](int stage) { return stage >= 0 && stage < n && s.rank_of_stage(stage) != rank; };
  std::vector<bool> posted(list.size(), false);
  Holding now;
  std::vector<bool> has_grads(n, false);
  auto gradients_of = [&](int stage) {
    if (!has_grads[stage]) ++now.grads;
    has_grads[stage] = true;
  };
  std::vector<Holding> kept;  // the undominated moments so far, in the order they came
  auto record = [&](int backward) {
    Holding h = now;
    h.backward = backward;
    keep_if_undominated(kept, h);
  };
  for (std::size_t k = 0; k < list.size(); ++k) {
    for (std::size_t j = k; j < std::min(list.size(), k + kExecutorLookahead); ++j) {
      const ActionKind kind = list[j].kind;
      if (!posted[j] && (kind == ActionKind::kRecvActivation || kind == ActionKind::kRecvGradient)) {
        posted[j] = true;
        ++now.boundary;
      }
    }
    const pipeline::Action& a = list[k];
    const bool last = a.stage == n - 1;
    switch (a.kind) {
      case ActionKind::kForward:
        ++now.acts;
        now.last_acts += last;
        if (remote(a.stage - 1)) --now.boundary;  // the received buffer is the stage's input now
        if (remote(a.stage + 1)) ++now.boundary;  // the output, kept by its send
        record(0);
        break;
      case ActionKind::kBackward:
        record(last ? 2 : 1);
        gradients_of(a.stage);
        --now.acts;
        now.last_acts -= last;
        if (remote(a.stage + 1)) --now.boundary;  // the received gradient
        if (remote(a.stage - 1)) ++now.boundary;  // the input's gradient, kept by its send
        break;
      case ActionKind::kBackwardInput:
        if (a.stage == 0) break;  // no input path: nothing runs until W
        record(last ? 2 : 1);
        ++now.captures;
        now.last_captures += last;
        if (remote(a.stage - 1)) ++now.boundary;
        break;
      case ActionKind::kBackwardWeight:
        record(a.stage == 0 ? 1 : 0);  // the first stage's W is its whole backward
        gradients_of(a.stage);
        --now.acts;
        now.last_acts -= last;
        if (a.stage > 0) {
          --now.captures;
          now.last_captures -= last;
        }
        if (remote(a.stage + 1)) --now.boundary;
        break;
      default: break;
    }
  }
  record(0);
  return kept;
}

struct CachedSchedule {
  ReplayProgram program;                       // Note [Compiled replay] (replay.cpp)
  std::vector<std::vector<Holding>> holdings;  // per rank: its undominated moments
};

// Generating (and validating) a schedule costs more than replaying it: the
// search asks for the same few thousand again and again. The schedule itself
// is not kept: its holdings and its compiled replay are all a plan needs.
const CachedSchedule& cached_schedule(pipeline::ScheduleKind kind, int p, int v, int m) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int>, CachedSchedule> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(static_cast<int>(kind), p, v, m);
  auto it = cache.find(key);
  if (it == cache.end()) {
    const auto schedule = pipeline::make_schedule({.kind = kind, .ranks = p, .stages_per_rank = v, .micro_batches = m});
    CachedSchedule c{compile_replay(schedule), {}};
    for (int r = 0; r < p; ++r) c.holdings.push_back(walk_holdings(schedule, r));
    it = cache.emplace(key, std::move(c)).first;
  }
  return it->second;
}

// Layers of each stage: an even split, the first stages taking the rest.
std::vector<std::int64_t> layers_per_stage(std::int64_t layers, int stages) {
  std::vector<std::int64_t> out(stages, layers / stages);
  for (std::int64_t s = 0; s < layers % stages; ++s) ++out[s];
  return out;
}

}  // namespace

double PlanEstimate::peak() const {
  return peak_memory_bytes.empty() ? 0 : *std::max_element(peak_memory_bytes.begin(), peak_memory_bytes.end());
}

PlanEstimate estimate(const ParallelPlan& plan, const ModelSpec& model, const Cluster& cluster,
                      const CostOptions& options) {
  return detail::estimate(plan, model, cluster, options, nullptr);
}

PlanEstimate detail::estimate(const ParallelPlan& plan, const ModelSpec& model, const Cluster& cluster,
                              const CostOptions& options, ReplayMemo* memo) {
  plan.check_well_formed(
      {.world = cluster.gpus,
       .model = {.layers = model.layers, .heads = model.heads, .width = model.hidden, .seq = model.seq}});
  DTRAIN_CHECK(plan.global_batch > 0, ConfigError, "the plan has no global batch.", "give --global-batch");
  DTRAIN_CHECK(model.heads % plan.tp == 0 && model.kv_heads % plan.tp == 0 && model.ffn % plan.tp == 0, ConfigError,
               "tp " << plan.tp << " does not divide the heads, KV heads and FFN width (" << model.heads << ", "
                     << model.kv_heads << ", " << model.ffn << ").",
               "choose a tp dividing all three");
  // A CPU host's ranks share its cores: more ranks than cores divide them.
  DeviceSpec dev = cluster.device;
  const int local = std::min(cluster.gpus_per_node, cluster.gpus);  // this plan's ranks on one host
  // ... and its last-level cache, whatever their number.
  if (dev.compute_units > 0) dev.cache_bytes /= local;
  if (dev.compute_units > 0) {
    // Ranks computing at once slow each other (calibrated; one process runs alone).
    double slowdown = local >= 2 ? std::max(1.0, dev.concurrency_factor) : 1.0;
    const double share = static_cast<double>(dev.compute_units) / local;
    if (share < 1) {
      dev.bf16_flops *= share;
      dev.fp32_flops *= share;
      dev.fp8_flops *= share;
      dev.memory_bandwidth *= share;
      dev.cache_bandwidth *= share;
      dev.optimizer_bandwidth *= share;
      dev.kernel_overhead /= share;  // a CPU's launches are its cores' work too
      dev.gemm_overhead /= share;
      dev.split_backward_overhead /= share;
      // Time slicing costs each rank CPU time of its own (calibrated).
      slowdown *= std::max(1.0, dev.oversubscription_factor);
      // ... and its collectives wait for peers switched out (calibrated).
      if (dev.oversubscribed_link.bandwidth > 0) dev.intra_node = dev.oversubscribed_link;
    }
    dev.bf16_flops /= slowdown;
    dev.fp32_flops /= slowdown;
    dev.fp8_flops /= slowdown;
    dev.memory_bandwidth /= slowdown;
    dev.cache_bandwidth /= slowdown;
    dev.optimizer_bandwidth /= slowdown;
    dev.kernel_overhead *= slowdown;
    dev.gemm_overhead *= slowdown;
    dev.split_backward_overhead *= slowdown;
  }
  Cluster host = cluster;  // its links as this plan's ranks see them
  host.device = dev;
  // Note [Communication on a CPU host]
  // A CPU host's collectives and sends are its cores' work (the transport's
  // copies through shared memory, the reductions): with at least as many
  // ranks as cores no core is free to run them beside the compute, so what a
  // GPU overlaps (DDP's buckets during backward, ZeRO-3's prefetched gathers,
  // context parallelism's ring exchange behind the attention core) adds to
  // the step here. A GPU (compute_units 0) overlaps as before.
  const bool overlap = dev.compute_units == 0 || local < dev.compute_units;
  // ... and with more ranks than cores a wait for a peer runs another rank
  // (Note [Collectives issued ahead on time-sliced ranks]).
  const bool time_sliced = dev.compute_units > 0 && local > dev.compute_units;
  const bool pipelined = plan.pp > 1;
  const int m = pipelined ? plan.pipeline.micro_batches : 1;
  const int v = pipelined ? plan.pipeline.stages_per_rank : 1;
  const int micro_steps = pipelined ? 1 : plan.accumulate;
  PlanEstimate est;
  est.plan = plan;
  est.micro_batch = plan.local_batch() / m;
  DTRAIN_CHECK(est.micro_batch >= 1, ConfigError,
               "the plan's micro-batches hold " << plan.local_batch() << " / " << m << " sequences.",
               "choose fewer micro-batches or a larger global batch");
  // fp8: the GEMMs run at the device's fp8 rate, attention, element-wise
  // kernels and activations stay bf16 (Transformer Engine's recipe).
  DTRAIN_CHECK(plan.precision != "fp8" || dev.fp8_flops > 0, ConfigError,
               dev.name << " has no fp8 rate in the device table.", "plan it in bf16, or choose h100, h200 or b200");
  const int e = plan.precision == "fp32" ? 4 : 2;
  const double peak_flops = plan.precision == "fp32"  ? dev.fp32_flops
                            : plan.precision == "fp8" ? dev.fp8_flops
                                                      : dev.bf16_flops;
  const int tp = plan.tp, cp = plan.cp;
  const int shard = plan.zero_stage > 0 ? plan.dp_shard * cp : 1;
  const int replicate = plan.zero_stage > 0 ? plan.dp_replicate : plan.dp_replicate * cp;
  const Link& tp_link = host.link(tp, 1);
  const Link& cp_link = host.link(cp, tp);
  const Link& pp_link = host.link(plan.pp, plan.world() / plan.pp);
  const Link& shard_link = host.link(shard, tp);
  const Link& replicate_link = host.link(plan.dp_replicate, plan.dp_shard * cp * tp);
  const detail::LayerShape shape{.micro_batch = est.micro_batch,
                                 .tp = tp,
                                 .cp = cp,
                                 .sequence_parallel = plan.sequence_parallel,
                                 .recompute = plan.recompute,
                                 .bytes_per_element = e,
                                 .peak_flops = peak_flops,
                                 .attention_flops = plan.precision == "fp8" ? dev.bf16_flops : peak_flops,
                                 .tp_link = tp_link,
                                 .cp_link = cp_link,
                                 .overlap_comm = overlap};
  const auto layer = detail::layer_times(model, shape, dev);
  const auto out = detail::output_times(model, shape, dev);
  const auto emb = detail::embedding_times(model, shape, dev);
  const BytesPerParam bpp = bytes_per_param(plan, options);
  const double layer_params = static_cast<double>(model.layer_params()) / tp;

  // Stages and their times per micro-batch.
  const int stages = plan.pp * v;
  const bool split_backward =
      pipelined && pipeline::parse_schedule_kind(plan.pipeline.schedule) == pipeline::ScheduleKind::kZeroBubble;
  const auto stage_layers = layers_per_stage(model.layers, stages);
  std::vector<StageTimes> times(stages);
  std::vector<TimeBreakdown> parts(stages);  // per micro-batch
  for (int s = 0; s < stages; ++s) {
    const double n = static_cast<double>(stage_layers[s]);
    const bool first = s == 0, last = s == stages - 1;
    TimeBreakdown& b = parts[s];
    b.compute = n * (layer.forward + layer.backward_input + layer.backward_weight) +
                (first ? emb.forward + emb.backward_weight : 0) +
                (last ? out.forward + out.backward_input + out.backward_weight : 0);
    b.recompute = n * layer.recompute;
    b.tp_comm = n * (layer.tp_forward + layer.tp_backward + layer.tp_recompute) + (first ? emb.tp_forward : 0) +
                (last ? out.tp_forward + out.tp_backward : 0);
    b.cp_comm = n * layer.cp_exposed;
    StageTimes& t = times[s];
    t.forward = n * (layer.forward + layer.tp_forward + layer.cp_exposed / 2) +
                (first ? emb.forward + emb.tp_forward : 0) + (last ? out.forward + out.tp_forward : 0);
    t.backward_input =
        n * (layer.backward_input + layer.recompute + layer.tp_backward + layer.tp_recompute + layer.cp_exposed / 2) +
        (last ? out.backward_input + out.tp_backward : 0);
    t.backward_weight =
        n * layer.backward_weight + (first ? emb.backward_weight : 0) + (last ? out.backward_weight : 0);
    if (split_backward && !first) {
      // Note [Split backward cost] (calibration.cpp): W runs the engine once
      // per node whose gradient I captured (Note [Captured gradients]); the
      // first stage has no input path, its W is the whole backward.
      const double split = (n * captured_nodes_per_layer(model) + (last ? 2 : 0)) * dev.split_backward_overhead;
      t.backward_weight += split;
      b.compute += split;
    }
    if (plan.zero_stage == 3 && shard > 1) {
      // Every micro-batch gathers the stage's weights in forward and again in
      // backward, and reduce-scatters its gradients; prefetch hides them
      // behind compute except the first layer's gather.
      // One gather (and one reduce-scatter) per unit: each layer, and the
      // stage's root unit (the embedding on the first stage, the output
      // layer and final norm on the last), so each pays its own latency.
      const double root = (first ? static_cast<double>(model.embedding_params()) : 0.0) +
                          (last ? static_cast<double>(model.output_params()) : 0.0);
      const double unit = detail::gather_seconds(layer_params * e, shard, shard_link);
      const double gather = n * unit + detail::gather_seconds(root / tp * e, shard, shard_link);
      const double scatter = n * detail::gather_seconds(layer_params * bpp.grads, shard, shard_link) +
                             detail::gather_seconds(root / tp * bpp.grads, shard, shard_link);
      double fwd_exposed = overlap ? std::max(0.0, gather - t.forward) + unit : gather;
      double bwd_exposed =
          overlap ? std::max(0.0, gather + scatter - t.backward_input - t.backward_weight) + unit : gather + scatter;
      if (time_sliced && n >= 1) {
        // Note [Collectives issued ahead on time-sliced ranks]
        // With more ranks than cores (a CPU host), a rank that waits for a
        // peer gives its core to another rank, so a collective costs the step
        // its wait only where every rank must meet: where one is issued and
        // waited for at once. dtrain's ZeRO-3 (src/parallel/zero) meets so
        // at the root unit's gather (the first of forward), at the first
        // layer's gather (issued as forward reaches it) and at the end of
        // backward (every reduction waited for); each other layer's gather
        // is issued a unit ahead and each reduce-scatter runs beside the rest
        // of backward, so they cost their transport's work (the bandwidth
        // term; the cores are the ranks') and not the hops' latency, and
        // each what a collective issued ahead of compute adds on
        // time-sliced ranks (DeviceSpec::oversubscribed_ahead_latency): a
        // peer behind by more than the piece between issue and wait holds
        // the waiter, and each wake-up costs the cores. Backward gathers the
        // layers but the last (which stays gathered from forward, and whose
        // backward prefetches the next); the root stays gathered through
        // backward.
        // Measured: on the Intel Xeon 6/167 VM of 2026-11-28 ZeRO-3 on 4
        // ranks stepped as fast as DDP on 4 (54.8-58.6 against 57.4-59.4 ms
        // in three tables), where every collective charged whole put it
        // 13-27 % above its measure; on a Zen 4 VM (2026-12-03) and a faster
        // Intel 6/167 VM (2026-12-04) it was 4-8 % and 1-6 % slower than DDP
        // in nearly every table, where the model without the ahead term put
        // it 1-3 ms faster (the optimizer's step on a quarter of the
        // parameters). examples/gpt on 4 ranks (40 steps, three rounds
        // in turn, 2026-12-04, Intel 6/167): four independent processes
        // 35.5 ms a step, DDP 44-45, ZeRO-3 45-47.5, where the model's
        // ZeRO-3 had 10 collectives issued ahead charged their work only;
        // the calibration's ahead rounds read 0.35-0.53 ms per collective in
        // nine calibrations (the after-compute ones 0.69-0.81 in two). DDP's and HSDP's waits at the
        // end of backward stay charged whole (grad_sync).
        const double ahead = dev.oversubscribed_ahead_latency;
        const double layer_work = detail::gather_work_seconds(layer_params * e, shard, shard_link) + ahead;
        // The root's reduce-scatter is not ahead of anything: its gradient
        // (the embedding's) completes last and is waited for at once, the
        // end-of-backward meeting below (ZeroEngine's order_).
        const double scatters = n;
        const double scatter_work = n * detail::gather_work_seconds(layer_params * bpp.grads, shard, shard_link) +
                                    detail::gather_work_seconds(root / tp * bpp.grads, shard, shard_link) +
                                    scatters * ahead;
        fwd_exposed = detail::gather_seconds(root / tp * e, shard, shard_link) + unit + (n - 1) * layer_work;
        bwd_exposed = (n - 1) * layer_work + scatter_work + detail::gather_latency_seconds(shard, shard_link);
      }
      t.forward += fwd_exposed;
      t.backward_input += bwd_exposed;
      b.zero3_comm = fwd_exposed + bwd_exposed;
    }
  }

  // Replay: the pipeline's action lists, or micro-steps one after another.
  int critical = 0;
  double makespan = 0;
  std::vector<double> busy(plan.pp, 0);
  // What each pipeline rank holds at its moments (Note [Pipeline memory from
  // the action list]): the cached schedule's, read in place (a copy per plan
  // was 4 % of a search); without a pipeline, one moment: a micro-step's
  // activations and logits at the start of its backward (the gradients of
  // earlier micro-steps there under accumulation).
  std::vector<std::vector<Holding>> one_moment;
  const std::vector<std::vector<Holding>>* holdings = &one_moment;
  if (pipelined) {
    const auto& cached = cached_schedule(pipeline::parse_schedule_kind(plan.pipeline.schedule), plan.pp, v, m);
    holdings = &cached.holdings;
    if (!options.memory_only) {
      const double p2p = detail::p2p_seconds(
          static_cast<double>(est.micro_batch) * model.seq / cp * model.hidden * e / (plan.sequence_parallel ? tp : 1),
          pp_link);
      const ReplayOptions replay_options{.stage = times, .p2p_seconds = p2p, .blocking_sends = options.blocking_p2p};
      const auto r =
          memo != nullptr ? memo->replay(cached.program, replay_options) : replay(cached.program, replay_options);
      makespan = r.makespan;
      busy = r.busy;
      critical = static_cast<int>(std::max_element(r.end.begin(), r.end.end()) - r.end.begin());
    }
  } else {
    one_moment.assign(1, {Holding{.acts = 1, .last_acts = 1, .backward = 2, .grads = micro_steps > 1 ? 1 : 0}});
    makespan = micro_steps * (times[0].forward + times[0].backward_input + times[0].backward_weight);
    busy[0] = makespan;
  }

  // Per pipeline rank: parameters held, and memory.
  std::vector<double> rank_params(plan.pp, 0);
  est.peak_memory_bytes.assign(plan.pp, 0);
  const ActivationShape act_shape{.micro_batch = est.micro_batch,
                                  .tp = tp,
                                  .cp = cp,
                                  .sequence_parallel = plan.sequence_parallel,
                                  .recompute = plan.recompute,
                                  .bytes_per_element = e};
  ActivationShape none_shape = act_shape;
  none_shape.recompute = Recompute::kNone;
  const double none_layer = layer_activation_bytes(model, none_shape);
  const double kept_layer = layer_activation_bytes(model, act_shape);
  const double captured_layer = layer_captured_gradient_bytes(model, act_shape);
  const double tokens = static_cast<double>(est.micro_batch) * model.seq / cp;
  const double logits = tokens * static_cast<double>(model.vocab) / tp;
  const double boundary = tokens * model.hidden * e / (plan.sequence_parallel ? tp : 1);
  std::vector<MemoryBreakdown> memory(plan.pp);
  for (int r = 0; r < plan.pp; ++r) {
    std::int64_t layers = 0;
    bool first = false, last = false;
    for (int s = r; s < stages; s += plan.pp) {
      layers += stage_layers[s];
      first = first || s == 0;
      last = last || s == stages - 1;
    }
    double params = static_cast<double>(layers) * layer_params;
    if (first) params += static_cast<double>(model.embedding_params()) / tp;
    if (last) params += static_cast<double>(model.output_params()) / tp;
    if (last && model.tied_embeddings && stages > 1) params += static_cast<double>(model.vocab * model.hidden) / tp;
    rank_params[r] = params;
    MemoryBreakdown& mem = memory[r];
    const bool dtrain_engines = options.ddp_buckets_copy_gradients;
    const double all_grads = params * bpp.grads;
    mem.params = params * bpp.weights / (plan.zero_stage == 3 ? shard : 1);
    mem.grads = params * bpp.grads / (plan.zero_stage >= 2 ? shard : 1);
    mem.optimizer = params * bpp.optimizer / (plan.zero_stage >= 1 ? shard : 1);
    if (plan.zero_stage == 3 && shard > 1) {
      mem.buffers += (1 + options.zero3_prefetch_units) * layer_params * e + layer_params * bpp.grads;
    } else if (plan.data_parallel() * cp > 1 && dtrain_engines) {
      // Note [Gradient lifetimes]: DDP's buckets, a copy of every gradient;
      // ZeRO-1's last reduce-scatter output, a shard of the gradients, held
      // (by its Work) to the next backward beside the flat buffer it was
      // copied back into; ZeRO-2's output is its shards' gradients (counted).
      if (plan.zero_stage == 0) mem.buffers += all_grads;
      if (plan.zero_stage == 1) mem.buffers += all_grads / shard;
    } else if (plan.data_parallel() * cp > 1) {
      // Megatron's gradients are views of its buffer, two buckets in flight.
      mem.buffers += 2.0 * std::min(static_cast<double>(options.ddp_bucket_bytes), all_grads);
    }
    if (tp > 1 && plan.sequence_parallel) mem.buffers += tokens * model.hidden * e;
    // Note [Backward working memory]
    // Inside a layer's backward, beyond what forward kept: the gradient of
    // the MLP's inner activation (tokens x ffn / tp; gated: both halves),
    // which its backward holds while it makes the gradient of the GEMM's
    // input, and the gradient of the layer's largest weight, a fresh tensor
    // until it is accumulated into (or becomes) the parameter's gradient
    // (the embedding's on the stages that hold it, if larger). The loss's
    // backward comes first, before any layer's: its moment holds the logits
    // and their gradient (6 bytes per logit), a layer's no longer this
    // micro-batch's logits.
    const double weight_elements = std::max({static_cast<double>(model.hidden) * model.ffn,
                                             static_cast<double>(model.hidden) * (model.hidden + 2 * model.kv_width()),
                                             first || last ? static_cast<double>(model.vocab) * model.hidden : 0.0});
    const double working = tokens * (model.gated_mlp ? 2 : 1) * model.ffn / tp * e + weight_elements / tp * bpp.grads;
    // Gradients under dtrain's engines (Note [Gradient lifetimes]): DDP's and
    // a pipeline stage's exist from the stage's first backward of a step on
    // (zero_grad sets them to none), ZeRO-1's flat buffer and ZeRO-2/3's
    // shards' gradients throughout.
    const bool grads_from_backward = dtrain_engines && plan.zero_stage == 0;
    // The largest of the rank's moments: per (stage, micro-batch) its layers'
    // activations (the last stage also its logits: the fp32 softmax, fused
    // cross-entropy 4 bytes per logit, eager 10), ZB's captured gradients
    // (the last stage's also the logits'), the boundary tensors, the
    // gradients that exist, and in a backward one layer's recomputed
    // activations and the loss's or a layer's working memory (above).
    const double per_stage_layers = static_cast<double>(layers) / v;
    const double kept_logits = logits * (model.kernels == Kernels::kEager ? 10 : 4);
    MemoryBreakdown best;
    double best_total = -1;
    auto consider = [&](const MemoryBreakdown& part) {
      if (part.total() > best_total) {
        best_total = part.total();
        best = part;
      }
    };
    for (const Holding& h : (*holdings)[r]) {
      MemoryBreakdown part;
      part.grads = grads_from_backward ? mem.grads * h.grads / v : mem.grads;
      part.activations = h.acts * per_stage_layers * kept_layer + (h.backward > 0 ? none_layer - kept_layer : 0);
      part.logits = last ? h.last_acts * kept_logits : 0;
      part.captured = h.captures * per_stage_layers * captured_layer + (last ? h.last_captures * logits * e : 0);
      part.buffers = h.boundary * boundary;
      if (h.backward == 0) {
        consider(part);
        continue;
      }
      MemoryBreakdown layer_moment = part;
      layer_moment.backward = working;
      if (h.backward == 2) {
        layer_moment.logits -= kept_logits;
        part.logits += 6 * logits;
        consider(part);
      }
      consider(layer_moment);
    }
    mem.grads = best.grads;
    mem.activations = best.activations;
    mem.logits = best.logits;
    mem.captured = best.captured;
    mem.backward = best.backward;
    mem.buffers += best.buffers;
    if (plan.zero_stage == 2 && shard > 1 && !pipelined && dtrain_engines) {
      // dtrain's ZeRO-2 (src/parallel/zero/zero_backward.cpp): a unit's full
      // gradients move into its reduce-scatter input as soon as they are
      // complete, so the start of backward, where the activations peak,
      // holds none of them; at its end, with the activations gone, every
      // unit's reduce-scatter input (all the gradients) is held at once. The
      // peak is the larger of the two.
      MemoryBreakdown end = mem;
      end.activations = end.logits = end.backward = 0;
      end.buffers = all_grads;
      if (end.total() > mem.total()) mem = end;
    }
    est.peak_memory_bytes[r] = mem.total() * options.allocator_factor;
  }
  const int worst = static_cast<int>(std::max_element(est.peak_memory_bytes.begin(), est.peak_memory_bytes.end()) -
                                     est.peak_memory_bytes.begin());
  est.memory = memory[worst];
  // A host's ranks share its memory (compute_units > 0: a CPU host).
  est.device_memory_bytes = dev.compute_units > 0 ? dev.memory_bytes / local : dev.memory_bytes;
  est.fits = est.peak() <= static_cast<double>(est.device_memory_bytes);
  if (options.memory_only) return est;

  // Gradient synchronisation and the optimizer step, on the critical rank.
  const double params = rank_params[critical];
  const double grad_bytes = params * bpp.grads;
  double sync = 0, after_step = 0;
  if (plan.zero_stage == 0) {
    sync = detail::all_reduce_seconds(grad_bytes, replicate, host.link(replicate, plan.dp_shard * tp));
  } else {
    if (plan.zero_stage < 3) sync = detail::gather_seconds(grad_bytes, shard, shard_link);
    if (plan.zero_stage == 3 && replicate > 1) {
      // HSDP: each unit's shard of the gradients is all-reduced over the
      // replicas as its reduce-scatter completes (Note [HSDP replica
      // all-reduce]), so each unit pays its own latency.
      double units = 0;
      for (int s = critical; s < stages; s += plan.pp) units += static_cast<double>(stage_layers[s]);
      const double per_layer = static_cast<double>(model.layer_params()) / tp * bpp.grads / shard;
      sync +=
          units * detail::all_reduce_seconds(per_layer, replicate, replicate_link) +
          detail::all_reduce_seconds(std::max(0.0, grad_bytes / shard - units * per_layer), replicate, replicate_link);
    } else {
      sync += detail::all_reduce_seconds(grad_bytes / shard, replicate, replicate_link);
    }
    if (plan.zero_stage < 3) after_step = detail::gather_seconds(params * bpp.weights, shard, shard_link);
  }
  double exposed = sync;
  if (options.overlap_grad_reduce && overlap && !pipelined && plan.zero_stage < 3 && sync > 0) {
    // Buckets reduce while the last micro-step's backward goes on; the last
    // bucket's reduction waits for the end of backward.
    const double window = times[0].backward_input + times[0].backward_weight;
    const double bucket = sync * std::min(1.0, static_cast<double>(options.ddp_bucket_bytes) / grad_bytes);
    exposed = std::max(bucket, sync - window);
  }
  if (pipelined) {
    // Note [Pipeline exchanges per step]
    // Besides its schedule's sends, dtrain's pipeline step exchanges over the
    // pipeline group: the micro-batch's shape, broadcast from the first
    // stage before any F (Pipeline::Impl::check_batch), and after the flush
    // the tied embedding's gradient between the first and the last stage
    // (exchange_ties: a send each way), the global norm for clipping
    // (one all-reduce) and the loss, broadcast from the last stage
    // (PipelineStrategy::forward_backward). Each small and latency-bound;
    // in a trace of 1F1B p = 2 here they took ~0.4 ms of the step. Megatron
    // does the same (its embedding and norm all-reduces over pp). A
    // broadcast costs like a gather ((p - 1) alpha), the all-reduce a ring's
    // 2 (p - 1). Not charged (docs/planner.md, Limits): under ZeRO-3 the
    // tied weight's send to its borrowers (refresh_borrowed_weights) and
    // their copies' all_reduce_coalesced.
    exposed += detail::all_reduce_seconds(kMetaBytes, plan.pp, pp_link) +
               2 * detail::gather_seconds(kMetaBytes, plan.pp, pp_link);
    if (model.tied_embeddings)
      exposed += detail::p2p_seconds(static_cast<double>(model.vocab * model.hidden) / tp * bpp.grads, pp_link);
  }
  if (options.ddp_buckets_copy_gradients && plan.data_parallel() * cp > 1) {
    // Note [Gradient passes of dtrain's engines]
    // What dtrain's engines (Note [Gradient lifetimes]) do to the gradients
    // around their reduction, in passes over them through memory, as the
    // optimizer's step is costed: DDP copies each gradient into its bucket
    // and the mean back (read and write each: 4); ZeRO-1 zeroes its flat
    // gradient buffer after a step, autograd accumulates into it (reads it
    // and the new gradient, writes it: 3 more than taking the new one), and
    // its averaged shard is copied back (2 / shard); ZeRO-2 and 3 copy the
    // gradients into the reduce-scatter input (2) and keep the output. On
    // the Intel Xeon 6/167 VM (2026-11-28, GPT example on 2 ranks) ZeRO-2
    // stepped 0.3-2.4 ms faster than ZeRO-1 in 6 tables of 6, where the model
    // without these passes predicted them equal and the search took ZeRO-1.
    const double passes = plan.zero_stage == 0 ? 4.0 : plan.zero_stage == 1 ? 4.0 + 2.0 / shard : 2.0;
    exposed += passes * grad_bytes / dev.memory_bandwidth;
  }
  const double sharded_params = params / (plan.zero_stage >= 1 ? shard : 1);
  // Note [Optimizer phase]
  // AdamW moves 28 bytes per local parameter (weight, gradient, two moments
  // read, three written back, fp32) and clipping by the global norm 12 more
  // (every gradient read for the norm, then scaled in place; Megatron,
  // torchtitan and the GPT example clip): the GPT example's optimizer phase
  // measures 0.7-0.9 ms here, 28 bytes alone gave 0.5. At the calibrated
  // `optimizer_bandwidth` where there is one (the phase timed as training
  // runs it), else from memory: the step touches each parameter's state
  // once, after forward and backward have streamed everything else through
  // it. On a faster Intel Xeon 6/167 VM (2026-12-04) the memory rate (a 192
  // MiB add, 15-22 GB/s) put the GPT example's phase at 1.5-2.0 ms where
  // bench_gpt_ops profiled 0.75 (fused AdamW 0.57 ms, the norms and the
  // scaling ~0.2) and the calibration's stack times 0.93-1.3 (with the
  // norm's read back and the step counts: 25-34 GB/s), its 13 MB of state
  // still in the last-level cache. Over-charged so, the optimizer made
  // ZeRO's sharded step look ~1 ms cheaper than DDP's on 2 ranks (measured
  // within 1-2 %) and DDP on 4 time-sliced ranks ~3 ms slower than it ran.
  const double optimizer_rate = dev.optimizer_bandwidth > 0 ? dev.optimizer_bandwidth : dev.memory_bandwidth;
  const double optimizer = kOptimizerBytesPerParam * sharded_params / optimizer_rate;

  TimeBreakdown& t = est.time;
  for (int s = critical; s < stages; s += plan.pp) {
    const double k = pipelined ? m : micro_steps;
    t.compute += k * parts[s].compute;
    t.recompute += k * parts[s].recompute;
    t.tp_comm += k * parts[s].tp_comm;
    t.cp_comm += k * parts[s].cp_comm;
    t.zero3_comm += k * parts[s].zero3_comm;
  }
  t.pipeline_idle = std::max(0.0, makespan - busy[critical]);
  t.grad_sync = exposed + after_step;
  // Note [Meetings of time-sliced ranks] (calibration.cpp): once a step,
  // whatever the plan's collectives; ranks with a core each meet too.
  t.meeting = time_sliced ? dev.oversubscribed_meeting : local >= 2 && dev.compute_units > 0 ? dev.meeting : 0.0;
  t.optimizer = optimizer;
  t.step = makespan + t.grad_sync + t.meeting + t.optimizer;
  est.step_seconds = t.step;

  const double step_tokens = static_cast<double>(plan.global_batch) * model.seq;
  est.tokens_per_second = step_tokens / t.step;
  est.tokens_per_second_per_gpu = est.tokens_per_second / cluster.gpus;
  const double redo_per_token = layer.hardware_flops - layer.model_flops;  // one layer, one micro-batch, this rank
  const double hw_per_token =
      model.model_flops_per_token() + static_cast<double>(model.layers) * redo_per_token * tp / tokens;
  est.tflops_per_gpu = hw_per_token * est.tokens_per_second_per_gpu / 1e12;
  est.mfu = model.model_flops_per_token() * est.tokens_per_second_per_gpu / peak_flops;

  // Bytes each rank sends per step, for ties.
  const double act = tokens * model.hidden * e;
  const double tp_calls = 4.0 + (plan.recompute == Recompute::kFull ? 2 : 0);
  double rank_layers = 0;
  for (int s = critical; s < stages; s += plan.pp) rank_layers += static_cast<double>(stage_layers[s]);
  est.comm_bytes = (tp > 1 ? tp_calls * rank_layers * m * micro_steps * act * 2 * (tp - 1) / tp : 0) +
                   (pipelined ? 2.0 * m * v * act / (plan.sequence_parallel ? tp : 1) : 0) + grad_bytes * 2 +
                   (plan.zero_stage == 3 ? 2.0 * m * micro_steps * params * e : 0);
  return est;
}

std::string PlanEstimate::to_json() const {
  nlohmann::json j;
  j["plan"] = nlohmann::json::parse(plan.to_json());
  j["micro_batch"] = micro_batch;
  j["peak_memory_bytes"] = peak_memory_bytes;
  j["device_memory_bytes"] = device_memory_bytes;
  j["fits"] = fits;
  j["step_seconds"] = step_seconds;
  j["tokens_per_second"] = tokens_per_second;
  j["tokens_per_second_per_gpu"] = tokens_per_second_per_gpu;
  j["tflops_per_gpu"] = tflops_per_gpu;
  j["mfu"] = mfu;
  j["memory"] = {{"params", memory.params},           {"grads", memory.grads},      {"optimizer", memory.optimizer},
                 {"activations", memory.activations}, {"logits", memory.logits},    {"captured", memory.captured},
                 {"buffers", memory.buffers},         {"backward", memory.backward}};
  j["time"] = {{"compute", time.compute},     {"recompute", time.recompute},   {"tp_comm", time.tp_comm},
               {"cp_comm", time.cp_comm},     {"zero3_comm", time.zero3_comm}, {"pipeline_idle", time.pipeline_idle},
               {"grad_sync", time.grad_sync}, {"meeting", time.meeting},       {"optimizer", time.optimizer}};
  j["comm_bytes"] = comm_bytes;
  return j.dump();
}

}  // namespace dtrain::plan
