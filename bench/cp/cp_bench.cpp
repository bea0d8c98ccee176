// Context parallelism on examples/gpt's GPT: one process per rank (env
// contract, CPU, --threads intra-op threads, default 1), every rank of the world on `cp`. With
// --cp 1 the unsplit GPT (at::scaled_dot_product_attention) in one process;
// with --cp N (N = the world) the GPT through gpt::apply_cp, K/V passed round
// the ring (or all-gathered, --exchange allgather), gradients averaged by DDP
// over cp. AdamW steps on one fixed batch. Rank 0 prints one JSON line:
//   {"cp":..,"threads":..,"exchange":..,"block":..,"batch":..,"tokens_per_s":..,"p50_ms":..,
//    "cpu_ms":..,"peak_bytes":..,"step_peak_bytes":..}
// tokens_per_s counts the batch's tokens (all ranks together) per median step;
// cpu_ms is the median step's CPU time of the busiest rank (its process, all
// threads), which a loaded machine does not inflate as it does wall time;
// peak_bytes is the largest over ranks of CpuMemoryStats' peak of tensor
// storage during the measured steps (parameters, gradients and AdamW state
// included), step_peak_bytes the same less what was live before the step
// (activations and transients). No Python peer: torch 2.15's
// context_parallel does not run on CPU.
//
//   dtrain run --nproc-per-node 2 bench_cp --cp 2 --block 512
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <ctime>
#include <vector>

#include "../common/timing.h"
#include "context_parallel.h"
#include "dtrain/dtrain.h"
#include "dtrain/memory_stats.h"
#include "model.h"

namespace {

// This process's CPU time (all its threads), in ms: on a shared machine the
// wall time of a step also counts other programs' turns on the cores.
double process_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Context-parallel GPT step time and memory per rank"};
  int cp = 1, steps = 10, warmup = 2, threads = 1;
  std::int64_t batch = 4;
  std::string exchange = "ring";
  gpt::GptConfig config{.vocab_size = 65, .block_size = 512, .n_layer = 4, .n_head = 4, .n_embd = 128};
  app.add_option("--cp", cp, "1: the unsplit GPT; else the world size");
  app.add_option("--exchange", exchange)->check(CLI::IsMember({"ring", "allgather"}));
  app.add_option("--threads", threads, "Intra-op threads per process");
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--batch", batch);
  app.add_option("--block", config.block_size);
  app.add_option("--n-layer", config.n_layer);
  app.add_option("--n-embd", config.n_embd);
  CLI11_PARSE(app, argc, argv);
  try {
    using dtrain::bench::Clock;
    at::set_num_threads(threads);
    dtrain::CpuMemoryStats::enable();
    auto group = dtrain::dist::init_process_group();
    DTRAIN_CHECK(cp == group.size(), ConfigError, "--cp " << cp << " on a world of " << group.size() << ".",
                 "launch --cp ranks");
    torch::nn::Sequential full = gpt::gpt_layers(config);
    gpt::init_weights(*full, config.n_layer, 1337);
    torch::nn::Sequential model =
        cp == 1 ? full
                : gpt::apply_cp(full, group,
                                {.exchange = exchange == "ring" ? dtrain::nn::cp::KvExchange::kRing
                                                                : dtrain::nn::cp::KvExchange::kAllGather});
    std::optional<dtrain::DistributedDataParallel<torch::nn::Sequential>> ddp;
    if (cp > 1) ddp.emplace(model, group, dtrain::DDPOptions{.gradient_as_bucket_view = true});
    torch::optim::AdamW opt(full->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100);  // the same batch on every rank
    const at::Tensor x = at::randint(0, config.vocab_size, {batch, config.block_size}, gen, at::kLong);
    const at::Tensor y = at::randint(0, config.vocab_size, {batch, config.block_size}, gen, at::kLong);
    const at::Tensor target = cp == 1 ? y : gpt::cp_targets(y, group);

    std::vector<double> step_ms, cpu_ms;
    std::int64_t peak = 0, step_peak = 0;
    for (int i = 0; i < warmup + steps; ++i) {
      group.barrier();
      const std::int64_t before = dtrain::CpuMemoryStats::live_bytes();
      dtrain::CpuMemoryStats::reset_peak();
      const auto start = Clock::now();
      const double cpu_start = process_cpu_ms();
      const at::Tensor logits = ddp ? (*ddp)(x) : model->forward(x);
      at::Tensor loss = cp == 1 ? gpt::lm_loss(logits, target) : gpt::cp_lm_loss(logits, target, group);
      loss.backward();
      opt.step();
      if (ddp) {
        ddp->zero_grad();
      } else {
        opt.zero_grad();
      }
      if (i >= warmup) {
        step_ms.push_back(dtrain::bench::ms_since(start));
        cpu_ms.push_back(process_cpu_ms() - cpu_start);
        peak = std::max(peak, dtrain::CpuMemoryStats::peak_bytes());
        step_peak = std::max(step_peak, dtrain::CpuMemoryStats::peak_bytes() - before);
      }
    }
    at::Tensor worst =
        at::tensor({static_cast<double>(peak), static_cast<double>(step_peak), dtrain::bench::percentile(cpu_ms, 0.5)},
                   at::kDouble);
    group.all_reduce(worst, dtrain::dist::ReduceOp::kMax).wait();
    const double p50 = dtrain::bench::percentile(step_ms, 0.5);
    if (group.rank() == 0) {
      std::printf(
          "{\"cp\":%d,\"threads\":%d,\"exchange\":\"%s\",\"block\":%lld,\"batch\":%lld,\"tokens_per_s\":%.1f,\"p50_"
          "ms\":%.2f,"
          "\"cpu_ms\":%.2f,\"peak_bytes\":%.0f,\"step_peak_bytes\":%.0f}\n",
          cp, threads, cp == 1 ? "none" : exchange.c_str(), static_cast<long long>(config.block_size),
          static_cast<long long>(batch), static_cast<double>(batch * config.block_size) / (p50 / 1e3), p50,
          worst[2].item<double>(), worst[0].item<double>(), worst[1].item<double>());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cp: %s\n", e.what());
    return 1;
  }
}
