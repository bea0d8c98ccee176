// DDP step time under dtrain, one process per rank (env contract, Gloo).
// bench/ddp/peer.py measures torch.nn.parallel.DistributedDataParallel the
// same way. Rank 0 prints one JSON line:
//   {"impl":"dtrain","case":..,"params":..,"p50_ms":..,"p95_ms":..,
//    "backward_local_ms":..,"allreduce_ms":..,"backward_ddp_ms":..,"hidden_fraction":..}
// where hidden_fraction = (local backward + all-reduce of all gradients -
// DDP backward) / all-reduce, clamped to [0, 1]: the share of communication
// that overlapped with backward.
//
//   ddp_bench --model small|large --bucket-cap-mb 25 --steps 200 --batch 32
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

#include "dtrain/dtrain.h"

namespace {
using Clock = std::chrono::steady_clock;

using dtrain::bench::ms_since;

using dtrain::bench::percentile;

// small: 784-128-10 (~0.1 M parameters). large: 1024-4096-4096-10 (~21 M).
torch::nn::Sequential make_model(const std::string& name, std::int64_t& in_features) {
  if (name == "small") {
    in_features = 784;
    return torch::nn::Sequential(torch::nn::Linear(784, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10));
  }
  in_features = 1024;
  return torch::nn::Sequential(torch::nn::Linear(1024, 4096), torch::nn::ReLU(), torch::nn::Linear(4096, 4096),
                               torch::nn::ReLU(), torch::nn::Linear(4096, 10));
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtrain DDP step-time benchmark (one rank)"};
  std::string model_name = "small";
  double bucket_cap_mb = 25;
  int steps = 200, warmup = 20, batch = 32;
  bool bucket_view = false;
  app.add_option("--model", model_name)->check(CLI::IsMember({"small", "large"}));
  app.add_option("--bucket-cap-mb", bucket_cap_mb);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--batch", batch);
  app.add_flag("--bucket-view", bucket_view, "gradient_as_bucket_view");
  bool gloo_only = false;
  app.add_flag("--gloo", gloo_only, "all-reduce through Gloo, not the intra-host shared memory (dtrain's default)");
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    auto group = dtrain::dist::init_process_group({.intra_host_shared_memory = !gloo_only});
    torch::manual_seed(0);
    std::int64_t in_features = 0;
    auto model = make_model(model_name, in_features);
    dtrain::DistributedDataParallel ddp(model, group,
                                        {.bucket_cap_mb = bucket_cap_mb, .gradient_as_bucket_view = bucket_view});
    torch::optim::SGD opt(model->parameters(), 0.01);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(group.rank());
    const at::Tensor x = at::randn({batch, in_features}, gen);
    const at::Tensor y = at::randint(0, 10, {batch}, gen, at::kLong);
    std::int64_t numel = 0;
    for (const auto& p : model->parameters()) numel += p.numel();

    std::vector<double> step_ms, backward_ms;
    for (int i = 0; i < warmup + steps; ++i) {
      const auto start = Clock::now();
      ddp.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(ddp(x), y);
      const auto backward_start = Clock::now();
      loss.backward();
      const double backward = ms_since(backward_start);
      opt.step();
      if (i >= warmup) {
        step_ms.push_back(ms_since(start));
        backward_ms.push_back(backward);
      }
    }
    // Backward without communication, and one all-reduce of all gradients.
    const int probes = std::max(5, steps / 4);
    std::vector<double> local_ms, allreduce_ms;
    {
      auto guard = ddp.no_sync();
      for (int i = 0; i < probes; ++i) {
        ddp.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(ddp(x), y);
        const auto start = Clock::now();
        loss.backward();
        local_ms.push_back(ms_since(start));
      }
    }
    at::Tensor flat = at::zeros({numel});
    for (int i = 0; i < probes; ++i) {
      group.barrier();
      const auto start = Clock::now();
      group.all_reduce(flat).wait();
      allreduce_ms.push_back(ms_since(start));
    }
    group.barrier();
    if (group.rank() == 0) {
      const double local = percentile(local_ms, 0.5), comm = percentile(allreduce_ms, 0.5),
                   ddp_bwd = percentile(backward_ms, 0.5);
      const double hidden = std::clamp((local + comm - ddp_bwd) / comm, 0.0, 1.0);
      std::printf(
          "{\"impl\":\"dtrain\",\"case\":\"%s_mlp_cap%gMB%s%s\",\"params\":%lld,\"p50_ms\":%.3f,\"p95_ms\":%.3f,"
          "\"backward_local_ms\":%.3f,\"allreduce_ms\":%.3f,\"backward_ddp_ms\":%.3f,\"hidden_fraction\":%.3f}\n",
          model_name.c_str(), bucket_cap_mb, bucket_view ? "_view" : "", gloo_only ? "_gloo" : "",
          static_cast<long long>(numel), percentile(step_ms, 0.5), percentile(step_ms, 0.95), local, comm, ddp_bwd,
          hidden);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench: error: %s\n", e.what());
    return 1;
  }
}
