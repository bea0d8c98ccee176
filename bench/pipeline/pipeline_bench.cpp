// Pipeline schedules, measured.
//
// --mode sleep: the schedules themselves, isolated from the machine's cores.
//   p rank threads; every stage's forward and backward sleep a calibrated
//   time (F = I = W = --unit-ms, so B = 2 units; interleaved stages half of
//   that each, so a rank's work is the same). Per schedule and m: the measured
//   bubble (1 - mean busy time of a rank / step time, busy = the executor's
//   traced compute actions, step = common start to last rank's end) beside the
//   formula, and each rank's peak activations in flight.
// --mode gpt: one rank of the real GPT under a schedule (a process started by
//   `dtrain run`), or the unpipelined model (--schedule none, one process);
//   prints the mean step time as JSON. DTRAIN_BENCH_TRACE=1: each action
//   kind's median and lowest time per stage over the timed steps, and the
//   last step's actions. --stages-per-rank 2 on one process (zb against
//   interleaved): the split backward's cost, ZB's I + W against B of the
//   same stage (docs/planner.md, session 14).
// --mode gpt --schedule none --data-parallel lockstep|ddp, on 2 or more
//   processes (`dtrain run`): what separates a data-parallel step from a
//   single process's (issue 29). Every rank trains the whole model on a batch
//   of --batch sequences (the same ones on every rank: only time is measured);
//   "lockstep" joins the ranks with one barrier per step and exchanges
//   nothing (the machine's ceiling: the cores' contention plus each step
//   waiting for the slowest rank), "ddp" adds dtrain's DistributedDataParallel
//   (its bucketed gradient all-reduce). Step time: wall time over the timed
//   steps (barrier included on both), from rank 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/optim/sgd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "../../examples/gpt/model.h"
#include "../../examples/gpt/pipeline_stages.h"
#include "../common/timing.h"
#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/host_memory.h"
#include "dtrain/nn/linear.h"
#include "dtrain/parallel/ddp/ddp.h"
#include "dtrain/parallel/pipeline/pipeline.h"

using namespace dtrain::pipeline;
using dtrain::bench::Clock;
using dtrain::bench::ms_since;

