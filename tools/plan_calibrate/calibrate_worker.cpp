// The worker `dtrain plan --calibrate` launches (plan_command.cpp), one
// process per rank under `dtrain run`: rank 0 times, with the host to
// itself (the other ranks asleep), three times over the run (the timing
// whose fp32 product rate is the median is kept), one thread's fp32 and bf16 matrix
// products at the GPT example's shapes (fp32: rate and per-call cost), its
// two attention kernels, streaming adds (memory and cache bandwidth) and a
// chain of tiny differentiable ops (per-kernel overhead); every rank then
// times what ranks computing at once cost (time slicing, contention on GPT
// layers, the split backward) and all_reduce and all_gather
// of 16 KiB .. 4 MiB over the world, by shared memory and by Gloo over
// loopback. Rank 0 writes one JSON object to --out: {"world", "fp32_flops",
// "gemm_overhead", "bf16_flops", "attention_flops",
// "materialized_attention_flops", "memory_bandwidth", "cache_bandwidth",
// "kernel_overhead", "backward_kernel_overhead", "layer": {micro_batch,
// seconds, attention}, "optimizer": {params, seconds}, "time_sliced_work_seconds",
// "alone_work_seconds", "after_compute": {wall_seconds, compute_wall_seconds,
// collective_seconds, collectives, bytes, and with more ranks than cores
// ahead_wall_seconds, ahead_collectives, ahead_bytes}, "split_backward": {whole_seconds, split_seconds,
// captured}, "layer_pipeline": {alone_seconds, together_seconds,
// together_over_alone}, "samples": [{transport, op, ranks, bytes, seconds}]},
// each figure the median of its repeats (time_sliced_work_seconds: a total,
// the ranks' mean; alone_work_seconds: the same piece on rank 0 while the
// others wait; split_backward: the second stage's B and I + W over a step
// on rank 0 alone, see layer_pipeline_times).
//
//   dtrain run --nproc-per-node 2 dtrain_plan_calibrate --out F
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/dtrain.h"
#include "dtrain/nn/attention.h"
#include "dtrain/nn/linear.h"
#include "dtrain/plan/device_table.h"

