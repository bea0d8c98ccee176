// Job schedulers' and MPI launchers' environments: Slurm (srun), Open MPI
// (mpirun) and MPICH/PMI (mpiexec), read from their own variables so a
// program started by them needs no wrapper. `read_env_contract` (env.h) falls
// back to these when torchrun's RANK/WORLD_SIZE are not set, and `dtrain run`
// reads them to find its node count, node rank and rendezvous endpoint when
// started once per node under srun or mpirun. See docs/clusters.md.
//
// Which launcher: the first of these whose variables are present.
//   Slurm      a task of an srun step (SLURM_STEP_ID set: the batch script's
//              own shell is not a task, and is refused rather than taken for
//              rank 0): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID; the
//              node's task count from SLURM_STEP_TASKS_PER_NODE (or
//              SLURM_TASKS_PER_NODE); the master is the first host of
//              SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), the port derived
//              from SLURM_CLUSTER_NAME, SLURM_JOB_ID and SLURM_STEP_ID.
//   Open MPI   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; the port
//              derived from its job id (OMPI_MCA_ess_base_jobid, PMIX_NAMESPACE).
//   MPICH/PMI  PMI_RANK, PMI_SIZE; MPI_LOCALRANKID, MPI_LOCALNRANKS (Hydra).
// MASTER_ADDR and MASTER_PORT, when set, override the master found above.
// MPI launchers do not say which host rank 0 runs on: on one node it is
// 127.0.0.1, across nodes MASTER_ADDR must be passed (mpirun -x MASTER_ADDR=...).
// Under mpirun inside a Slurm allocation the SLURM_* variables describe
// mpirun's daemons, not the ranks: Slurm's are used only where they agree
// with the MPI launcher's.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/env.h"

namespace dtrain::dist {

struct ClusterTask {
  EnvSource source = EnvSource::kSlurm;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = -1;  // -1: the launcher does not say (MPI)
  int nnodes = -1;     // -1: the launcher does not say
  std::string master_addr;
  int master_port = 0;
  std::string job_id;  // "" when the launcher has none
  std::string origin;  // where master_addr and master_port came from, for the log line
};

// The task as the first present launcher describes it; std::nullopt when
// none of their variables are set. Throws ConfigError naming the variable
// when a launcher's set is incomplete or malformed (a half-set environment).
std::optional<ClusterTask> read_cluster_task(const EnvLookup& env = process_env());

// The worker contract for `task` (source, master and local sizes carried over).
EnvContract to_contract(const ClusterTask& task);

namespace detail {
// True when the process was started as one of a job's tasks: by srun
// (SLURM_PROCID and SLURM_STEP_ID), mpirun (OMPI_COMM_WORLD_RANK) or mpiexec (PMI_RANK).
bool cluster_launcher_present(const EnvLookup& env);
// Slurm's compressed host list, e.g. "node[01-03,7],gpu-a[1-2]" -> node01
// node02 node03 node7 gpu-a1 gpu-a2 (zero padding kept). Throws ConfigError
// naming `what` for unbalanced brackets, empty or reversed ranges, non-digits
// in a range, or empty names. Stops after `limit` hosts.
std::vector<std::string> expand_nodelist(const std::string& what, const std::string& text, std::size_t limit = 1 << 16);
// Slurm's tasks per node, e.g. "2(x3),1" -> 2 2 2 1.
std::vector<int> expand_tasks_per_node(const std::string& what, const std::string& text);
// A port in 15000..31999 from a job id (and step), so every task of a job
// computes the same one without talking; below Linux's ephemeral range.
int port_from_job_id(const std::string& job_id, int step = 0);
}  // namespace detail

}  // namespace dtrain::dist
