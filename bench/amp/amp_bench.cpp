// Training-step time in fp32 and under bf16 autocast + GradScaler on the CPU,
// for a matmul-heavy MLP, in one process, the two loops alternating in blocks
// of steps. bench/amp/peer.py runs the same
// loop in Python (torch.autocast + torch.amp.GradScaler). Prints one JSON line
// per case:
//   {"impl":"dtrain","case":"mlp_fp32"|"mlp_bf16","params":..,"p50_ms":..,"p95_ms":..,"final_loss":..}
// and, for the explanation of the figures, the forward matmul alone:
//   {"impl":"dtrain","case":"mm_fp32"|"mm_bf16","p50_ms":..,"gflops":..}
//
//   amp_bench --steps 30 --batch 128 --threads 1 --block 5
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>
#include "../common/timing.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "dtrain/amp/autocast.h"
#include "dtrain/amp/grad_scaler.h"

namespace {
using Clock = std::chrono::steady_clock;

using dtrain::bench::ms_since;

using dtrain::bench::percentile;

constexpr std::int64_t kIn = 1024, kHidden = 4096, kClasses = 16;

// 1024-4096-4096-1024-16: ~25 M parameters, nearly all time in three big matmuls.
torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(), torch::nn::Linear(kHidden, kHidden),
                               torch::nn::ReLU(), torch::nn::Linear(kHidden, kIn), torch::nn::ReLU(),
                               torch::nn::Linear(kIn, kClasses));
}

torch::nn::Sequential seeded_model() {
  torch::manual_seed(0);
  return make_model();
}

// One training loop, fp32 or bf16 autocast + GradScaler.
struct Loop {
  explicit Loop(bool bf16_)
      : bf16(bf16_), model(seeded_model()), opt(model->parameters(), 0.01), scaler({.enabled = bf16_}) {}
  // One step; returns its duration in ms.
  double step(const at::Tensor& x, const at::Tensor& y) {
    const auto start = Clock::now();
    opt.zero_grad();
    at::Tensor loss;
    {
      dtrain::amp::Autocast autocast(c10::kCPU, {.enabled = bf16});
      loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    const double ms = ms_since(start);
    last_loss = loss.item<double>();
    return ms;
  }
  bool bf16;
  torch::nn::Sequential model;
  torch::optim::SGD opt;
  dtrain::amp::GradScaler scaler;
  double last_loss = 0;
  std::vector<double> ms;
};

// The two loops in alternating blocks of steps, so that both see the same
// machine (this one is shared and its speed drifts).
void train_cases(int steps, int warmup, int batch, int block) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor x = at::randn({batch, kIn}, gen);
  const at::Tensor y = at::randint(0, kClasses, {batch}, gen, at::kLong);
  Loop loops[] = {Loop(false), Loop(true)};
  for (auto& loop : loops) {
    for (int i = 0; i < warmup; ++i) loop.step(x, y);
  }
  for (int done = 0; done < steps; done += block) {
    for (auto& loop : loops) {
      for (int i = done; i < std::min(steps, done + block); ++i) loop.ms.push_back(loop.step(x, y));
    }
  }
  std::int64_t numel = 0;
  for (const auto& p : loops[0].model->parameters()) numel += p.numel();
  for (const auto& loop : loops) {
    std::printf(
        "{\"impl\":\"dtrain\",\"case\":\"mlp_%s\",\"params\":%lld,\"batch\":%d,\"p50_ms\":%.3f,"
        "\"p95_ms\":%.3f,\"final_loss\":%.4f}\n",
        loop.bf16 ? "bf16" : "fp32", static_cast<long long>(numel), batch, percentile(loop.ms, 0.5),
        percentile(loop.ms, 0.95), loop.last_loss);
  }
  std::fflush(stdout);
}

// The hidden layer's forward matmul alone, fp32 and bf16 alternating.
void mm_cases(int steps, int batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const at::Tensor a = at::randn({batch, kHidden}, gen), b = at::randn({kHidden, kHidden}, gen);
  const at::Tensor a16 = a.to(at::kBFloat16), b16 = b.to(at::kBFloat16);
  std::vector<double> ms[2];
  for (int i = 0; i < steps + 3; ++i) {
    for (int bf16 = 0; bf16 < 2; ++bf16) {
      const auto start = Clock::now();
      const at::Tensor c = bf16 ? at::mm(a16, b16) : at::mm(a, b);
      if (i >= 3) ms[bf16].push_back(ms_since(start));
    }
  }
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    const double p50 = percentile(ms[bf16], 0.5);
    const double gflops = 2.0 * static_cast<double>(batch) * kHidden * kHidden / (p50 * 1e6);
    std::printf("{\"impl\":\"dtrain\",\"case\":\"mm_%s\",\"p50_ms\":%.3f,\"gflops\":%.1f}\n", bf16 ? "bf16" : "fp32",
                p50, gflops);
  }
  std::fflush(stdout);
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain AMP step-time benchmark (fp32 vs bf16 autocast, CPU)"};
  int steps = 30, warmup = 3, batch = 128, threads = 1, block = 5;
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--batch", batch);
  app.add_option("--threads", threads);
  app.add_option("--block", block, "steps of one loop before switching to the other");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(threads);
    mm_cases(steps, batch);
    train_cases(steps, warmup, batch, std::max(1, block));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "amp_bench: error: %s\n", e.what());
    return 1;
  }
}