namespace {

using Clock = std::chrono::steady_clock;

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The upper median of `v` (0 when empty).
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Compute is timed in this thread's CPU time: on a host shared with other
// work (a loaded machine) that is still one core's rate, which wall time is
// not; on a quiet host the two agree. The cost model shares the cores among
// a plan's ranks itself (DeviceSpec::compute_units).
double median_seconds(int repeats, const std::function<void()>& once) {
  once();  // warm-up: first-touch pages, oneDNN's primitive cache
  std::vector<double> s;
  for (int i = 0; i < repeats; ++i) {
    const double start = thread_cpu_seconds();
    once();
    s.push_back(thread_cpu_seconds() - start);
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

// The products a linear layer (x W^T) of the GPT example's widths (128 in,
// the QKV, MLP up and MLP down projections) runs in forward and backward,
// on the kernel dtrain::nn::linear runs: y = x W^T, dx = dy W, dW = dy^T x,
// with the operands' layouts as they are in training. fp32 on a CPU where
// the oneDNN path is on (dtrain::nn::onednn_linear_enabled) is oneDNN; at::mm
// there (MKL's sgemm) reaches about half of oneDNN's rate at these shapes on
// Zen 5 (113 vs ~210 GFLOP/s), so timing at::mm made every step 2x too slow.
// Returns the seconds of one pass over the 9 products with `rows` rows, and
// their FLOPs.
std::pair<double, double> linear_products(at::ScalarType dtype, std::int64_t rows) {
  const std::int64_t shapes[][2] = {{128, 384}, {128, 512}, {512, 128}};  // in, out
  const bool onednn = dtype == at::kFloat && dtrain::nn::onednn_linear_enabled();
  auto product = [&](const at::Tensor& a, const at::Tensor& b) {
    return onednn ? dtrain::nn::onednn_mm(a, b) : at::mm(a, b);
  };
  // In training a product's operands were written by other kernels since
  // it last ran: they come from the last-level cache, not from the core's
  // own L2 as in a loop over one set. So each timing passes over kSets
  // operand sets (past a Zen 5 core's 1 MiB L2, within its L3); timed on
  // one set, the rate came out ~15 % above training's.
  constexpr int kSets = 8;
  double flops = 0, seconds = 0;
  for (const auto& s : shapes) {
    std::vector<at::Tensor> x, w, dy;
    for (int i = 0; i < kSets; ++i) {
      x.push_back(at::randn({rows, s[0]}).to(dtype));
      w.push_back(at::randn({s[1], s[0]}).to(dtype));
      dy.push_back(at::randn({rows, s[1]}).to(dtype));
    }
    auto over_sets = [&](const std::function<at::Tensor(int)>& one) {
      return [&, one] {
        for (int i = 0; i < kSets; ++i) one(i);
      };
    };
    seconds += median_seconds(9, over_sets([&](int i) { return product(x[i], w[i].t()); })) / kSets;
    seconds += median_seconds(9, over_sets([&](int i) { return product(dy[i], w[i]); })) / kSets;
    seconds += median_seconds(9, over_sets([&](int i) { return product(dy[i].t(), x[i]); })) / kSets;
    flops += 3 * 2.0 * static_cast<double>(rows * s[0] * s[1]);
  }
  return {seconds, flops};
}

// A product's time as a fixed cost per call plus FLOPs / rate: one fit
// (weighted by 1 / t, as fit_ring_link) over passes of 64 .. 3072 rows
// (one sequence to 48 of the GPT example's 64 tokens). The fixed part is
// oneDNN's per-call work (primitive lookup, memory descriptors, a fresh
// output): ~10 us here, ten times a small element-wise op's, and what made
// the GPT's small micro-batches cost more per token than its large ones.
struct GemmFit {
  double flops = 0, overhead = 0;
};
GemmFit fit_linear_products(at::ScalarType dtype) {
  constexpr double kCalls = 9;  // products per pass
  double cc = 0, cf = 0, ff = 0, ct = 0, ft = 0;
  for (const std::int64_t rows : {64, 192, 768, 3072}) {
    const auto [t, flops] = linear_products(dtype, rows);
    const double w = 1 / t, c = kCalls * w, f = flops * w, one = t * w;
    cc += c * c;
    cf += c * f;
    ff += f * f;
    ct += c * one;
    ft += f * one;
  }
  const double det = cc * ff - cf * cf;
  const double overhead = (ct * ff - ft * cf) / det, inv_rate = (cc * ft - cf * ct) / det;
  return {.flops = 1 / inv_rate, .overhead = std::max(0.0, overhead)};
}

// FLOP/s of ATen's fused causal attention (the flash kernel
// scaled_dot_product_attention runs on a CPU), forward, at the GPT example's
// shape (12 sequences of 64 tokens, 4 heads of 32), counted as the cost
// model counts flash attention: the causal half of 4 s^2 h per sequence.
// The GPT's tp plans run it (its one-rank plans materialise the scores on
// oneDNN's products instead). It reaches ~15 % of the products' rate here.
double flash_attention_rate() {
  const std::int64_t b = 12, heads = 4, s = 64, d = 32;
  const at::Tensor q = at::randn({b, heads, s, d}), k = at::randn({b, heads, s, d}), v = at::randn({b, heads, s, d});
  at::NoGradGuard no_grad;
  const double seconds =
      median_seconds(21, [&] { at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true); });
  return 0.5 * 4 * static_cast<double>(b * s * s * heads * d) / seconds;
}

// FLOP/s of the materialised causal attention dtrain::nn::causal_attention
// runs on oneDNN (the GPT's plans without tp or cp), forward, at the same
// shape, counted as the cost model counts its core: two batched products of
// 2 s^2 d per head and sequence (the softmax inside the timed call, which
// the model also costs as traffic: ~10 % of this term counted twice). Its
// products have k = 32 or 64: ~35 % of the wide products' rate here. 0 where
// that path does not run (no oneDNN): the model then uses the wide rate.
double materialized_attention_rate() {
  const std::int64_t b = 12, heads = 4, s = 64, d = 32;
  const at::Tensor q = at::randn({b, heads, s, d}), k = at::randn({b, heads, s, d}), v = at::randn({b, heads, s, d});
  if (!dtrain::nn::attention_uses_onednn(q, k, v)) return 0;
  at::NoGradGuard no_grad;
  const double seconds = median_seconds(21, [&] { dtrain::nn::causal_attention(q, k, v); });
  return 2 * 2.0 * static_cast<double>(b * heads * s * s * d) / seconds;
}

// Bytes/s of a streaming add c = a + b whose three operands take `bytes`.
double add_bandwidth(std::int64_t bytes) {
  const std::int64_t n = bytes / 12;
  at::Tensor a = at::ones({n}), b = at::ones({n}), c = at::empty({n});
  const double s = median_seconds(15, [&] { at::add_out(c, a, b); });
  return 12.0 * static_cast<double>(n) / s;
}

// The piece both measures below run: forward and backward of four MLP
// blocks of the GPT example's size (768 tokens, width 128, inner 512: layer
// norm, two products on nn::linear, GELU, residual) with autograd, fresh
// allocations and set-to-none gradients, as training does.
class MlpPiece {
 public:
  MlpPiece() : input_(at::randn({kRows, kWidth})) {
    for (int b = 0; b < kBlocks; ++b) {
      up_.push_back((at::randn({kInner, kWidth}) * 0.05).requires_grad_());
      down_.push_back((at::randn({kWidth, kInner}) * 0.05).requires_grad_());
    }
    once();  // warm-up: first-touch pages, oneDNN's primitive cache
  }
  void once() {
    at::Tensor x = input_;
    for (int b = 0; b < kBlocks; ++b) {
      const at::Tensor h = at::layer_norm(x, {kWidth});
      x = x + dtrain::nn::linear(at::gelu(dtrain::nn::linear(h, up_[b])), down_[b]);
    }
    x.sum().backward();
    for (int b = 0; b < kBlocks; ++b) {
      up_[b].mutable_grad() = at::Tensor();  // as zero_grad(set_to_none)
      down_[b].mutable_grad() = at::Tensor();
    }
  }

 private:
  static constexpr int kBlocks = 4;
  static constexpr std::int64_t kRows = 768, kWidth = 128, kInner = 512;
  at::Tensor input_;
  std::vector<at::Tensor> up_, down_;
};

// Seconds of this thread's CPU time for a fixed piece of training (the
// MlpPiece above), run long enough (~0.2 s here) to span many
// scheduler time slices, and totalled rather than a median: on a host with
// more ranks than cores each rank's thread is switched out and back in
// every few ms, and what that costs it (caches, TLB and predictors refilled
// after another rank ran on its core) shows in its CPU time for the same
// work. The mean over the ranks; `dtrain plan --calibrate` divides a run
// with more ranks than cores by one with no more
// (DeviceSpec::oversubscription_factor). The GPT example's ranks took
// 16-20 % more CPU per step with 4 processes on 2 cores than alone, also
// when the 4 were independent runs (no communication).
// `alone`: rank 0 runs the piece while the other ranks wait in a barrier
// (asleep, no core used), and every rank returns rank 0's time: the same
// work with the host to itself, against which `dtrain plan --calibrate`
// sets the ranks' time when all of them compute at once
// (DeviceSpec::concurrency_factor).
double time_sliced_work_seconds(dtrain::dist::ProcessGroup& group, bool alone = false) {
  MlpPiece piece;
  group.barrier();
  const bool runs = !alone || group.rank() == 0;
  const double start = thread_cpu_seconds();
  if (runs) {
    for (int i = 0; i < 40; ++i) piece.once();
  }
  at::Tensor mean = at::full({1}, runs ? thread_cpu_seconds() - start : 0.0, at::kFloat);
  group.all_reduce(mean).wait();
  return mean.item<float>() / static_cast<double>(alone ? 1 : group.size());
}

// Meetings of time-sliced ranks (Note [Meetings of time-sliced ranks] in
// src/plan/calibration.cpp): the MLP piece of time_sliced_work_seconds, one
// iteration (~13 ms of CPU here, ~26 ms of wall with two ranks a core)
// standing for a step's compute. Rounds of two kinds in turn, in wall time:
// kIterations iterations with a barrier after each ("lockstep"), and the
// same with one barrier at the end ("free"); per round the difference over
// the kIterations - 1 barriers more, the median over the rounds (a drift
// of the host's speed between rounds cancels), the ranks' mean. With a core
// per rank the ranks drift apart less (a virtual CPU's jitter) and the
// measure is smaller against the rounds' noise: more rounds there (0.55 and
// 1.47 ms in two 2-rank runs of 9 rounds, Intel Xeon 6/167, 2026-12-04).
double meeting_seconds(dtrain::dist::ProcessGroup& group) {
  constexpr int kIterations = 6;
  const int rounds = group.size() > dtrain::plan::find_device("cpu-here").compute_units ? 9 : 21;
  MlpPiece piece;
  auto round = [&](bool lockstep) {
    group.barrier();
    const auto start = Clock::now();
    for (int i = 0; i < kIterations; ++i) {
      piece.once();
      if (lockstep || i + 1 == kIterations) group.barrier();
    }
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  std::vector<double> extra;
  for (int r = 0; r < rounds; ++r) {
    const double free = round(false);
    extra.push_back((round(true) - free) / (kIterations - 1));
  }
  at::Tensor mean = at::full({1}, median_of(extra), at::kDouble);
  group.all_reduce(mean).wait();
  return std::max(0.0, mean.item<double>() / static_cast<double>(group.size()));
}

// One pre-LayerNorm transformer layer of the GPT example's size (width 128,
// 4 heads, inner 512, no biases; dtrain::nn::linear's products and
// dtrain::nn::causal_attention, as examples/gpt/model.h runs them), for the
// split backward's measurement below: 6 nodes whose output gradient the
// split captures (2 norms, QKV, projection, MLP up and down).
struct CalibrationLayerImpl : torch::nn::Module {
  static constexpr std::int64_t kWidth = 128, kHeads = 4, kInner = 512;
  CalibrationLayerImpl() {
    auto weight = [&](const char* name, std::int64_t out, std::int64_t in) {
      return register_parameter(name, at::randn({out, in}) * 0.05);
    };
    ln_1 = register_parameter("ln_1", at::ones({kWidth}));
    ln_2 = register_parameter("ln_2", at::ones({kWidth}));
    qkv = weight("qkv", 3 * kWidth, kWidth);
    proj = weight("proj", kWidth, kWidth);
    up = weight("up", kInner, kWidth);
    down = weight("down", kWidth, kInner);
  }
  at::Tensor forward(const at::Tensor& x) {
    const std::int64_t b = x.size(0), t = x.size(1);
    auto parts = dtrain::nn::linear(at::layer_norm(x, {kWidth}, ln_1), qkv).split(kWidth, 2);
    auto heads = [&](const at::Tensor& m) { return m.view({b, t, kHeads, kWidth / kHeads}).transpose(1, 2); };
    const at::Tensor y = dtrain::nn::causal_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]));
    const at::Tensor h = x + dtrain::nn::linear(y.transpose(1, 2).contiguous().view({b, t, kWidth}), proj);
    return h + dtrain::nn::linear(at::gelu(dtrain::nn::linear(at::layer_norm(h, {kWidth}, ln_2), up)), down);
  }
  at::Tensor ln_1, ln_2, qkv, proj, up, down;
};
TORCH_MODULE(CalibrationLayer);