namespace {

void sleep_ms(double ms) {
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

// y = x * w; forward sleeps `f` ms, the input gradient `i` ms, the weight
// gradient `w` ms, each only when autograd asks for it (so I and W of a split
// backward each pay their own part).
struct SleepFn : torch::autograd::Function<SleepFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double f,
                            double i, double wt) {
    ctx->saved_data["i"] = i;
    ctx->saved_data["w"] = wt;
    ctx->save_for_backward({x, w});
    sleep_ms(f);
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      sleep_ms(ctx->saved_data["i"].toDouble());
      gx = g[0] * saved[1];
    }
    if (ctx->needs_input_grad(1)) {
      sleep_ms(ctx->saved_data["w"].toDouble());
      gw = (g[0] * saved[0]).sum();
    }
    return {gx, gw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct SleepStageImpl : torch::nn::Module {
  SleepStageImpl(double unit, bool first) : unit_(unit) {
    w = register_parameter("w", at::ones({}));
    // The first stage's input needs no gradient; a bias makes its path
    // differentiable so its backward costs what the others' do.
    if (first) b = register_parameter("b", at::zeros({}));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor in = b.defined() ? x + b : x;
    return SleepFn::apply(in, w, unit_, unit_, unit_);
  }
  double unit_;
  at::Tensor w, b;
};
TORCH_MODULE(SleepStage);

struct SleepResult {
  double bubble = 0;
  std::vector<int> peak;
};

SleepResult run_sleep(ScheduleKind kind, int p, int v, int m, double unit, int steps) {
  SleepResult result;
  result.peak.assign(p, 0);
  std::vector<double> busy(p, 0), span(p, 0);
  auto store = dtrain::dist::Store::in_memory();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < p; ++rank) {
    threads.emplace_back([&, rank] {
      at::set_num_threads(1);
      auto group = dtrain::dist::init_process_group(store, rank, p);
      std::vector<PipelineStage> stages;
      for (int s = rank; s < p * v; s += p) {
        torch::nn::Sequential seq;
        seq->push_back(SleepStage(unit / v, s == 0));
        stages.push_back({.module = seq, .tied = {}});
      }
      Pipeline pipe(std::move(stages), group, {.schedule = kind, .micro_batches = m, .record_trace = true},
                    [](const at::Tensor& out, const at::Tensor&) { return out.sum(); });
      const at::Tensor x = at::ones({m, 4});
      for (int step = 0; step <= steps; ++step) {  // step 0 warms up
        group.barrier();
        const auto start = Clock::now();
        pipe.step(x, x);
        const double took = ms_since(start);
        if (step == 0) continue;
        span[rank] += took;
        for (const TracedAction& t : pipe.trace())
          busy[rank] += std::chrono::duration<double, std::milli>(t.end - t.start).count();
      }
      result.peak[rank] = pipe.peak_activations();
    });
  }
  for (auto& t : threads) t.join();
  const double step_span = *std::max_element(span.begin(), span.end());
  double mean_busy = 0;
  for (double b : busy) mean_busy += b / p;
  result.bubble = 1.0 - mean_busy / step_span;
  return result;
}

double formula(ScheduleKind kind, int p, int v, int m) {
  if (kind == ScheduleKind::kZeroBubble) return double(p - 1) / (3 * m + p - 1);  // ZB-H1 with F = I = W
  return double(p - 1) / (v * m + p - 1);
}

int sleep_mode(int p, double unit, int steps) {
  std::printf("# p=%d, F = I = W = %.0f ms (interleaved: v=2 stages of half that), %d timed steps each\n", p, unit,
              steps);
  std::printf("%-12s %3s %9s %9s %7s  %s\n", "schedule", "m", "measured", "formula", "diff",
              "peak activations per rank");
  for (ScheduleKind kind :
       {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B, ScheduleKind::kZeroBubble}) {
    const int v = kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
    for (int m : {4, 8, 12, 16}) {
      const SleepResult r = run_sleep(kind, p, v, m, unit, steps);
      const double f = formula(kind, p, v, m);
      std::ostringstream peaks;
      for (int k : r.peak) peaks << k << ' ';
      std::printf("%-12s %3d %9.3f %9.3f %+7.3f  %s\n", to_string(kind).c_str(), m, r.bubble, f, r.bubble - f,
                  peaks.str().c_str());
      std::printf("{\"bench\":\"pipeline\",\"case\":\"sleep_%s_m%d\",\"bubble\":%.4f,\"formula\":%.4f,\"peak0\":%d}\n",
                  to_string(kind).c_str(), m, r.bubble, f, r.peak[0]);
      std::fflush(stdout);
    }
  }
  return 0;
}

std::vector<std::size_t> parse_split(const std::string& text) {
  std::vector<std::size_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoul(item));
  return out;
}

struct GptOptions {
  std::string schedule = "1f1b", split, transport = "shm", data_parallel = "none";
  int m = 4, batch = 16, steps = 2, warmup = 3, dp_shard = 1;
  int stages_per_rank = 0;  // 0: 2 for the interleaved schedule, else 1
};

