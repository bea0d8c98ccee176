// Cluster launchers' environments (Slurm, Open MPI, MPICH/PMI) read through
// the one env contract: fake environments as srun and mpirun set them, the
// order in which launchers are recognised, half-set environments, and
// Slurm's compressed host lists, malformed ones included.
#include <gtest/gtest.h>

#include <map>

#include "dtrain/comm/cluster_env.h"
#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "fake_env.h"

using dtrain::ConfigError;
using dtrain::dist::EnvLookup;
using dtrain::dist::EnvSource;
using dtrain::dist::read_env_contract;
using dtrain::dist::detail::expand_nodelist;
using dtrain::dist::detail::expand_tasks_per_node;
using dtrain::dist::detail::port_from_job_id;
using dtrain::testing::expect_contains;
using dtrain::testing::fake_env;

namespace {
using Vars = std::map<std::string, std::string>;
using Hosts = std::vector<std::string>;

// Task `rank` of `srun -N 3 -n 5` (tasks per node 2,2,1) in job 4242, as srun sets it.
Vars slurm_task(int rank) {
  const int node = rank / 2;
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", "5"},
          {"SLURM_LOCALID", std::to_string(rank % 2)},
          {"SLURM_NODEID", std::to_string(node)},
          {"SLURM_JOB_ID", "4242"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_JOB_NODELIST", "gpu-a[07-09],cpu1"},
          {"SLURM_STEP_NODELIST", "gpu-a[07-09]"},
          {"SLURM_STEP_NUM_NODES", "3"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x2),1"}};
}

// Rank `rank` of `mpirun -n 2` on one node (Open MPI 4).
Vars open_mpi_rank(int rank) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", "2"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
          {"OMPI_MCA_ess_base_jobid", "987627521"}};
}