// Thread CPU seconds of a stack of CalibrationLayers as deep as the GPT
// example (4) training on `micro_batch` sequences of 64 tokens, as the
// example trains (fresh allocations, set-to-none gradients), the median of
// 15 steps each:
//  - `layer`: per layer, forward and backward, its input's gradient too
//    (Note [Element-wise passes on a calibrated host] in
//    src/plan/calibration.cpp). A stack, not one layer repeated: in training
//    a layer's backward finds its saved activations and weights after the
//    other layers ran, not still in the core's caches.
//  - `optimizer`: the optimizer phase after that backward over the stack's
//    `params` parameters (~0.8 M, the GPT example's): clipping by the global
//    norm with foreach kernels and one fused AdamW kernel, as
//    examples/gpt/fused_adamw.h runs them (Note [Optimizer phase] in
//    src/plan/cost_model.cpp).
struct StackTimes {
  double layer = 0, optimizer = 0;
  std::int64_t params = 0;
};
StackTimes stack_times(std::int64_t micro_batch) {
  constexpr int kLayers = 4, kSteps = 15;
  torch::nn::Sequential stack;
  for (int l = 0; l < kLayers; ++l) stack->push_back(CalibrationLayer());
  const at::Tensor x = at::randn({micro_batch, 64, CalibrationLayerImpl::kWidth}).requires_grad_();
  std::vector<at::Tensor> weights = stack->parameters();  // gathered once, outside the timed steps
  std::vector<at::Tensor> exp_avgs, exp_avg_sqs;
  StackTimes out;
  for (const auto& w : weights) {
    exp_avgs.push_back(at::zeros_like(w));
    exp_avg_sqs.push_back(at::zeros_like(w));
    out.params += w.numel();
  }
  int step = 0;
  auto optimize = [&] {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads, steps;
    for (const auto& w : weights) grads.push_back(w.grad());
    const at::Tensor norm = at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)), 2);
    at::_foreach_mul_(grads, at::Scalar(std::min(1.0f / (norm.item<float>() + 1e-6f), 1.0f)));
    ++step;
    for (const auto& w : weights) steps.push_back(at::scalar_tensor(static_cast<double>(step), w.options()));
    at::_fused_adamw_(weights, grads, exp_avgs, exp_avg_sqs, {}, steps, 1e-4, 0.9, 0.95, 0.1, 1e-8,
                      /*amsgrad=*/false, /*maximize=*/false);
  };
  std::vector<double> layer, optimizer;
  for (int i = 0; i <= kSteps; ++i) {  // the first a warm-up: first-touch pages, oneDNN's primitive cache
    const double start = thread_cpu_seconds();
    stack->forward(x).sum().backward();
    const double backward = thread_cpu_seconds();
    optimize();
    const double stepped = thread_cpu_seconds();
    x.mutable_grad() = at::Tensor();
    for (auto& w : weights) w.mutable_grad() = at::Tensor();
    if (i == 0) continue;
    layer.push_back((backward - start + thread_cpu_seconds() - stepped) / kLayers);
    optimizer.push_back(stepped - backward);
  }
  out.layer = median_of(layer);
  out.optimizer = median_of(optimizer);
  return out;
}

