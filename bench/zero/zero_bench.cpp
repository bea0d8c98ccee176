// ZeRO stages 1-3 against DDP on examples/gpt's GPT, one process per rank
// (env contract, CPU, one OpenMP thread). bench/zero/peer.py measures torch
// DDP, FSDP2 (fully_shard) and ZeroRedundancyOptimizer the same way. Rank 0
// prints one JSON line:
//   {"impl":"dtrain","case":"zero3","params":..,"p50_ms":..,"p95_ms":..,
//    "param_bytes":..,"grad_bytes":..,"optimizer_bytes":..,"peak_bytes":..,"formula_bytes":..}
// Memory is measured from the live tensors' storages (each storage once):
// parameters at their peak during forward/backward (stage 3: its gathered
// units included), gradients right after backward, optimizer state after the
// step; resident_bytes counts the parameters held between steps instead of
// their peak (stage 3: its shards, without the units gathered for compute,
// which come and go like activations); formula_bytes is fp32 AdamW's: DDP 16P, stage 1 8P + 8P/N, stage 2
// 4P + 12P/N, stage 3 16P/N. With --bf16 (ZeRO only: MixedPrecisionPolicy
// bf16 parameters and reductions, fp32 master shards) it is the paper's
// mixed-precision Adam: stage 1 4P + 12P/N, stage 2 2P + 14P/N, stage 3 16P/N
// (case "zeroK_bf16"). With --replicas R (HSDP, stage 3 only) the world is
// R replicas of world/R sharding ranks (dp_replicate x dp_shard, as FSDP2
// with a 2-D mesh): case "hsdp<R>x<world/R>", formula 16P/(world/R).
//
//   zero_bench --strategy ddp|zero1|zero2|zero3 [--bf16] [--replicas R] --steps 30 --batch 12 --block 64
#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/optim/adamw.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <unordered_set>
#include <vector>

#include "../common/timing.h"
#include "dtrain/dtrain.h"
#include "model.h"
#include "zero_strategy.h"

namespace {

using dtrain::bench::Clock;
using dtrain::bench::ms_since;
using dtrain::bench::percentile;

// Bytes of the distinct storages behind `tensors`, added to `seen`.
std::int64_t storage_bytes(const std::vector<at::Tensor>& tensors, std::unordered_set<const void*>& seen) {
  std::int64_t bytes = 0;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    const void* s = t.storage().unsafeGetStorageImpl();
    if (seen.insert(s).second) bytes += static_cast<std::int64_t>(t.storage().nbytes());
  }
  return bytes;
}

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.grad());
  return out;
}