std::string config_error(const Vars& vars) {
  try {
    read_env_contract(fake_env(vars));
  } catch (const ConfigError& e) {
    EXPECT_FALSE(e.hint().empty()) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return {};
}

std::string nodelist_error(const std::string& text) {
  try {
    expand_nodelist("SLURM_JOB_NODELIST", text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "'" << text << "' was accepted";
  return {};
}

}  // namespace

TEST(Nodelist, ExpandsRangesListsAndPadding) {
  EXPECT_EQ(expand_nodelist("L", "node[01-03,7],gpu-a[1-2]"),
            (Hosts{"node01", "node02", "node03", "node7", "gpu-a1", "gpu-a2"}));
  EXPECT_EQ(expand_nodelist("L", "login"), Hosts{"login"});
  EXPECT_EQ(expand_nodelist("L", "n[8-10]"), (Hosts{"n8", "n9", "n10"}));
  EXPECT_EQ(expand_nodelist("L", "n[098-101]"), (Hosts{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand_nodelist("L", "a,b.example.org,c-1"), (Hosts{"a", "b.example.org", "c-1"}));
  EXPECT_EQ(expand_nodelist("L", "rack[1-2]-n[3-4]"), (Hosts{"rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"}));
  EXPECT_EQ(expand_nodelist("L", "node[5]x"), Hosts{"node5x"});
  EXPECT_EQ(expand_nodelist("L", "n[1-100000]", 3), (Hosts{"n1", "n2", "n3"}));  // stops at the limit
}

TEST(Nodelist, MalformedListsAreErrorsNamingTheVariable) {
  for (const std::string bad : {"", "node[01-03", "node01-03]", "node[]", "node[3-1]", "node[a-b]", "node[1-2],,x",
                                ",node1", "node1,", "[1-2]", "node[1-[2]]", "node[1-]", "node 1", "node[1,]",
                                "node[-3]", "node[1-2-3]", "node[99999999999999-99999999999999]"}) {
    SCOPED_TRACE(bad);
    expect_contains(nodelist_error(bad), {"SLURM_JOB_NODELIST"});
  }
  expect_contains(nodelist_error("node[3-1]"), {"backwards"});
  expect_contains(nodelist_error("node[01-03"), {"'[' without its ']'"});
  expect_contains(nodelist_error("node[1-2],,x"), {"empty host name"});
}

TEST(Nodelist, TasksPerNode) {
  EXPECT_EQ(expand_tasks_per_node("T", "2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(expand_tasks_per_node("T", "4"), (std::vector<int>{4}));
  for (const std::string bad : {"", "2(3)", "x", "2(x)", "2(x0)", "0", "2(x3", "2,,1"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(expand_tasks_per_node("T", bad), ConfigError);
  }
}

TEST(SlurmEnv, LogLineSaysWhereTheMasterCameFrom) {
  const auto task = dtrain::dist::read_cluster_task(fake_env(slurm_task(1)));
  ASSERT_TRUE(task.has_value());
  EXPECT_EQ(task->origin,
            "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID; master gpu-a07 = first host of "
            "SLURM_STEP_NODELIST, port " +
                std::to_string(port_from_job_id("4242")) + " from job 4242");
  EXPECT_EQ(task->nnodes, 3);
}

TEST(SlurmEnv, EveryTaskFindsTheSameMasterAndItsPlace) {
  for (int rank = 0; rank < 5; ++rank) {
    SCOPED_TRACE(rank);
    const auto c = read_env_contract(fake_env(slurm_task(rank)));
    EXPECT_EQ(c.source, EnvSource::kSlurm);
    EXPECT_EQ(c.rank, rank);
    EXPECT_EQ(c.world_size, 5);
    EXPECT_EQ(c.local_rank, rank % 2);
    EXPECT_EQ(c.local_world_size, rank < 4 ? 2 : 1);
    EXPECT_EQ(c.group_rank, rank / 2);
    EXPECT_EQ(c.master_addr, "gpu-a07");  // the step's first host, not the job's
    EXPECT_EQ(c.master_port, port_from_job_id("4242", 0));
    EXPECT_EQ(c.run_id, "4242");
    EXPECT_FALSE(c.agent_store);  // task 0 hosts the store
  }
}

TEST(SlurmEnv, PortFollowsClusterJobAndStepAndStaysInRange) {
  // Two clusters sharing a host both have a job 1.
  auto a = slurm_task(0);
  auto b = slurm_task(0);
  a["SLURM_CLUSTER_NAME"] = "alpha";
  b["SLURM_CLUSTER_NAME"] = "beta";
  EXPECT_NE(read_env_contract(fake_env(a)).master_port, read_env_contract(fake_env(b)).master_port);
  EXPECT_EQ(read_env_contract(fake_env(a)).master_port, port_from_job_id("alpha/4242"));
  EXPECT_NE(port_from_job_id("4242", 0), port_from_job_id("4243", 0));
  EXPECT_NE(port_from_job_id("4242", 0), port_from_job_id("4242", 1));
  for (int job = 0; job < 2000; ++job) {
    const int port = port_from_job_id(std::to_string(job), job % 3);
    ASSERT_GE(port, 15000);
    ASSERT_LT(port, 32000);  // below Linux's ephemeral ports
  }
}

TEST(SlurmEnv, MasterVariablesOverrideAndJobNodelistIsTheFallback) {
  auto v = slurm_task(1);
  v["MASTER_ADDR"] = "10.1.2.3";
  v["MASTER_PORT"] = "23456";
  auto c = read_env_contract(fake_env(v));
  EXPECT_EQ(c.master_addr, "10.1.2.3");
  EXPECT_EQ(c.master_port, 23456);

  v = slurm_task(1);
  v.erase("SLURM_STEP_NODELIST");
  c = read_env_contract(fake_env(v));
  EXPECT_EQ(c.master_addr, "gpu-a07");

  v = slurm_task(1);  // the batch step's tasks-per-node when srun's is absent
  v.erase("SLURM_STEP_TASKS_PER_NODE");
  v["SLURM_TASKS_PER_NODE"] = "3,2";
  EXPECT_EQ(read_env_contract(fake_env(v)).local_world_size, 3);
}

TEST(SlurmEnv, BatchScriptShellIsNoTask) {
  // sbatch -n 2: the script's shell has SLURM_PROCID=0 of SLURM_NTASKS=2 but no step.
  const Vars batch = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},        {"SLURM_LOCALID", "0"},
                      {"SLURM_NODEID", "0"}, {"SLURM_JOB_ID", "17"},       {"SLURM_JOB_NODELIST", "vm"},
                      {"SLURM_NNODES", "1"}, {"SLURM_TASKS_PER_NODE", "2"}};
  EXPECT_FALSE(dtrain::dist::launched_by_launcher(fake_env(batch)));
  expect_contains(config_error(batch), {"batch script", "17", "SLURM_STEP_ID"});
}

TEST(SlurmEnv, HalfSetEnvironmentNamesWhatIsMissing) {
  auto v = slurm_task(1);
  v.erase("SLURM_LOCALID");
  v.erase("SLURM_NODEID");
  expect_contains(config_error(v), {"Slurm", "SLURM_LOCALID, SLURM_NODEID are not"});

  v = slurm_task(1);
  v.erase("SLURM_STEP_NODELIST");
  v.erase("SLURM_JOB_NODELIST");
  expect_contains(config_error(v), {"SLURM_JOB_NODELIST", "MASTER_ADDR"});

  v = slurm_task(1);
  v.erase("SLURM_STEP_TASKS_PER_NODE");
  expect_contains(config_error(v), {"SLURM_STEP_TASKS_PER_NODE"});

  v = slurm_task(1);
  v["SLURM_STEP_NODELIST"] = "gpu-a[07-09";
  expect_contains(config_error(v), {"SLURM_STEP_NODELIST", "without its ']'"});

  v = slurm_task(1);
  v["SLURM_NTASKS"] = "two";
  expect_contains(config_error(v), {"SLURM_NTASKS='two'"});

  v = slurm_task(4);
  v["SLURM_NTASKS"] = "4";  // task 4 of 4
  expect_contains(config_error(v), {"Slurm's variables", "RANK=4"});
}

TEST(OpenMpiEnv, OneNodeUsesLoopbackAndTheJobIdsPort) {
  for (int rank = 0; rank < 2; ++rank) {
    const auto c = read_env_contract(fake_env(open_mpi_rank(rank)));
    EXPECT_EQ(c.source, EnvSource::kOpenMpi);
    EXPECT_EQ(c.rank, rank);
    EXPECT_EQ(c.world_size, 2);
    EXPECT_EQ(c.local_rank, rank);
    EXPECT_EQ(c.local_world_size, 2);
    EXPECT_EQ(c.master_addr, "127.0.0.1");
    EXPECT_EQ(c.master_port, port_from_job_id("987627521"));
  }
  auto v = open_mpi_rank(0);  // Open MPI 5 names its job by the PMIx namespace
  v.erase("OMPI_MCA_ess_base_jobid");
  v["PMIX_NAMESPACE"] = "prterun-vm-1234@1";
  EXPECT_EQ(read_env_contract(fake_env(v)).master_port, port_from_job_id("prterun-vm-1234@1"));
  v.erase("PMIX_NAMESPACE");  // no job id: torch's default port
  EXPECT_EQ(read_env_contract(fake_env(v)).master_port, 29500);
}

TEST(OpenMpiEnv, SeveralNodesNeedMasterAddr) {
  auto v = open_mpi_rank(1);
  v["OMPI_COMM_WORLD_SIZE"] = "4";  // 2 ranks on each of 2 nodes
  expect_contains(config_error(v), {"Open MPI", "MASTER_ADDR", "-x MASTER_ADDR"});
  v["MASTER_ADDR"] = "node0";
  const auto c = read_env_contract(fake_env(v));
  EXPECT_EQ(c.master_addr, "node0");
  EXPECT_EQ(c.world_size, 4);
}

TEST(OpenMpiEnv, HalfSetEnvironmentNamesWhatIsMissing) {
  auto v = open_mpi_rank(1);
  v.erase("OMPI_COMM_WORLD_LOCAL_SIZE");
  expect_contains(config_error(v), {"Open MPI", "OMPI_COMM_WORLD_LOCAL_SIZE is not"});
  expect_contains(config_error({{"OMPI_COMM_WORLD_SIZE", "2"}}), {"OMPI_COMM_WORLD_RANK"});
}

TEST(PmiEnv, HydraLocalRanksAndHalfSetEnvironments) {
  Vars v = {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}};
  auto c = read_env_contract(fake_env(v));
  EXPECT_EQ(c.source, EnvSource::kPmi);
  EXPECT_EQ(c.rank, 1);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
  EXPECT_EQ(c.master_port, 29500);
  v["MASTER_PORT"] = "31000";
  EXPECT_EQ(read_env_contract(fake_env(v)).master_port, 31000);

  expect_contains(config_error({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}}), {"MPI_LOCALNRANKS"});
  expect_contains(config_error({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}), {"MPI_LOCALNRANKS", "MASTER_ADDR"});
  expect_contains(config_error({{"PMI_RANK", "1"}}), {"PMI_SIZE is not"});
  c = read_env_contract(fake_env({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MASTER_ADDR", "h0"}}));
  EXPECT_EQ(c.master_addr, "h0");
}

TEST(ClusterEnvOrder, TorchrunThenSlurmThenOpenMpiThenPmi) {
  // dtrain run / torchrun inside an srun step: the launcher's contract wins.
  auto v = slurm_task(3);
  v.insert({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29511"}});
  EXPECT_EQ(read_env_contract(fake_env(v)).source, EnvSource::kTorchrun);
  // srun --mpi=pmi2: Slurm's and PMI's variables agree; Slurm's are read.
  v = slurm_task(3);
  v.insert({{"PMI_RANK", "3"}, {"PMI_SIZE", "5"}});
  EXPECT_EQ(read_env_contract(fake_env(v)).source, EnvSource::kSlurm);
  // mpirun inside an allocation: SLURM_* describe mpirun's daemon step.
  v = open_mpi_rank(1);
  v.insert({{"SLURM_PROCID", "0"},
            {"SLURM_NTASKS", "1"},
            {"SLURM_LOCALID", "0"},
            {"SLURM_NODEID", "0"},
            {"SLURM_STEP_ID", "0"}});
  const auto c = read_env_contract(fake_env(v));
  EXPECT_EQ(c.source, EnvSource::kOpenMpi);
  EXPECT_EQ(c.rank, 1);
  // Open MPI before PMI.
  v = open_mpi_rank(1);
  v.insert({{"PMI_RANK", "0"}, {"PMI_SIZE", "1"}});
  EXPECT_EQ(read_env_contract(fake_env(v)).source, EnvSource::kOpenMpi);
}

TEST(ClusterEnvOrder, TorchrunHalfSetAndNothingSet) {
  expect_contains(config_error({{"RANK", "0"}, {"SLURM_PROCID", "0"}}), {"WORLD_SIZE is not set"});
  expect_contains(config_error({}), {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"});
  EXPECT_FALSE(dtrain::dist::launched_by_launcher(fake_env({})));
  EXPECT_TRUE(dtrain::dist::launched_by_launcher(fake_env(slurm_task(0))));
  EXPECT_TRUE(dtrain::dist::launched_by_launcher(fake_env(open_mpi_rank(0))));
  EXPECT_TRUE(dtrain::dist::launched_by_launcher(fake_env({{"PMI_RANK", "0"}})));
}

TEST(ClusterEnvOrder, WriterCarriesTheRoleAndReaderReadsItBack) {
  dtrain::dist::EnvContract c{.rank = 1, .world_size = 2, .local_rank = 1, .local_world_size = 2, .role = "trainer"};
  const auto vars = dtrain::dist::to_environment(c);
  EXPECT_EQ(vars.at("ROLE_NAME"), "trainer");
  EXPECT_EQ(read_env_contract(fake_env(Vars(vars.begin(), vars.end()))).role, "trainer");
}
