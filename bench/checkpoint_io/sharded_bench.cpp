// Save and load time of a sharded checkpoint written by 4 ranks: dtrain's
// ZeRO-3 (ShardedCheckpointer: every rank its part, CRCs, MANIFEST last,
// fsync'd) against PyTorch FSDP2 with DCP (sharded_peer.py, same model,
// same optimizer, same ranks). The model: `layers` Linear(width, width)
// layers (default 16 x 1024 x 1024 + bias: 67 MB of fp32 parameters, 201 MB
// with AdamW's two moments), one AdamW step taken so the state exists. Ranks
// are threads of this process over an in-memory store (Gloo); prints one JSON
// line per case: {"impl", "case", "seconds", "gb_per_s"} (GB of parameters +
// optimizer state).
#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "../common/timing.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "dtrain/parallel/zero/sharded_checkpoint.h"
#include "dtrain/parallel/zero/sharded_data_parallel.h"

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/tmp";
  const std::int64_t layers = argc > 2 ? std::atoll(argv[2]) : 16;
  const std::int64_t width = argc > 3 ? std::atoll(argv[3]) : 1024;
  constexpr int kWorld = 4;
  at::set_num_threads(1);
  const double gb = static_cast<double>(layers * (width * width + width) * 4 * 3) / 1e9;
  const auto ckpt = std::filesystem::path(dir) / "dtrain_sharded_bench";
  std::filesystem::remove_all(ckpt);
  auto store = dtrain::dist::Store::in_memory();
  std::vector<double> save_s(kWorld), load_s(kWorld);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      auto group = dtrain::dist::init_process_group(store, rank, kWorld, {.timeout = std::chrono::seconds(600)});
      torch::nn::Sequential model;
      for (std::int64_t i = 0; i < layers; ++i) model->push_back(torch::nn::Linear(width, width));
      dtrain::ShardedDataParallel sdp(model, group, {.stage = 3});
      torch::optim::AdamW opt(sdp.parameters(), torch::optim::AdamWOptions(1e-3));
      opt.zero_grad();
      sdp(at::randn({2, width})).sum().backward();
      opt.step();
      dtrain::ShardedCheckpointer checkpointer({.dir = ckpt}, sdp, opt);
      group.barrier();
      auto t = dtrain::bench::Clock::now();
      checkpointer.save(1);
      save_s[rank] = dtrain::bench::ms_since(t) / 1e3;
      group.barrier();
      t = dtrain::bench::Clock::now();
      checkpointer.load_latest();
      group.barrier();
      load_s[rank] = dtrain::bench::ms_since(t) / 1e3;
    });
  }
  for (auto& t : ranks) t.join();
  auto report = [&](const char* name, double seconds) {
    std::printf("{\"impl\": \"dtrain\", \"case\": \"%s\", \"seconds\": %.4f, \"gb_per_s\": %.3f}\n", name, seconds,
                gb / seconds);
    std::fflush(stdout);
  };
  report("sharded_save_4_ranks", save_s[0]);
  report("sharded_load_4_ranks", load_s[0]);
  std::filesystem::remove_all(ckpt);
}