// Pipelines of GPT example layers, as the executor runs them (Note [Split
// backward cost] and Note [Concurrency of pipeline stages] in
// src/plan/calibration.cpp): each rank a pipeline of its own (a group of
// one: no sends, no waits) with two stages of two CalibrationLayers each, 4
// micro-batches of 6 sequences of 64 tokens; timed in this thread's CPU time
// (others' work on the host slows it much less than wall time).
// Concurrency: interleaved steps (each backward whole), kRounds rounds of
// kSteps on rank 0 alone (the others wait in a barrier, asleep) followed by
// kSteps on every rank at once; per round, the median step of each phase
// (together: the ranks' mean), and `together_over_alone` the median over the
// rounds of each round's quotient. A host whose speed drifts (a shared VM:
// 10-20 % between runs of one program, and the alone and together phases
// measured one after the other read a factor of 1.00 to 1.24 within
// minutes, 2026-11-28) slows both phases of a round alike, so the quotient
// cancels it; `alone` and `together` are the medians over all rounds.
// The split: on rank 0 alone (no concurrency: the cost model applies that
// factor itself), by turns kSteps interleaved and kSteps ZB-H1 steps (the
// second stage's backward split in I, with the captured gradients, and W
// from them), kRounds rounds, with the executor's trace: the second stage's
// sum of B over a step against its sum of I + W, each action in thread CPU
// time, so ZB's other differences (its forwards over a larger working set,
// the first stage's W) stay out. `whole`: the median ΣB; `split`: that plus
// the median over rounds of each round's median excess (a drift of the
// host's speed between rounds cancels). `captured`: the nodes the executor's
// I captured on the second stage over a step.
struct LayerPipelineTimes {
  double alone = 0, together = 0;  // an interleaved step: rank 0 alone, every rank at once
  double together_over_alone = 0;  // the median over rounds of each round's quotient
  double whole = 0, split = 0;     // the second stage's ΣB and Σ(I + W) over a step, rank 0 alone
  int captured = 0;                // rank 0's; 0 elsewhere
};
LayerPipelineTimes layer_pipeline_times(dtrain::dist::ProcessGroup& world) {
  using namespace dtrain::pipeline;
  constexpr int kLayersPerStage = 2, kMicro = 4, kRounds = 9, kSteps = 4;
  dtrain::dist::DeviceMesh mesh(world, {{"pp", 1}, {"dp_replicate", world.size()}});
  torch::nn::Sequential stage_0, stage_1;
  for (int l = 0; l < kLayersPerStage; ++l) {
    stage_0->push_back(CalibrationLayer());
    stage_1->push_back(CalibrationLayer());
  }
  auto make = [&](ScheduleKind kind) {
    return Pipeline({{.module = stage_0}, {.module = stage_1}}, mesh["pp"],
                    {.schedule = kind, .micro_batches = kMicro, .record_trace = true},
                    [](const at::Tensor& out, const at::Tensor&) { return out.square().mean(); });
  };
  Pipeline whole = make(ScheduleKind::kInterleaved1F1B), split = make(ScheduleKind::kZeroBubble);
  const at::Tensor x = at::randn({kMicro * 6, 64, CalibrationLayerImpl::kWidth}), y = at::zeros({kMicro * 6});
  int captured = 0;
  // One step; returns the second stage's backward (B, or I + W) in thread CPU time.
  auto run = [&](Pipeline& pipe, std::vector<double>* sink) {
    const double start = thread_cpu_seconds();
    pipe.step(x, y);
    for (auto& p : pipe.parameters()) p.mutable_grad() = at::Tensor();  // as zero_grad(set_to_none)
    if (sink != nullptr) sink->push_back(thread_cpu_seconds() - start);
    double backward = 0;
    int nodes = 0;
    for (const TracedAction& t : pipe.trace()) {
      if (t.action.stage != 1 || t.action.kind == ActionKind::kForward) continue;
      backward += t.cpu_seconds;
      nodes += t.captured_nodes;
    }
    if (&pipe == &split) captured = nodes;
    return backward;
  };
  run(whole, nullptr);  // warm-up: first-touch pages, oneDNN's primitive cache
  run(split, nullptr);
  std::vector<double> alone, together, b_sums, excess;
  // Per round: rank 0's median alone and this rank's median together, summed
  // over the ranks below (rank 0's alone is the only non-zero one).
  at::Tensor rounds = at::zeros({2, kRounds}, at::kDouble);
  for (int r = 0; r < kRounds; ++r) {
    world.barrier();
    if (world.rank() == 0) {
      std::vector<double> mine;
      for (int k = 0; k < kSteps; ++k) run(whole, &mine);
      rounds[0][r] = median_of(mine);
      alone.insert(alone.end(), mine.begin(), mine.end());
    }
    world.barrier();
    std::vector<double> mine;
    for (int k = 0; k < kSteps; ++k) run(whole, &mine);
    rounds[1][r] = median_of(mine);
    together.insert(together.end(), mine.begin(), mine.end());
  }
  world.all_reduce(rounds).wait();
  std::vector<double> quotients;
  for (int r = 0; r < kRounds; ++r) {
    quotients.push_back(rounds[1][r].item<double>() / static_cast<double>(world.size()) / rounds[0][r].item<double>());
  }
  world.barrier();
  if (world.rank() == 0) {
    for (int r = 0; r < kRounds; ++r) {
      std::vector<double> b, iw;
      for (int k = 0; k < kSteps; ++k) b.push_back(run(whole, nullptr));
      for (int k = 0; k < kSteps; ++k) iw.push_back(run(split, nullptr));
      b_sums.insert(b_sums.end(), b.begin(), b.end());
      excess.push_back(median_of(iw) - median_of(b));
    }
    // The executor's own count (Note [Captured gradients] in cost_model.cpp
    // counts the same nodes: 6 per layer without a gated MLP).
    DTRAIN_INTERNAL_ASSERT(captured == kMicro * 6 * kLayersPerStage,
                           "the split backward captured " << captured << " nodes on the calibration's second stage, "
                                                          << kMicro * 6 * kLayersPerStage << " expected");
  }
  at::Tensor all = at::tensor({median_of(together), world.rank() == 0 ? median_of(alone) : 0.0}, at::kDouble);
  world.all_reduce(all).wait();
  const double b_step = median_of(b_sums);
  return {.alone = all[1].item<double>(),
          .together = all[0].item<double>() / static_cast<double>(world.size()),
          .together_over_alone = median_of(quotients),
          .whole = b_step,
          .split = b_step + median_of(excess),
          .captured = world.rank() == 0 ? captured : 0};
}