int gpt_mode(const GptOptions& o) {
  const std::string &schedule = o.schedule, &split = o.split, &transport = o.transport;
  const int m = o.m, batch = o.batch, steps = o.steps, warmup = o.warmup, dp_shard = o.dp_shard;
  at::set_num_threads(1);
  dtrain::retain_freed_host_memory();  // as examples/gpt does (host_memory.h)
  const gpt::GptConfig config{.vocab_size = 65, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128};
  torch::nn::Sequential layers = gpt::gpt_layers(config);
  gpt::init_weights(*layers, config.n_layer, 1337);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor x = at::randint(config.vocab_size, {batch, config.block_size}, gen, at::kLong);
  const at::Tensor y = at::randint(config.vocab_size, {batch, config.block_size}, gen, at::kLong);
  std::vector<double> times;
  if (schedule == "none" && o.data_parallel != "none") {
    auto world = dtrain::dist::init_process_group({.intra_host_shared_memory = transport != "gloo"});
    std::optional<dtrain::DistributedDataParallel<torch::nn::Sequential>> ddp;
    if (o.data_parallel == "ddp") ddp.emplace(layers, world);
    torch::optim::SGD opt(layers->parameters(), 1e-3);
    Clock::time_point start;
    for (int step = 0; step < warmup + steps; ++step) {
      world.barrier();
      if (step == warmup) start = Clock::now();
      opt.zero_grad();
      gpt::lm_loss(ddp ? ddp->forward(x) : layers->forward(x), y).backward();
      opt.step();
    }
    world.barrier();
    const double mean = ms_since(start) / steps;
    if (world.rank() != 0) return 0;
    std::printf(
        "{\"impl\":\"dtrain\",\"schedule\":\"none\",\"data_parallel\":\"%s\",\"world\":%d,\"batch\":%d,"
        "\"step_ms\":%.2f,\"tokens_per_second\":%.0f,\"linear_kernel\":\"%s\"}\n",
        o.data_parallel.c_str(), world.size(), batch, mean, world.size() * batch * 64 * 1000.0 / mean,
        dtrain::nn::linear_kernel_name());
    return 0;
  }
  if (schedule == "none") {
    torch::optim::SGD opt(layers->parameters(), 1e-3);
    for (int step = 0; step < warmup + steps; ++step) {
      const auto start = Clock::now();
      opt.zero_grad();
      gpt::lm_loss(layers->forward(x), y).backward();
      opt.step();
      if (step >= warmup) times.push_back(ms_since(start));
    }
  } else {
    // "gloo": activations and gradients through Gloo's loopback TCP instead
    // of the shared-memory rings (shm_p2p.cpp), to show what they change.
    auto world = dtrain::dist::init_process_group({.intra_host_shared_memory = transport != "gloo"});
    // --dp-shard N: N pipeline replicas, each stage ZeRO-3 over its replicas
    // (dp_shard), each replica training on its 1/N of the batch.
    dtrain::dist::DeviceMesh mesh(world, {{"pp", world.size() / dp_shard}, {"dp_shard", dp_shard}});
    dtrain::dist::ProcessGroup group = mesh["pp"];
    const ScheduleKind kind = parse_schedule_kind(schedule);
    const int v = o.stages_per_rank > 0 ? o.stages_per_rank : kind == ScheduleKind::kInterleaved1F1B ? 2 : 1;
    const int p = group.size();
    PipelineOptions options{.schedule = kind, .micro_batches = m, .record_trace = true};
    at::Tensor xs = x, ys = y;
    if (dp_shard > 1) {
      options.data_parallel_group = mesh["dp_shard"];
      options.stage_sync = zero_stage_sync({.stage = 3});
      xs = x.chunk(dp_shard, 0)[mesh.coordinate("dp_shard")];
      ys = y.chunk(dp_shard, 0)[mesh.coordinate("dp_shard")];
    }
    Pipeline pipe(gpt::pipeline_stages(layers, p, v, group.rank(),
                                       split.empty() ? std::vector<std::size_t>{} : parse_split(split)),
                  group, options, gpt::lm_loss);
    torch::optim::SGD opt(pipe.parameters(), 1e-3);
    double busy = 0;
    Clock::time_point last_start, last_end;
    // Every timed step's compute actions, by kind and stage (DTRAIN_BENCH_TRACE).
    std::map<std::pair<std::string, int>, std::vector<double>> by_kind;
    for (int step = 0; step < warmup + steps; ++step) {
      world.barrier();
      const auto start = Clock::now();
      opt.zero_grad();
      pipe.step(xs, ys);
      opt.step();
      if (step < warmup) continue;
      times.push_back(ms_since(start));
      last_start = start;
      last_end = Clock::now();
      for (const TracedAction& t : pipe.trace()) {
        const double ms = std::chrono::duration<double, std::milli>(t.end - t.start).count();
        busy += ms / steps;
        by_kind[{to_string(t.action.kind), t.action.stage}].push_back(ms);
      }
    }
    std::fprintf(stderr, "rank %d: compute %.1f ms of each step\n", group.rank(), busy);
    if (std::getenv("DTRAIN_BENCH_TRACE") != nullptr) {
      // The last step's compute actions: start offset and duration (ms),
      // from the step's start (after the barrier).
      const auto origin = last_start;
      std::fprintf(stderr, "rank %d step ends at %.1f\n", group.rank(),
                   std::chrono::duration<double, std::milli>(last_end - origin).count());
      // Per kind and stage over all timed steps: the median and the lowest
      // (the action undisturbed by the other rank and the host's other work).
      for (auto& [key, ms] : by_kind) {
        std::sort(ms.begin(), ms.end());
        std::fprintf(stderr, "rank %d %s stage %d: median %.2f min %.2f ms over %zu\n", group.rank(), key.first.c_str(),
                     key.second, ms[ms.size() / 2], ms.front(), ms.size());
      }
      for (const TracedAction& t : pipe.trace())
        std::fprintf(stderr, "rank %d %s at %.1f for %.1f\n", group.rank(), to_string(t.action).c_str(),
                     std::chrono::duration<double, std::milli>(t.start - origin).count(),
                     std::chrono::duration<double, std::milli>(t.end - t.start).count());
    }
    if (group.rank() != p - 1 || mesh.coordinate("dp_shard") != 0) return 0;
  }
  double mean = 0;
  for (double t : times) mean += t / double(times.size());
  std::printf(
      "{\"impl\":\"dtrain\",\"schedule\":\"%s\",\"transport\":\"%s\",\"micro_batches\":%d,\"batch\":%d,"
      "\"dp_shard\":%d,\"step_ms\":%.2f,\"tokens_per_second\":%.0f,\"linear_kernel\":\"%s\"}\n",
      schedule.c_str(), transport.c_str(), m, batch, dp_shard, mean, batch * 64 * 1000.0 / mean,
      dtrain::nn::linear_kernel_name());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pipeline schedules benchmark"};
  std::string mode = "sleep";
  GptOptions g;
  std::string &schedule = g.schedule, &split = g.split, &transport = g.transport;
  int p = 4, steps = 2;
  int &m = g.m, &batch = g.batch, &warmup = g.warmup, &dp_shard = g.dp_shard;
  double unit = 10;
  app.add_option("--mode", mode, "sleep | gpt");
  app.add_option("--ranks", p, "sleep: pipeline ranks");
  app.add_option("--unit-ms", unit, "sleep: F = I = W time");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "gpt: untimed steps first");
  app.add_option("--schedule", schedule, "gpt: gpipe | 1f1b | interleaved | zb | none (unpipelined)");
  app.add_option("--micro-batches", m, "gpt: micro-batches");
  app.add_option("--batch", batch, "gpt: sequences per step");
  app.add_option("--split", split, "gpt: stage of each layer, comma-separated (default: planned)");
  app.add_option("--dp-shard", dp_shard, "gpt: pipeline replicas, each stage ZeRO-3 over them (world = pp x this)");
  app.add_option("--data-parallel", g.data_parallel,
                 "gpt, --schedule none: none (one process) | lockstep (each rank alone, a barrier per step) | ddp")
      ->check(CLI::IsMember({"none", "lockstep", "ddp"}));
  app.add_option("--transport", transport, "gpt: shm (default: shared-memory send/recv on one host) | gloo");
  app.add_option("--stages-per-rank", g.stages_per_rank,
                 "gpt: stages per rank (interleaved, zb; default 2 for interleaved, else 1); with one process and 2, "
                 "the split backward of zb against interleaved's B in one process");
  CLI11_PARSE(app, argc, argv);
  if (g.data_parallel != "none" && (mode != "gpt" || schedule != "none")) {
    std::fprintf(stderr, "bench_pipeline: --data-parallel %s needs --mode gpt --schedule none\n",
                 g.data_parallel.c_str());
    return 2;
  }
  if (mode == "sleep") return sleep_mode(p, unit, steps);
  g.steps = steps;
  return gpt_mode(g);
}
