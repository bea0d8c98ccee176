// Training-step time in fp32 and under bf16 autocast + GradScaler on the CPU,
// for a matmul-heavy MLP, in one process. bench/amp/peer.py runs the same
// loop in Python (torch.autocast + torch.amp.GradScaler). Prints one JSON line
// per case:
//   {"impl":"dtrain","case":"mlp_fp32"|"mlp_bf16","params":..,"p50_ms":..,"p95_ms":..,"final_loss":..}
// and, for the explanation of the figures, the forward matmul alone:
//   {"impl":"dtrain","case":"mm_fp32"|"mm_bf16","p50_ms":..,"gflops":..}
//
//   amp_bench --steps 30 --batch 256 --threads 1
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "dtrain/amp/autocast.h"
#include "dtrain/amp/grad_scaler.h"

namespace {
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

constexpr std::int64_t kIn = 1024, kHidden = 4096, kClasses = 16;

// 1024-4096-4096-1024-16: ~25 M parameters, nearly all time in three big matmuls.
torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(), torch::nn::Linear(kHidden, kHidden),
                               torch::nn::ReLU(), torch::nn::Linear(kHidden, kIn), torch::nn::ReLU(),
                               torch::nn::Linear(kIn, kClasses));
}

void train_case(bool bf16, int steps, int warmup, int batch) {
  torch::manual_seed(0);
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), 0.01);
  dtrain::amp::GradScaler scaler({.enabled = bf16});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor x = at::randn({batch, kIn}, gen);
  const at::Tensor y = at::randint(0, kClasses, {batch}, gen, at::kLong);
  std::int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  std::vector<double> step_ms;
  double loss_value = 0;
  for (int i = 0; i < warmup + steps; ++i) {
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
    if (i >= warmup) step_ms.push_back(ms_since(start));
    loss_value = loss.item<double>();
  }
  std::printf(
      "{\"impl\":\"dtrain\",\"case\":\"mlp_%s\",\"params\":%lld,\"batch\":%d,\"p50_ms\":%.3f,\"p95_ms\":%.3f,"
      "\"final_loss\":%.4f}\n",
      bf16 ? "bf16" : "fp32", static_cast<long long>(numel), batch, percentile(step_ms, 0.5), percentile(step_ms, 0.95),
      loss_value);
  std::fflush(stdout);
}

// The hidden layer's forward matmul alone, in each dtype.
void mm_case(bool bf16, int steps, int batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor a = at::randn({batch, kHidden}, gen).to(dtype), b = at::randn({kHidden, kHidden}, gen).to(dtype);
  std::vector<double> ms;
  for (int i = 0; i < steps + 3; ++i) {
    const auto start = Clock::now();
    const at::Tensor c = at::mm(a, b);
    if (i >= 3) ms.push_back(ms_since(start));
  }
  const double p50 = percentile(ms, 0.5);
  const double gflops = 2.0 * static_cast<double>(batch) * kHidden * kHidden / (p50 * 1e6);
  std::printf("{\"impl\":\"dtrain\",\"case\":\"mm_%s\",\"p50_ms\":%.3f,\"gflops\":%.1f}\n", bf16 ? "bf16" : "fp32", p50,
              gflops);
  std::fflush(stdout);
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain AMP step-time benchmark (fp32 vs bf16 autocast, CPU)"};
  int steps = 30, warmup = 5, batch = 256, threads = 1;
  std::string mode = "all";
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--batch", batch);
  app.add_option("--threads", threads);
  app.add_option("--mode", mode)->check(CLI::IsMember({"all", "fp32", "bf16", "mm"}));
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(threads);
    if (mode == "all" || mode == "mm") {
      mm_case(false, steps, batch);
      mm_case(true, steps, batch);
    }
    if (mode == "all" || mode == "fp32") train_case(false, steps, warmup, batch);
    if (mode == "all" || mode == "bf16") train_case(true, steps, warmup, batch);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "amp_bench: error: %s\n", e.what());
    return 1;
  }
}
