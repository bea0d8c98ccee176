// `dtrain run`'s torchrun spellings, PET_* variables (as Kubeflow's
// PyTorchJob sets them) and the node layout it takes from srun or mpirun:
// the command line is parsed as main.cpp does, against fake environments.
#include <gtest/gtest.h>

#include <map>

#include "dtrain/comm/cluster_env.h"
#include "dtrain/error.h"
#include "fake_env.h"
#include "launch_options.h"
#include "torchrun_args.h"

using dtrain::ConfigError;
using dtrain::testing::expect_contains;
using dtrain::testing::fake_env;
using dtrain::tools::LaunchPlan;
using dtrain::tools::rewrite_torchrun_arguments;
using Args = std::vector<std::string>;
using Vars = std::map<std::string, std::string>;

namespace {

// `dtrain run ARGS` under `env`, as tools/dtrain/main.cpp parses it.
LaunchPlan plan(Args args, const Vars& env = {}) {
  CLI::App app;
  dtrain::tools::LaunchOptions options;
  CLI::App* run = app.add_subcommand("run");
  dtrain::tools::add_launch_options(*run, options);
  auto rewritten = rewrite_torchrun_arguments(args, fake_env(env)).args;
  rewritten.insert(rewritten.begin(), "run");
  std::reverse(rewritten.begin(), rewritten.end());
  app.parse(rewritten);
  options.program_and_args = run->remaining();
  return dtrain::tools::plan_launch(options, fake_env(env));
}

// The refusal's text; fails the test when `args` are accepted.
std::string refusal(const Args& args, const Vars& env = {}) {
  try {
    plan(args, env);
  } catch (const ConfigError& e) {
    EXPECT_FALSE(e.hint().empty()) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return {};
}

}  // namespace

TEST(TorchrunArguments, PetVariablesAreDefaultsTheCommandLineOverrides) {
  const Vars env = {{"PET_NNODES", "1:3"}, {"PET_MAX_RESTARTS", "2"}, {"PET_STANDALONE", "0"}, {"PET_ROLE", "r"}};
  const auto out = rewrite_torchrun_arguments({"--max_restarts", "5", "/bin/true", "--nnodes", "9"}, fake_env(env));
  // --nnodes after PROGRAM is the program's: PET_NNODES still applies.
  EXPECT_EQ(out.args, (Args{"--nnodes=1:3", "--role=r", "--max_restarts", "5", "/bin/true", "--nnodes", "9"}));
  EXPECT_EQ(out.from_pet, (Args{"PET_NNODES=1:3", "PET_ROLE=r"}));
  EXPECT_EQ(rewrite_torchrun_arguments({"x"}, fake_env({{"PET_STANDALONE", "1"}})).args, (Args{"--standalone", "x"}));
  // Kubeflow's training-operator before v1.7 wrote PET_N_PROC_PER_NODE.
  EXPECT_EQ(rewrite_torchrun_arguments({"x"}, fake_env({{"PET_N_PROC_PER_NODE", "4"}})).args,
            (Args{"--nproc-per-node=4", "x"}));
}

TEST(TorchrunArguments, TeeTakesTorchrunsValueOrStaysDtrainsFlag) {
  EXPECT_EQ(rewrite_torchrun_arguments({"--tee", "3", "p"}, fake_env({})).args, (Args{"--tee-streams", "3", "p"}));
  EXPECT_EQ(rewrite_torchrun_arguments({"-t", "0:3,1:3", "p"}, fake_env({})).args,
            (Args{"--tee-streams", "0:3,1:3", "p"}));
  EXPECT_EQ(rewrite_torchrun_arguments({"--tee=3", "p"}, fake_env({})).args, (Args{"--tee-streams=3", "p"}));
  EXPECT_EQ(rewrite_torchrun_arguments({"--tee", "./p", "3"}, fake_env({})).args, (Args{"--tee", "./p", "3"}));
  EXPECT_EQ(rewrite_torchrun_arguments({"--log-dir", "--tee", "p"}, fake_env({})).args,
            (Args{"--log-dir", "--tee", "p"}));  // a value that looks like an option stays a value
}

TEST(TorchrunArguments, DoubleDashBeforeTheProgramIsASeparator) {
  EXPECT_EQ(rewrite_torchrun_arguments({"--nnodes", "1", "--", "p", "--", "-x"}, fake_env({})).args,
            (Args{"--nnodes", "1", "p", "--", "-x"}));
  EXPECT_EQ(rewrite_torchrun_arguments({"--", "--p"}, fake_env({})).args, (Args{"--p"}));
  const auto parsed = plan({"--nproc-per-node", "2", "--", "/bin/echo", "--", "--nnodes", "3"});
  ASSERT_EQ(parsed.argv.size(), 4u);
  EXPECT_EQ(parsed.argv.back(), "3");
  EXPECT_EQ(parsed.argv[1], "--");  // the program's own separator stays
}

TEST(TorchrunOptions, KubeflowElasticPyTorchJob) {
  const auto p = plan({"/bin/true"}, {{"PET_NNODES", "1:3"},
                                      {"PET_RDZV_BACKEND", "c10d"},
                                      {"PET_RDZV_ENDPOINT", "job-worker-0:29400"},
                                      {"PET_RDZV_ID", "job"},
                                      {"PET_MAX_RESTARTS", "3"},
                                      {"PET_NPROC_PER_NODE", "2"},
                                      {"PET_RDZV_CONF", "join_timeout=7,last_call_timeout=1"}});
  ASSERT_TRUE(p.rendezvous.multi_node);
  EXPECT_EQ(p.rendezvous.host, "job-worker-0");
  EXPECT_EQ(p.rendezvous.port, 29400);
  EXPECT_EQ(p.rendezvous.options.min_nodes, 1);
  EXPECT_EQ(p.rendezvous.options.max_nodes, 3);
  EXPECT_EQ(p.rendezvous.options.node_rank, -1);  // by arrival
  EXPECT_EQ(p.rendezvous.options.run_id, "job");
  EXPECT_EQ(p.rendezvous.options.timeout, std::chrono::seconds(7));
  EXPECT_EQ(p.rendezvous.options.last_call, std::chrono::seconds(1));
  EXPECT_EQ(p.agent.nproc_per_node, 2);
  EXPECT_EQ(p.agent.max_restarts, 3);
}

TEST(TorchrunOptions, KubeflowPyTorchJobWithMasterIsStatic) {
  const Vars env = {{"PET_NNODES", "2"},
                    {"PET_NODE_RANK", "1"},
                    {"PET_MASTER_ADDR", "job-master-0"},
                    {"PET_MASTER_PORT", "23456"},
                    {"PET_NPROC_PER_NODE", "2"},
                    // the pod-level contract the operator also sets: not read by the launcher
                    {"RANK", "1"},
                    {"WORLD_SIZE", "2"}};
  const auto p = plan({"/bin/true"}, env);
  ASSERT_TRUE(p.rendezvous.multi_node);
  EXPECT_EQ(p.rendezvous.host, "job-master-0");
  EXPECT_EQ(p.rendezvous.port, 23456);
  EXPECT_EQ(p.rendezvous.options.node_rank, 1);
  EXPECT_EQ(p.rendezvous.options.min_nodes, 2);
  EXPECT_EQ(p.rendezvous.options.max_nodes, 2);
  // The command line wins over PET_*.
  EXPECT_EQ(plan({"--node_rank", "0", "/bin/true"}, env).rendezvous.options.node_rank, 0);
}

TEST(TorchrunOptions, UnderscoreSpellingsAndStaticBackend) {
  const auto p = plan({"--nproc_per_node", "2",       "--rdzv_backend",     "static", "--master_addr", "::1",
                       "--master_port",    "29650",   "--node_rank",        "1",      "--nnodes",      "2",
                       "--max_restarts",   "1",       "--monitor_interval", "0.5",    "--rdzv_id",     "j",
                       "--role",           "trainer", "/bin/true"});
  EXPECT_EQ(p.rendezvous.host, "::1");
  EXPECT_EQ(p.rendezvous.port, 29650);
  EXPECT_EQ(p.rendezvous.options.node_rank, 1);
  EXPECT_EQ(p.agent.nproc_per_node, 2);
  EXPECT_EQ(p.agent.max_restarts, 1);
  EXPECT_EQ(p.agent.monitor_interval, std::chrono::milliseconds(500));
  EXPECT_EQ(p.agent.run_id, "j");
  EXPECT_EQ(p.agent.role, "trainer");
  // Static, several nodes, no --node-rank: 0, as torchrun.
  EXPECT_EQ(plan({"--rdzv-backend", "static", "--nnodes", "2", "/bin/true"}).rendezvous.options.node_rank, 0);
  // One node with --master-port: the workers meet there, as under torchrun.
  const auto one = plan({"--master-port", "29651", "--master-addr", "127.0.0.2", "/bin/true"});
  EXPECT_FALSE(one.rendezvous.multi_node);
  EXPECT_EQ(one.agent.master_port, 29651);
  EXPECT_EQ(one.agent.master_addr, "127.0.0.2");
  EXPECT_EQ(plan({"--standalone", "/bin/true"}).agent.master_port, 0);  // a fresh port each round
}

TEST(TorchrunOptions, OutputShutdownAndRendezvousSettings) {
  auto p = plan({"--tee", "3", "--log-dir", "/tmp/x", "/bin/true"});
  EXPECT_TRUE(p.tee);
  EXPECT_EQ(p.log_dir, "/tmp/x");
  p = plan({"-r", "3", "--log_dir", "/tmp/x", "/bin/true"});
  EXPECT_FALSE(p.tee);
  EXPECT_EQ(p.log_dir, "/tmp/x");
  EXPECT_EQ(plan({"--shutdown-timeout", "9", "/bin/true"}).agent.stop_grace, std::chrono::seconds(9));
  EXPECT_EQ(plan({"--no-python", "--start-method", "spawn", "/bin/true"}).argv.front(), "/bin/true");
  p = plan({"--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--rdzv-conf",
            "keep_alive_interval=1,keep_alive_max_attempt=4", "/bin/true"});
  EXPECT_EQ(p.rendezvous.options.heartbeat_interval, std::chrono::seconds(1));
  EXPECT_EQ(p.rendezvous.options.heartbeat_timeout, std::chrono::seconds(4));
  EXPECT_EQ(
      plan({"--nnodes", "2", "--rdzv-endpoint", "h:1", "--local-addr", "10.9.8.7", "/bin/true"}).rendezvous.local_addr,
      "10.9.8.7");
}

TEST(TorchrunOptions, RefusalsSayWhy) {
  expect_contains(refusal({"--rdzv-backend", "etcd-v2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "/bin/true"}),
                  {"etcd-v2", "not supported", "TCPStore"});
  expect_contains(refusal({"--rdzv-backend", "static", "--nnodes", "1:2", "/bin/true"}), {"fixed node count"});
  expect_contains(refusal({"--start-method", "fork", "/bin/true"}), {"new process"});
  expect_contains(refusal({"-m", "/bin/true"}), {"no Python of its own"});
  expect_contains(refusal({"--run-path", "/bin/true"}), {"interpreter"});
  expect_contains(refusal({"--redirects", "1", "--log-dir", "/tmp/x", "/bin/true"}), {"stdout and stderr together"});
  expect_contains(refusal({"--tee", "0:3,1:1", "--log-dir", "/tmp/x", "/bin/true"}), {"stdout and stderr together"});
  expect_contains(refusal({"--tee", "3", "/bin/true"}), {"--tee 3 needs --log-dir"});
  expect_contains(refusal({"--redirects", "0", "--log-dir", "/tmp/x", "/bin/true"}), {"always captures"});
  expect_contains(refusal({"--local-ranks-filter", "0", "/bin/true"}), {"--local-ranks-filter", "every rank"});
  expect_contains(refusal({"--numa_binding", "node", "/bin/true"}), {"numactl"});
  expect_contains(refusal({"--virtual-local-rank", "/bin/true"}), {"LOCAL_RANK"});
  expect_contains(refusal({"--event-log-handler", "console", "/bin/true"}), {"stderr"});
  expect_contains(refusal({"--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-conf", "close_timeout=5", "/bin/true"}),
                  {"close_timeout"});
  expect_contains(refusal({"/bin/true"}, {{"PET_START_METHOD", "forkserver"}}), {"forkserver"});
}

// --ft-replicas (issue 27): the lighthouse's settings, and what it refuses.
TEST(FaultToleranceOptions, ReplicaGroupsAndTheirRefusals) {
  const auto p = plan({"--nproc-per-node", "4", "--ft-replicas", "2", "--ft-min-replicas", "2",
                       "--ft-heartbeat-timeout", "0.5", "/bin/true"});
  EXPECT_EQ(p.fault_tolerance.replicas, 2);
  EXPECT_EQ(p.fault_tolerance.lighthouse_config,
            "min_replicas=2,startup_replicas=2,heartbeat_timeout_ms=500,join_timeout_ms=10000");
  EXPECT_EQ(plan({"/bin/true"}).fault_tolerance.replicas, 0);
  expect_contains(refusal({"--nproc-per-node", "3", "--ft-replicas", "2", "/bin/true"}), {"multiple of --ft-replicas"});
  expect_contains(refusal({"--nproc-per-node", "2", "--ft-replicas", "2", "--ft-min-replicas", "3", "/bin/true"}),
                  {"--ft-min-replicas 3"});
  // Several nodes: a fixed count with node ranks; --ft-replicas counts every node's groups.
  expect_contains(
      refusal({"--nproc-per-node", "2", "--ft-replicas", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "/bin/true"}),
      {"--node-rank"});
  expect_contains(refusal({"--nproc-per-node", "2", "--ft-replicas", "2", "--nnodes", "1:2", "--node-rank", "0",
                           "--rdzv-endpoint", "h:1", "/bin/true"}),
                  {"fixed node count"});
  expect_contains(refusal({"--nproc-per-node", "2", "--ft-replicas", "3", "--nnodes", "2", "--node-rank", "1",
                           "--rdzv-endpoint", "h:1", "/bin/true"}),
                  {"equal shares"});
  const auto node1 = plan({"--nproc-per-node", "2", "--ft-replicas", "4", "--nnodes", "2", "--node-rank", "1",
                           "--rdzv-endpoint", "h:29777", "--ft-heartbeat-timeout", "0.5", "/bin/true"});
  EXPECT_EQ(node1.fault_tolerance.replicas, 4);
  EXPECT_EQ(node1.fault_tolerance.nodes, 2);
  EXPECT_EQ(node1.fault_tolerance.node_rank, 1);
  EXPECT_EQ(node1.fault_tolerance.lighthouse_host, "h");
  EXPECT_EQ(node1.fault_tolerance.lighthouse_port, 29777);
  EXPECT_EQ(node1.fault_tolerance.linger, std::chrono::milliseconds(1000));
  EXPECT_NE(node1.fault_tolerance.lighthouse_config.find("startup_replicas=4"), std::string::npos);
  // The lighthouse failover: node 1 keeps the standby, whose first quorum
  // waits for the groups outside node 0; every node knows its address.
  const auto standby =
      plan({"--nproc-per-node", "2", "--ft-replicas", "4", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
            "h:29777", "--ft-lighthouse-standby", "g:29801", "--ft-failover-timeout", "3", "/bin/true"});
  EXPECT_EQ(standby.fault_tolerance.standby_host, "g");
  EXPECT_EQ(standby.fault_tolerance.standby_port, 29801);
  EXPECT_NE(
      standby.fault_tolerance.lighthouse_config.find(",startup_replicas=2,primary=h:29777,failover_timeout_ms=3000"),
      std::string::npos)
      << standby.fault_tolerance.lighthouse_config;
  const auto node0 = plan({"--nproc-per-node", "2", "--ft-replicas", "4", "--nnodes", "2", "--node-rank", "0",
                           "--rdzv-endpoint", "h:29777", "--ft-lighthouse-standby", "g:29801", "/bin/true"});
  EXPECT_EQ(node0.fault_tolerance.standby_host, "g");
  EXPECT_EQ(node0.fault_tolerance.lighthouse_config.find("primary="), std::string::npos);
  expect_contains(
      refusal({"--nproc-per-node", "2", "--ft-replicas", "2", "--ft-lighthouse-standby", "g:1", "/bin/true"}),
      {"needs several nodes"});
  expect_contains(refusal({"--nproc-per-node", "2", "--ft-replicas", "4", "--nnodes", "2", "--node-rank", "0",
                           "--rdzv-endpoint", "h:1", "--ft-lighthouse-standby", "g", "/bin/true"}),
                  {"is not HOST:PORT"});
}

TEST(ClusterLayout, OneLauncherPerNodeUnderSrun) {
  // srun -N 2 --ntasks-per-node=1 dtrain run --nproc-per-node 2 PROGRAM, task 1 of job 77.
  Vars env = {{"SLURM_PROCID", "1"},
              {"SLURM_NTASKS", "2"},
              {"SLURM_LOCALID", "0"},
              {"SLURM_NODEID", "1"},
              {"SLURM_JOB_ID", "77"},
              {"SLURM_STEP_ID", "0"},
              {"SLURM_STEP_NODELIST", "n[3-4]"},
              {"SLURM_STEP_NUM_NODES", "2"},
              {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}};
  auto p = plan({"--nproc-per-node", "2", "/bin/true"}, env);
  ASSERT_TRUE(p.rendezvous.multi_node);
  EXPECT_EQ(p.rendezvous.host, "n3");
  EXPECT_EQ(p.rendezvous.port, dtrain::dist::detail::port_from_job_id("77"));
  EXPECT_EQ(p.rendezvous.options.node_rank, 1);
  EXPECT_EQ(p.rendezvous.options.min_nodes, 2);
  EXPECT_EQ(p.rendezvous.options.max_nodes, 2);
  EXPECT_EQ(p.agent.run_id, "77");
  // A layout on the command line (or in PET_*) wins over Slurm's.
  EXPECT_FALSE(plan({"--standalone", "/bin/true"}, env).rendezvous.multi_node);
  EXPECT_EQ(plan({"/bin/true"},
                 [&] {
                   auto e = env;
                   e["PET_NNODES"] = "1:4";
                   e["PET_RDZV_ENDPOINT"] = "other:5";
                   return e;
                 }())
                .rendezvous.host,
            "other");
  // Two launchers on one node.
  env["SLURM_STEP_TASKS_PER_NODE"] = "2";
  env["SLURM_STEP_NUM_NODES"] = "1";
  env["SLURM_NODEID"] = "0";
  expect_contains(refusal({"/bin/true"}, env), {"Slurm started 2 copies", "--ntasks-per-node=1"});
}

TEST(ClusterLayout, MpirunOnePerNodeAndBatchScriptShell) {
  const Vars mpi = {
      {"OMPI_COMM_WORLD_RANK", "0"},       {"OMPI_COMM_WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}, {"MASTER_ADDR", "h0"},         {"MASTER_PORT", "29777"}};
  const auto p = plan({"/bin/true"}, mpi);
  EXPECT_EQ(p.rendezvous.host, "h0");
  EXPECT_EQ(p.rendezvous.port, 29777);
  EXPECT_EQ(p.rendezvous.options.node_rank, 0);
  EXPECT_EQ(p.rendezvous.options.max_nodes, 3);
  // `dtrain run` in an sbatch script itself: this node only, as torchrun.
  const Vars batch = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                      {"SLURM_NODEID", "0"}, {"SLURM_JOB_ID", "5"}, {"SLURM_JOB_NODELIST", "vm"}};
  EXPECT_FALSE(plan({"--nproc-per-node", "2", "/bin/true"}, batch).rendezvous.multi_node);
}