std::vector<at::Tensor> optimizer_tensors(torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& [key, state] : opt.state()) {
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      out.push_back(s->exp_avg());
      out.push_back(s->exp_avg_sq());
      if (s->max_exp_avg_sq().defined()) out.push_back(s->max_exp_avg_sq());
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeRO / DDP step time and memory on the GPT (one rank)"};
  std::string strategy = "zero3";
  int steps = 30, warmup = 5;
  std::int64_t batch = 12;
  gpt::GptConfig config{.vocab_size = 65, .block_size = 64, .n_layer = 4, .n_head = 4, .n_embd = 128};
  app.add_option("--strategy", strategy)->check(CLI::IsMember({"ddp", "zero1", "zero2", "zero3"}));
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--batch", batch);
  app.add_option("--block", config.block_size);
  app.add_option("--n-layer", config.n_layer);
  app.add_option("--n-embd", config.n_embd);
  bool bf16 = false;
  app.add_flag("--bf16", bf16, "ZeRO with bf16 parameters and reductions, fp32 master shards");
  int replicas = 1;
  app.add_option("--replicas", replicas, "HSDP: replicas (dp_replicate) of ZeRO-3 over the rest")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    auto group = dtrain::dist::init_process_group();
    const int world = group.size();
    std::optional<dtrain::dist::DeviceMesh> mesh;
    dtrain::dist::ProcessGroup shard_group = group;
    if (replicas > 1) {
      DTRAIN_CHECK(strategy == "zero3" && world % replicas == 0, ConfigError,
                   "--replicas " << replicas << " needs --strategy zero3 and a world it divides (" << world << ").",
                   "pass --strategy zero3 and a divisor of the world");
      mesh.emplace(group,
                   std::vector<dtrain::dist::MeshDim>{{"dp_replicate", replicas}, {"dp_shard", world / replicas}});
      shard_group = (*mesh)["dp_shard"];
    }
    gpt::Gpt net(config);
    gpt::init_weights(*net, config.n_layer, 1337);
    std::int64_t numel = 0;
    for (const auto& p : net->parameters()) numel += p.numel();  // the tied embedding once (it is one tensor)

    std::optional<dtrain::DistributedDataParallel<gpt::Gpt>> ddp;
    std::optional<dtrain::ShardedDataParallel> sdp;
    std::vector<at::Tensor> opt_params;
    if (strategy == "ddp") {
      ddp.emplace(net, group, dtrain::DDPOptions{.gradient_as_bucket_view = true});
      opt_params = net->parameters();
    } else {
      auto options = gpt::zero_options(strategy);
      if (bf16) options.mixed_precision = {.param_dtype = at::kBFloat16, .reduce_dtype = at::kBFloat16};
      if (mesh) options.replicate_group = (*mesh)["dp_replicate"];
      sdp.emplace(net, shard_group, options);
      opt_params = sdp->parameters();
    }
    torch::optim::AdamW opt(opt_params, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + group.rank());
    const at::Tensor x = at::randint(0, config.vocab_size, {batch, config.block_size}, gen, at::kLong);
    const at::Tensor y = at::randint(0, config.vocab_size, {batch, config.block_size}, gen, at::kLong);

    std::vector<double> step_ms;
    std::int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0, resident_param_bytes = 0;
    for (int i = 0; i < warmup + steps; ++i) {
      group.barrier();
      const auto start = Clock::now();
      if (sdp) sdp->reset_peak();
      at::Tensor loss = gpt::lm_loss(ddp ? (*ddp)(x) : (*sdp)(x), y);
      loss.backward();
      if (i == warmup) {  // the measured step: gradients as backward leaves them
        std::unordered_set<const void*> seen;
        param_bytes = sdp ? sdp->memory_stats().peak_parameter_bytes : storage_bytes(net->parameters(), seen);
        if (sdp) {
          storage_bytes(net->parameters(), seen);
          for (const auto& s : sdp->parameters()) storage_bytes({s}, seen);
        }
        grad_bytes = storage_bytes(grads_of(net->parameters()), seen) + storage_bytes(grads_of(opt_params), seen);
      }
      opt.step();
      if (ddp) {
        ddp->zero_grad();
      } else {
        opt.zero_grad();
      }
      if (i == warmup) {
        std::unordered_set<const void*> seen;
        optimizer_bytes = storage_bytes(optimizer_tensors(opt), seen);
        resident_param_bytes = sdp ? sdp->memory_stats().parameter_bytes : param_bytes;  // between steps
      }
      if (i >= warmup) step_ms.push_back(ms_since(start));
    }
    group.barrier();
    if (group.rank() == 0) {
      const double p = static_cast<double>(numel) * 4.0, n = shard_group.size();  // p: one fp32 copy (4 psi)
      double formula = strategy == "ddp"     ? 4 * p
                       : strategy == "zero1" ? 2 * p + 2 * p / n
                       : strategy == "zero2" ? p + 3 * p / n
                                             : 4 * p / n;
      if (bf16) {
        formula = strategy == "zero1" ? p + 3 * p / n : strategy == "zero2" ? p / 2 + 3.5 * p / n : 4 * p / n;
      }
      if (bf16 && strategy != "ddp") strategy += "_bf16";
      if (replicas > 1) strategy = "hsdp" + std::to_string(replicas) + "x" + std::to_string(world / replicas);
      std::printf(
          "{\"impl\":\"dtrain\",\"case\":\"%s\",\"world\":%d,\"params\":%lld,\"p50_ms\":%.3f,\"p95_ms\":%.3f,"
          "\"param_bytes\":%lld,\"grad_bytes\":%lld,\"optimizer_bytes\":%lld,\"peak_bytes\":%lld,"
          "\"resident_bytes\":%lld,\"formula_bytes\":%.0f,\"linear_kernel\":\"%s\"}\n",
          strategy.c_str(), world, static_cast<long long>(numel), percentile(step_ms, 0.5), percentile(step_ms, 0.95),
          static_cast<long long>(param_bytes), static_cast<long long>(grad_bytes),
          static_cast<long long>(optimizer_bytes), static_cast<long long>(param_bytes + grad_bytes + optimizer_bytes),
          static_cast<long long>(resident_param_bytes + grad_bytes + optimizer_bytes), formula,
          dtrain::nn::linear_kernel_name());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
