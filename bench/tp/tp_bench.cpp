// Tensor parallelism on examples/gpt's GPT, one process per rank (env
// contract, CPU, one OpenMP thread): every rank is one tp rank, all reading
// the same batch. bench/tp/peer.py measures PyTorch's DTensor TP
// (parallelize_module) on the same model, weights and batches. Rank 0 prints
// one JSON line:
//   {"impl":"dtrain","case":"tp2_sp","p50_ms":..,"tokens_per_s":..,"first_loss":..,"last_loss":..}
//
//   tp_bench [--sequence-parallel] --steps 30 --batch 8 --block 64 --n-embd 256
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <vector>

#include "../common/timing.h"
#include "dtrain/dtrain.h"
#include "fused_adamw.h"
#include "model.h"
#include "tensor_parallel.h"

int main(int argc, char** argv) {
  CLI::App app{"GPT tensor-parallel step time (one rank)"};
  int steps = 30, warmup = 5;
  std::int64_t batch = 8;
  bool sp = false;
  gpt::GptConfig config{.vocab_size = 65, .block_size = 64, .n_layer = 4, .n_head = 8, .n_embd = 256};
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--batch", batch);
  app.add_option("--block", config.block_size);
  app.add_option("--n-layer", config.n_layer);
  app.add_option("--n-head", config.n_head);
  app.add_option("--n-embd", config.n_embd);
  app.add_flag("--sequence-parallel", sp);
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    auto group = dtrain::dist::init_process_group();
    const int tp = group.size();
    dtrain::dist::DeviceMesh mesh(group, {{"tp", tp}});
    torch::nn::Sequential full = gpt::gpt_layers(config);
    gpt::init_weights(*full, config.n_layer, 1337);
    torch::nn::Sequential model = gpt::apply_tp(full, mesh, {.sequence_parallel = sp});
    full = nullptr;
    gpt::FusedAdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
    // The same batches on every rank and in the peer: torch.randint from a
    // generator seeded 100 + step.
    auto batch_of = [&](int step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
      const at::Tensor xy = at::randint(0, config.vocab_size, {2, batch, config.block_size}, gen, at::kLong);
      return std::make_pair(xy[0], xy[1]);
    };
    std::vector<double> step_ms;
    double first_loss = 0, last_loss = 0;
    for (int i = 0; i < warmup + steps; ++i) {
      const auto [x, y] = batch_of(i);
      group.barrier();
      const auto start = dtrain::bench::Clock::now();
      opt.zero_grad();
      at::Tensor loss = gpt::tp_lm_loss(model->forward(x), y, mesh["tp"], config.vocab_size);
      loss.backward();
      opt.step();
      if (i >= warmup) step_ms.push_back(dtrain::bench::ms_since(start));
      if (i == 0) first_loss = loss.item<double>();
      last_loss = loss.item<double>();
    }
    group.barrier();
    if (group.rank() == 0) {
      const double p50 = dtrain::bench::percentile(step_ms, 0.5);
      std::printf(
          "{\"impl\":\"dtrain\",\"case\":\"tp%d%s\",\"p50_ms\":%.3f,\"tokens_per_s\":%.1f,\"first_loss\":%.6f,"
          "\"last_loss\":%.6f}\n",
          tp, sp ? "_sp" : "", p50, static_cast<double>(batch * config.block_size) / (p50 / 1000.0), first_loss,
          last_loss);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