// Collectives as training meets them (Note [Collectives after compute] in
// src/plan/calibration.cpp): every rank runs a piece of compute (~2 ms of
// products), then a 16 KiB all_reduce, kPerRound times; and the same compute
// without the collectives, as often; rounds of each in turn, in wall time
// (kAfterComputeRounds with a core per rank, kTimeSlicedRounds with more
// ranks than cores, see below). The ranks do not enter the collectives
// together: where they time-slice the cores each arrives when its own
// compute got its share, and waits for peers switched out.
//
// Two measures of what a collective after compute costs (which one the
// planner takes, and why, is the Note's):
//  - `wall` and `compute_only`: the median over the rounds of the
//    compute-only round's wall time, and that plus the median over the rounds
//    of each round's difference (with collectives less without), each the
//    ranks' mean. A round with and one without run back to back, so a drift
//    of the host's speed cancels in the difference.
//  - `per_collective`: per collective, from the ranks' clocks (one
//    CLOCK_MONOTONIC on a host), the time from the last rank's start of the
//    piece before it (its return from the collective before, or the round's
//    barrier) to the last rank's return, less the ranks' mean piece: the
//    ranks' skew, the collective and its wake-ups; the median over all of
//    them.
//  - `ahead_wall` (time-sliced runs only; 0 otherwise): the same compute
//    with a 16 KiB all_gather issued before each piece and waited for after
//    it, as ZeRO-3 prefetches a unit's gather a unit ahead and
//    reduce-scatters beside the rest of backward (Note [Collectives issued
//    ahead on time-sliced ranks] in src/plan/cost_model.cpp): the
//    compute-only round's wall plus the median of the rounds' differences,
//    `kPerRound` collectives a round, the round ended by a barrier as the
//    compute-only round is.
struct AfterCompute {
  double wall = 0, compute_only = 0, per_collective = 0, ahead_wall = 0;
  std::int64_t ahead_bytes = 0;  // what each ahead all_gather gathered
};
// With more ranks than cores the planner takes the rounds' difference, and
// one round's difference scatters widely: 4 ranks on 2 cores (Intel Xeon
// 6/167, 2026-11-28), -0.8 to +4.0 ms per collective between rounds, so
// the median of 9 rounds read 0.35 to 1.65 ms in consecutive blocks of one
// run (and 0.33-1.17 ms less the ring in session 18's calibrations), while
// the medians of 81 rounds in three runs read 0.74, 0.94 and 0.77 ms. 81
// rounds there cost ~8 s of the calibration. With a core per rank the
// clocks' median over 8 collectives a round is steady at 9 rounds.
constexpr int kPerRound = 8, kAfterComputeRounds = 9, kTimeSlicedRounds = 81;
AfterCompute collectives_after_compute(dtrain::dist::ProcessGroup& group) {
  // The regime as `dtrain plan --calibrate` sorts the runs (its cpu-here entry's cores).
  const int cores = dtrain::plan::find_device("cpu-here").compute_units;
  const int rounds = group.size() > cores ? kTimeSlicedRounds : kAfterComputeRounds;
  const at::Tensor a = at::randn({256, 256}), b = at::randn({256, 256});
  at::Tensor small = at::ones({4096});  // 16 KiB
  auto work = [&] {
    for (int i = 0; i < 12; ++i) (void)dtrain::nn::linear(a, b);
  };
  // Per collective: the start of its piece, the piece's end, the return.
  std::vector<double> starts, arrivals, returns;
  auto seconds = [](Clock::time_point t) { return std::chrono::duration<double>(t.time_since_epoch()).count(); };
  const bool sliced = group.size() > cores;
  // ~16 KiB gathered, in equal slices whatever the ranks
  const std::int64_t slice_elements = (4096 + group.size() - 1) / group.size();
  at::Tensor slice = at::ones({slice_elements}), gathered = at::ones({slice_elements * group.size()});
  auto ahead_round = [&] {
    group.barrier();
    const auto start = Clock::now();
    for (int i = 0; i < kPerRound; ++i) {
      auto handle = group.all_gather_into(gathered, slice);
      work();
      handle.wait();
    }
    group.barrier();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  auto round = [&](bool collectives) {
    group.barrier();
    const auto start = Clock::now();
    for (int i = 0; i < kPerRound; ++i) {
      const auto piece = Clock::now();
      work();
      if (collectives) {
        const auto arrival = Clock::now();
        group.all_reduce(small).wait();
        const auto back = Clock::now();
        starts.push_back(seconds(piece));
        arrivals.push_back(seconds(arrival));
        returns.push_back(seconds(back));
      }
    }
    if (!collectives) group.barrier();  // the compute ends when the last rank's does
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  work();
  std::vector<double> without, extra, ahead;
  for (int r = 0; r < rounds; ++r) {
    without.push_back(round(false));
    extra.push_back(round(true) - without.back());
    if (sliced) ahead.push_back(ahead_round() - without.back());
  }
  const double compute = median_of(without);
  const std::int64_t count = static_cast<std::int64_t>(arrivals.size());
  at::Tensor clocks = at::zeros({3, group.size(), count}, at::kDouble);
  clocks[0][group.rank()].copy_(at::tensor(starts, at::kDouble));
  clocks[1][group.rank()].copy_(at::tensor(arrivals, at::kDouble));
  clocks[2][group.rank()].copy_(at::tensor(returns, at::kDouble));
  group.all_reduce(clocks).wait();
  // From the last rank's start of the piece (its return from the collective
  // before, or the round's barrier) to the last rank's return, less the
  // ranks' mean piece: what the collective added to the compute.
  const at::Tensor piece = clocks[1] - clocks[0];
  const at::Tensor cost = std::get<0>(clocks[2].max(0)) - std::get<0>(clocks[0].max(0)) - piece.mean(0);
  at::Tensor both =
      at::tensor({compute + median_of(extra), compute, sliced ? compute + median_of(ahead) : 0.0}, at::kDouble);
  group.all_reduce(both).wait();
  const double n = static_cast<double>(group.size());
  return {.wall = both[0].item<double>() / n,
          .compute_only = both[1].item<double>() / n,
          .per_collective = median_of(std::vector<double>(cost.data_ptr<double>(), cost.data_ptr<double>() + count)),
          .ahead_wall = both[2].item<double>() / n,
          .ahead_bytes = gathered.numel() * static_cast<std::int64_t>(sizeof(float))};
}

// all_reduce and all_gather of 16 KiB .. 4 MiB over `group`, each the
// median of its repeats, every rank entering each timed call together.
nlohmann::json time_collectives(dtrain::dist::ProcessGroup& group, const char* transport) {
  nlohmann::json samples = nlohmann::json::array();
  const std::int64_t world = group.size();
  for (const char* op : {"all_reduce", "all_gather"}) {
    for (const std::int64_t bytes : {16LL << 10, 256LL << 10, 4LL << 20}) {
      // all_gather: equal slices of ~bytes gathered whatever the ranks (3 does not divide 4096).
      const std::int64_t slice_elements = (bytes / 4 + world - 1) / world;
      const bool gather = std::strcmp(op, "all_gather") == 0;
      at::Tensor full = at::ones({gather ? slice_elements * world : bytes / 4}), slice = at::ones({slice_elements});
      const bool reduce = std::strcmp(op, "all_reduce") == 0;
      const int repeats = bytes <= (256 << 10) ? 30 : 10;
      std::vector<double> s;
      for (int i = 0; i < repeats + 2; ++i) {
        group.barrier();
        const auto start = Clock::now();
        if (reduce) {
          group.all_reduce(full).wait();
        } else {
          group.all_gather_into(full, slice).wait();
        }
        if (i >= 2) s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      }
      std::sort(s.begin(), s.end());
      samples.push_back({{"transport", transport},
                         {"op", op},
                         {"ranks", world},
                         {"bytes", full.numel() * 4},
                         {"seconds", s[s.size() / 2]}});
    }
  }
  return samples;
}

// Every rate of the device entry, on this rank alone (see main).
void measure_rates(nlohmann::json& result) {
  const GemmFit fp32 = fit_linear_products(at::kFloat);
  result["fp32_flops"] = fp32.flops;
  result["gemm_overhead"] = fp32.overhead;
  const auto [bf16_seconds, bf16_flops] = linear_products(at::kBFloat16, 768);
  result["bf16_flops"] = bf16_flops / bf16_seconds;
  result["attention_flops"] = flash_attention_rate();
  result["materialized_attention_flops"] = materialized_attention_rate();
  // One GPT layer whole, for the element-wise passes' factor; which
  // attention it ran, so that the cost model counts the same.
  constexpr std::int64_t kLayerMicroBatch = 12;
  const StackTimes stack = stack_times(kLayerMicroBatch);
  result["layer"] = {{"micro_batch", kLayerMicroBatch},
                     {"seconds", stack.layer},
                     {"attention", dtrain::nn::attention_materializes_scores(64) ? "materialized" : "flash"}};
  // The optimizer phase after that training's backward (Note [Optimizer phase]).
  result["optimizer"] = {{"params", stack.params}, {"seconds", stack.optimizer}};
  {
    // Memory: operands of 3 x 64 MiB, past any last-level cache. Cache:
    // 3 x 1 MiB, one of the GPT example's activation-sized element-wise
    // kernels.
    result["memory_bandwidth"] = add_bandwidth(192LL << 20);
    result["cache_bandwidth"] = add_bandwidth(3LL << 20);
    // Per-kernel overhead as training pays it: one eager op of a
    // differentiable chain (dispatch, a fresh output, autograd's node and
    // saved tensors), forward; and per op of its backward (the engine's
    // node, its kernels, the gradient buffers). A bare at::add of 4
    // elements outside autograd costs ~1 us here; in training an op costs
    // ~3x that, the GPT example's fixed ~2 ms per step.
    constexpr int kOps = 64;
    const at::Tensor x = at::ones({4}).requires_grad_(), c = at::ones({4});
    auto chain = [&] {
      at::Tensor y = x;
      for (int i = 0; i < kOps / 2; ++i) y = y * c + c;
      return y.sum();
    };
    result["kernel_overhead"] = median_seconds(51, [&] { chain(); }) / kOps;
    const double both = median_seconds(51, [&] { chain().backward(); });
    result["backward_kernel_overhead"] = both / kOps - result["kernel_overhead"].get<double>();
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string out;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s --out FILE\n", argv[0]);
      return 2;
    }
  }
  try {
    at::set_num_threads(1);  // as the examples run one rank per process
    // As examples/gpt: freed pages stay with the process (host_memory.h), so
    // the timed pieces pay no page faults that training would not.
    dtrain::retain_freed_host_memory();
    // Two groups over one store: dtrain's default (shared memory on one
    // host) and Gloo over loopback TCP.
    const auto contract = dtrain::dist::read_env_contract();
    const auto timeout = std::chrono::seconds(120);
    auto store = dtrain::dist::Store::tcp({.host = contract.master_addr,
                                           .port = contract.master_port,
                                           .is_server = contract.rank == 0 && !contract.agent_store,
                                           .timeout = timeout})
                     .with_prefix("/calibrate_" + std::to_string(contract.restart_count));
    auto shm = dtrain::dist::init_process_group(store, contract.rank, contract.world_size,
                                                {.timeout = timeout, .gloo_host = "127.0.0.1"});
    auto gloo = dtrain::dist::init_process_group(
        store, contract.rank, contract.world_size,
        {.timeout = timeout, .gloo_host = "127.0.0.1", .name = "gloo", .intra_host_shared_memory = false});
    nlohmann::json result{{"world", shm.size()}};
    // The rates are one rank's with the host to itself: rank 0 times them
    // while the others wait in a barrier (asleep); the cost model divides
    // them by DeviceSpec::concurrency_factor, measured below on GPT layers,
    // for plans whose ranks compute at once, and runs a one-process plan at
    // them. (Timed with every rank computing at once, as until 2026-11-28,
    // they carried that contention into one-process plans and, with the
    // factor, twice into the others: on a shared Intel VM the products read
    // 113-184 GFLOP/s against ~190 alone, and the suite's one-process GPT
    // was predicted 35-44 % slow.)
    //
    // Rank 0 times them three times, spread over the run (its start, its
    // middle, its end), and keeps the timing whose fp32 product rate is the
    // median (whole: the product rate and per-call cost are one fit, the
    // backward's kernel overhead is taken from the forward's): on a shared VM one
    // timing (~3 s) samples one state of the host, whose speed moves over
    // tens of seconds. On the Intel Xeon 6/167 VM (2026-11-28) eight timings
    // in a row read 147-156 GFLOP/s and a 3 MiB add 27-34 GB/s, while single
    // timings in three calibrations minutes apart read 144-165 GFLOP/s and
    // 24-32 GB/s, and the one-process GPT they predicted came out -3 to
    // +24 % against steps that measured 81-84 ms every time.
    std::vector<nlohmann::json> rates;
    auto time_rates = [&] {
      shm.barrier();
      if (contract.rank == 0) measure_rates(rates.emplace_back());
      shm.barrier();
    };
    time_rates();
    result["alone_work_seconds"] = time_sliced_work_seconds(shm, /*alone=*/true);
    result["time_sliced_work_seconds"] = time_sliced_work_seconds(shm);
    if (shm.size() >= 2) result["meeting_seconds"] = meeting_seconds(shm);
    {
      const LayerPipelineTimes t = layer_pipeline_times(shm);
      result["split_backward"] = {{"whole_seconds", t.whole}, {"split_seconds", t.split}, {"captured", t.captured}};
      result["layer_pipeline"] = {
          {"alone_seconds", t.alone}, {"together_seconds", t.together}, {"together_over_alone", t.together_over_alone}};
    }
    time_rates();
    {
      const AfterCompute ac = collectives_after_compute(shm);
      result["after_compute"] = {{"wall_seconds", ac.wall},
                                 {"compute_wall_seconds", ac.compute_only},
                                 {"collective_seconds", ac.per_collective},
                                 // the last all-reduce's wait is the compute-only round's final barrier's
                                 {"collectives", kPerRound - 1},
                                 {"bytes", 16 << 10}};
      if (ac.ahead_wall > 0) {
        result["after_compute"]["ahead_wall_seconds"] = ac.ahead_wall;
        result["after_compute"]["ahead_collectives"] = kPerRound;
        result["after_compute"]["ahead_bytes"] = ac.ahead_bytes;
      }
    }
    nlohmann::json samples = time_collectives(shm, "shared_memory");
    for (auto& s : time_collectives(gloo, "gloo")) samples.push_back(s);
    result["samples"] = samples;
    result["shared_memory"] = shm.uses_shared_memory();
    time_rates();
    if (contract.rank == 0) {
      std::sort(rates.begin(), rates.end(), [](const nlohmann::json& a, const nlohmann::json& b) {
        return a.at("fp32_flops").get<double>() < b.at("fp32_flops").get<double>();
      });
      result.update(rates[rates.size() / 2]);
      std::ofstream file(out);
      file << result.dump() << "\n";
      if (!file.good()) {
        std::fprintf(stderr, "dtrain_plan_calibrate: cannot write %s\n", out.c_str());
        return 1;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain_plan_calibrate: error: %s\n", e.what());
    return 1;
  }
}
