// One rank of a replica group for the fault-tolerance system test
// (tests/system/ft_test.cpp), trained by dtrain::Trainer with
// TrainerOptions::fault_tolerance under `dtrain run --ft-replicas N`: the
// same problem (ft_model.h), environment and log lines as ft_worker.cpp,
// which trains through ft::FaultTolerantReplicas by hand. With WORLD_SIZE
// k > 1 the replica group's ranks are a DdpStrategy, or with FT_ZERO_STAGE
// s a ZeroStrategy of stage s sharded over them; the Trainer gives rank i
// of replica r data rank r * k + i. A restarted replica
// (TORCHELASTIC_RESTART_COUNT > 0) starts from another seed. FT_CKPT_DIR
// (and FT_CKPT_EVERY): the Trainer's checkpoints, written by one replica
// group, resumed by all when the whole job starts again. FT_OBSERVE=1: the
// Trainer's metrics (FT_DIR/metrics.jsonl) and trace (FT_DIR/trace.json).
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "dtrain/dtrain.h"
#include "ft_model.h"

namespace {
std::string ft_trainer_env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}
std::int64_t ft_trainer_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}
}  // namespace

int main() {
  namespace problem = dtrain::testing::ft_problem;
  return dtrain::elastic::run_recording_errors([] {
    const std::string dir = ft_trainer_env("FT_DIR", "");
    const int steps = std::stoi(ft_trainer_env("FT_STEPS", "60"));
    const int step_ms = std::stoi(ft_trainer_env("FT_STEP_MS", "20"));
    const int restart = std::stoi(ft_trainer_env("TORCHELASTIC_RESTART_COUNT", "0"));
    const int r = dtrain::ft::lighthouse_from_env().replica_id;
    at::set_num_threads(1);
    if (restart > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(ft_trainer_env("FT_RESTART_DELAY_MS", "0"))));
    }
    auto model = problem::make_model(restart == 0 ? 0 : 1000 + restart);
    const int k = std::stoi(ft_trainer_env("WORLD_SIZE", "1"));
    const int zero_stage = std::stoi(ft_trainer_env("FT_ZERO_STAGE", "0"));
    const c10::Device cpu(c10::kCPU);
    std::shared_ptr<dtrain::Strategy> strategy;
    int local = 0;
    if (k > 1 && zero_stage > 0) {
      auto group = dtrain::dist::init_process_group();
      local = group.rank();
      auto sdp = std::make_shared<dtrain::ShardedDataParallel>(model, group, dtrain::ZeroOptions{.stage = zero_stage});
      strategy = std::make_shared<dtrain::ZeroStrategy>(sdp, cpu);
    } else if (k > 1) {
      auto group = dtrain::dist::init_process_group();
      local = group.rank();
      strategy = std::make_shared<dtrain::DdpStrategy<torch::nn::Sequential>>(model, group, cpu, cpu);
    } else {
      strategy = std::make_shared<dtrain::SingleDeviceStrategy<torch::nn::Sequential>>(model, cpu);
    }
    // The first sample of the batch the Trainer last asked for (the audit
    // logs what was trained on, not what should have been).
    auto drawn = std::make_shared<std::int64_t>(-1);
    auto stream = std::make_shared<dtrain::StepStream>([step_ms, drawn](const dtrain::StepStream::Request& q) {
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));  // the rest of a real step's compute
      *drawn = problem::first_sample(q.step, q.data_rank);
      auto [x, y] = problem::batch(q.step, q.data_rank);
      return dtrain::data::TensorBatch{x, y};
    });
    std::ofstream log;
    if (local == 0) log.open(dir + "/replica_" + std::to_string(r) + ".log", std::ios::app);
    dtrain::TrainerFaultTolerance ft{
        .client = {.commit_timeout = std::chrono::seconds(5)},
        .group_timeout = std::chrono::seconds(5),
        .on_commit =
            [&](std::int64_t step, const dtrain::ft::Quorum& quorum) {
              if (local != 0) return;
              std::string members;
              std::int64_t incarnation = 0;
              for (const auto& m : quorum.members) {
                members += (members.empty() ? "" : ",") + std::to_string(m.replica_id);
                if (m.replica_id == r) incarnation = m.incarnation;
              }
              log << "step " << step << " quorum " << quorum.quorum_id << " members " << members << " first_sample "
                  << *drawn << " incarnation " << incarnation << " pid " << ::getpid() << " t_ms "
                  << ft_trainer_unix_ms() << std::endl;
            },
        .on_recover =
            [&](std::int64_t step) {
              if (local == 0) {
                log << "recovered " << step << " pid " << ::getpid() << " t_ms " << ft_trainer_unix_ms() << std::endl;
              }
            }};
    // FT_OBSERVE=1: metrics every 5 steps and a trace, as a user would ask for them.
    const bool observe = ft_trainer_env("FT_OBSERVE", "0") == "1";
    auto optimizer = problem::make_optimizer(strategy->parameters());
    dtrain::Trainer trainer(strategy, optimizer, stream,
                            {.max_steps = steps,
                             .batch_size = problem::kBatch,
                             .checkpoint_dir = ft_trainer_env("FT_CKPT_DIR", ""),
                             .checkpoint_every = std::stoi(ft_trainer_env("FT_CKPT_EVERY", "0")),
                             .progress = false,
                             .log_every = observe ? 5 : 1000,
                             .metrics_jsonl = observe ? dir + "/metrics.jsonl" : "",
                             .trace_file = observe ? dir + "/trace.json" : "",
                             .fault_tolerance = ft});
    trainer.fit();
    auto full = strategy->full_parameters();  // ZeRO: gathers the stepped chunks (collective)
    std::vector<at::Tensor> params;
    for (auto& p : model->parameters()) params.push_back(p.detach().clone());
    torch::save(params, dir + "/final_" + std::to_string(r) + "_" + std::to_string(local) + ".pt");
    return 0;
  });
}
