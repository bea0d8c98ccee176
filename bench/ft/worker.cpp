// One rank of bench/ft (run.py): an MLP trained by dtrain::Trainer from a
// StepStream, in one of two modes, logging every step it commits with the
// wall clock, so run.py can tell when a fault was healed and which steps
// were trained twice:
//   --mode ft    one fault-tolerant replica group of `dtrain run
//                --ft-replicas N` (TrainerOptions::fault_tolerance);
//                lines "step S members M pid P t_ms T" and
//                "recovered S pid P t_ms T";
//   --mode ddp   one rank of plain DDP over the whole world (fault tolerance
//                off), checkpointing every --checkpoint-every steps to
//                --checkpoint-dir when given (restart-from-checkpoint under
//                `dtrain run --max-restarts`); lines "step S members W pid P t_ms T".
// Rank 0 of each replica group writes LOG_DIR/log_<replica>.txt; in ddp
// mode every rank writes log_<rank>.txt.
//
//   worker --mode ft --log-dir D --steps 300 --width 512 --depth 4 --batch 32
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>

#include "dtrain/dtrain.h"

namespace {

// Wall clock in ms, to the microsecond ("t_ms 1764089000123.456"): steps of a
// few ms need the fraction.
std::string unix_ms() {
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  char text[32];
  std::snprintf(text, sizeof text, "%lld.%03lld", static_cast<long long>(us / 1000), static_cast<long long>(us % 1000));
  return text;
}

torch::nn::Sequential make_mlp(int width, int depth) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < depth; ++i) {
    model->push_back(torch::nn::Linear(width, width));
    model->push_back(torch::nn::Tanh());
  }
  model->push_back(torch::nn::Linear(width, 16));
  return model;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("bench/ft worker");
  std::string mode = "ft", log_dir, checkpoint_dir;
  int steps = 300, width = 512, depth = 4, checkpoint_every = 20;
  std::int64_t batch = 32;
  app.add_option("--mode", mode)->check(CLI::IsMember({"ft", "ddp"}));
  app.add_option("--log-dir", log_dir)->required();
  app.add_option("--steps", steps);
  app.add_option("--width", width);
  app.add_option("--depth", depth);
  app.add_option("--batch", batch);
  app.add_option("--checkpoint-dir", checkpoint_dir);
  app.add_option("--checkpoint-every", checkpoint_every);
  CLI11_PARSE(app, argc, argv);
  return dtrain::elastic::run_recording_errors([&] {
    at::set_num_threads(1);
    auto model = make_mlp(width, depth);
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
    const c10::Device cpu(c10::kCPU);
    const int world = std::stoi(dtrain::dist::process_env()("WORLD_SIZE").value_or("1"));
    std::shared_ptr<dtrain::Strategy> strategy;
    int rank = 0;
    if (world > 1) {
      auto group = dtrain::dist::init_process_group();
      rank = group.rank();
      strategy = std::make_shared<dtrain::DdpStrategy<torch::nn::Sequential>>(model, group, cpu, cpu);
    } else {
      strategy = std::make_shared<dtrain::SingleDeviceStrategy<torch::nn::Sequential>>(model, cpu);
    }
    auto stream = std::make_shared<dtrain::StepStream>([width, batch](const dtrain::StepStream::Request& q) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(q.step * 1000 + q.data_rank));
      return dtrain::data::TensorBatch{at::randn({batch, width}, gen, at::kFloat),
                                       at::randint(0, 16, {batch}, gen, at::kLong)};
    });
    // ft: rank 0 of each replica group logs; ddp: every rank (the victim's pid is in its log).
    const bool ft = mode == "ft";
    const int replica = ft ? dtrain::ft::lighthouse_from_env().replica_id : rank;
    const bool logs = !ft || rank == 0;
    std::ofstream log;
    if (logs) log.open(log_dir + "/log_" + std::to_string(replica) + ".txt", std::ios::app);
    dtrain::TrainerOptions options{.max_steps = steps, .batch_size = batch, .progress = false, .log_every = 1000};
    if (ft) {
      options.fault_tolerance = dtrain::TrainerFaultTolerance{
          .client = {.commit_timeout = std::chrono::seconds(5)},
          .group_timeout = std::chrono::seconds(5),
          .on_commit =
              [&](std::int64_t step, const dtrain::ft::Quorum& quorum) {
                if (rank != 0) return;
                log << "step " << step << " members " << quorum.members.size() << " pid " << ::getpid() << " t_ms "
                    << unix_ms() << std::endl;
              },
          .on_recover =
              [&](std::int64_t step) {
                if (rank == 0)
                  log << "recovered " << step << " pid " << ::getpid() << " t_ms " << unix_ms() << std::endl;
              }};
    } else {
      options.checkpoint_dir = checkpoint_dir;
      options.checkpoint_every = checkpoint_every;
    }
    dtrain::Trainer trainer(strategy, optimizer, stream, options);
    if (!ft) {
      trainer.on_step([&](const dtrain::StepReport& report) {
        log << "step " << report.step - 1 << " members " << world << " pid " << ::getpid() << " t_ms " << unix_ms()
            << std::endl;
      });
    }
    const dtrain::TrainSummary summary = trainer.fit();
    if (logs) {
      // Where this rank's steps went outside the fault-tolerant calls (their
      // own split is in the worker's log: FaultTolerantReplicas' last line).
      const double n = static_cast<double>(std::max<std::int64_t>(1, summary.steps));
      log << "times steps " << summary.steps << " forward_ms " << summary.step_times.forward * 1e3 / n
          << " backward_ms " << summary.step_times.backward * 1e3 / n << " optimizer_ms "
          << summary.step_times.optimizer * 1e3 / n << " train_ms " << summary.train_seconds * 1e3 / n << std::endl;
    }
    return 0;
  });
}
