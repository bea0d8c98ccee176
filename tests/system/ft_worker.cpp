// One rank of a replica group for the fault-tolerance system test
// (tests/system/ft_test.cpp), started by `dtrain run --ft-replicas N`:
// trains the MLP of ft_model.h through ft::FaultTolerantReplicas. With
// WORLD_SIZE k > 1 the replica group's ranks average their gradients first
// (one all-reduce over the group, as DDP would); rank i of replica r draws
// the batch of data replica r * k + i. Rank 0 writes the log.
//   FT_DIR (required): replica_<r>.log gets one line per committed step,
//     "step S quorum Q members a,b,c first_sample F incarnation I pid P t_ms T",
//     and "recovered S pid P t_ms T" when it loaded a peer's state (T: the
//     wall clock in ms, for figures); final_<r>_<i>.pt
//     each rank's final parameters (torch::save of the list).
//   FT_STEPS (default 60), FT_STEP_MS (sleep per step, default 20),
//   FT_RESTART_DELAY_MS (a restarted replica waits this long before it
//   joins, as a replacement machine would take; default 0).
// A restarted replica (TORCHELASTIC_RESTART_COUNT > 0) initialises its model
// from another seed: everything it ends with must come from its peer.
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include "dtrain/dtrain.h"
#include "ft_model.h"

namespace {
std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}
std::int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}
}  // namespace

int main() {
  namespace ft = dtrain::ft;
  namespace problem = dtrain::testing::ft_problem;
  return dtrain::elastic::run_recording_errors([] {
    const std::string dir = env_or("FT_DIR", "");
    const int steps = std::stoi(env_or("FT_STEPS", "60"));
    const int step_ms = std::stoi(env_or("FT_STEP_MS", "20"));
    const auto endpoint = ft::lighthouse_from_env();
    const int restart = std::stoi(env_or("TORCHELASTIC_RESTART_COUNT", "0"));
    at::set_num_threads(1);
    if (restart > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(std::stoi(env_or("FT_RESTART_DELAY_MS", "0"))));
    auto model = problem::make_model(restart == 0 ? 0 : 1000 + restart);
    auto optimizer = problem::make_optimizer(model);
    ft::LighthouseClient client(endpoint.candidates,
                                {.replica_id = endpoint.replica_id, .commit_timeout = std::chrono::seconds(5)});
    const int k = std::stoi(env_or("WORLD_SIZE", "1"));
    std::optional<dtrain::dist::ProcessGroup> replica_group;
    if (k > 1) replica_group = dtrain::dist::init_process_group();
    const int local = replica_group ? replica_group->rank() : 0;
    ft::FaultTolerantReplicas replicas(client, ft::module_and_optimizer_state(*model, optimizer),
                                       {.replica_group = replica_group, .group_timeout = std::chrono::seconds(5)});
    const int r = endpoint.replica_id;
    const int data_replica = r * k + local;
    std::ofstream log;
    if (local == 0) log.open(dir + "/replica_" + std::to_string(r) + ".log", std::ios::app);
    while (replicas.step() < steps) {
      replicas.start_step();
      if (replicas.recovered()) {
        log << "recovered " << replicas.step() << " pid " << ::getpid() << " t_ms " << unix_ms() << std::endl;
      }
      const std::int64_t step = replicas.step();
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));  // the rest of a real step's compute
      problem::compute_gradients(model, step, data_replica);
      std::vector<at::Tensor> grads;
      for (auto& p : model->parameters()) grads.push_back(p.grad());
      if (replica_group) replica_group->all_reduce_coalesced(grads, dtrain::dist::ReduceOp::kAvg).wait();
      replicas.all_reduce_gradients(grads);
      if (!replicas.should_commit()) continue;
      optimizer.step();
      std::string members;
      for (const auto& m : replicas.quorum().members)
        members += (members.empty() ? "" : ",") + std::to_string(m.replica_id);
      log << "step " << step << " quorum " << replicas.quorum().quorum_id << " members " << members << " first_sample "
          << problem::first_sample(step, data_replica) << " incarnation " << client.incarnation() << " pid "
          << ::getpid() << " t_ms " << unix_ms() << std::endl;
    }
    replicas.finish();  // a group that asks later is told the training is over
    std::vector<at::Tensor> params;
    for (auto& p : model->parameters()) params.push_back(p.detach().clone());
    torch::save(params, dir + "/final_" + std::to_string(r) + "_" + std::to_string(local) + ".pt");
    return 0;
  });
}
