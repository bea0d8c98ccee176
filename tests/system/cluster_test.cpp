// Real cluster launchers start the Fashion-MNIST DDP example: a one-node
// Slurm cluster (srun -n 2, and srun inside an sbatch job) and Open MPI's
// mpirun -n 2. Each run must end with the parameters of the same run under
// `dtrain run --nproc-per-node 2`; the workers read their places from the
// launcher's own variables (src/comm/cluster_env.cpp) and say so. Where a
// daemon or tool is missing the test skips with the reason.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "example_run.h"
#include "launch_helpers.h"
#include "slurm_cluster.h"

namespace {
namespace fs = std::filesystem;
using dtrain::testing::kDtrain;
using dtrain::testing::kExample;
using dtrain::testing::last_json_line;
using dtrain::testing::run_example;
using dtrain::testing::Scratch;
using dtrain::testing::SlurmCluster;
using dtrain::testing::slurp;

// Short: 16 steps per rank.
const std::string kTrain =
    "--strategy ddp --epochs 1 --train-limit 1024 --test-limit 1000 --batch-size 32 --devices cpu --seed 5";

bool have_dataset() {
  return fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

// The final parameters' fingerprint from a run's output ("" when it did not finish).
std::string params(const std::string& out) {
  const auto done = last_json_line(out);
  if (done.is_null() || done.value("event", "") != "done") return "";
  EXPECT_EQ(done.value("world_size", 0), 2) << out;
  return done["params_fnv"].dump();
}

// The reference: the same training under `dtrain run`.
std::string reference_params() {
  const auto r = run_example(kExample, kTrain, "timeout 300 " + kDtrain + " run --nproc-per-node 2");
  EXPECT_EQ(r.exit_code, 0) << r.stderr_text;
  const auto p = params(r.stdout_text);
  EXPECT_FALSE(p.empty()) << r.stdout_text << r.stderr_text;
  return p;
}
}  // namespace

TEST(ClusterEngines, SrunTwoTasksTrainLikeDtrainRun) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  Scratch s;
  SlurmCluster slurm(s.path());
  if (!slurm.ready()) GTEST_SKIP() << "no Slurm cluster: " << slurm.why();
  const auto r = run_example(kExample, kTrain, slurm.env() + " timeout 300 srun -n 2 --kill-on-bad-exit=1");
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_EQ(params(r.stdout_text), reference_params());
  EXPECT_NE(r.stderr_text.find("[rank 1/2] environment: Slurm (SLURM_PROCID"), std::string::npos) << r.stderr_text;
  EXPECT_NE(r.stderr_text.find("= first host of SLURM_STEP_NODELIST, port "), std::string::npos) << r.stderr_text;
}

// The job runs two steps: the example as two srun tasks, and `dtrain run`
// as one srun task starting two workers (which read the launcher's contract,
// not the SLURM_* they also inherit); that second step is the reference.
TEST(ClusterEngines, SbatchJobTrainsLikeDtrainRun) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  Scratch s;
  SlurmCluster slurm(s.path());
  if (!slurm.ready()) GTEST_SKIP() << "no Slurm cluster: " << slurm.why();
  const fs::path dir = s.path();
  const std::string job =
      s.script("job.sh", "#SBATCH -n 2\n#SBATCH -o " + (dir / "job.out").string() + "\n#SBATCH -e " +
                             (dir / "job.err").string() + "\nset -e\n" + "srun --kill-on-bad-exit=1 " + kExample + " " +
                             kTrain + " >" + (dir / "srun.out").string() + " 2>" + (dir / "srun.err").string() +
                             "\nsrun -n 1 " + kDtrain + " run --nproc-per-node 2 " + kExample + " " + kTrain + " >" +
                             (dir / "launcher.out").string() + " 2>" + (dir / "launcher.err").string() + "\n");
  const std::string submit = slurm.env() + " timeout 300 sbatch --wait --time=5 " + job + " 2>&1; echo \"exit=$?\"";
  const std::string result = SlurmCluster::command_output(submit);
  ASSERT_NE(result.find("exit=0"), std::string::npos)
      << result << slurp(dir / "job.err") << slurp(dir / "srun.err") << slurp(dir / "launcher.err");
  // The second step is the reference: the same training under `dtrain run`.
  const std::string expected = params(slurp(dir / "launcher.out"));
  ASSERT_FALSE(expected.empty()) << slurp(dir / "launcher.err");
  EXPECT_EQ(params(slurp(dir / "srun.out")), expected) << slurp(dir / "srun.err");
  EXPECT_NE(slurp(dir / "srun.err").find("environment: Slurm ("), std::string::npos) << slurp(dir / "srun.err");
  EXPECT_NE(slurp(dir / "launcher.err").find("[rank 1/2] environment: torchrun ("), std::string::npos)
      << slurp(dir / "launcher.err");
}

TEST(ClusterEngines, MpirunTwoRanksTrainLikeDtrainRun) {
  if (!have_dataset()) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "mpirun is not installed (scripts/setup.sh installs openmpi-bin)";
  }
  // As root Open MPI asks for both variables; --bind-to none keeps each rank's threads free.
  const std::string mpirun =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 300 mpirun -n 2 --oversubscribe --bind-to "
      "none";
  const std::string probe = SlurmCluster::command_output(mpirun + " true 2>&1; echo \"exit=$?\"");
  if (probe.find("exit=0") == std::string::npos) GTEST_SKIP() << "mpirun cannot start processes here: " << probe;
  const auto r = run_example(kExample, kTrain, mpirun);
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_EQ(params(r.stdout_text), reference_params());
  EXPECT_NE(r.stderr_text.find("[rank 1/2] environment: Open MPI (OMPI_COMM_WORLD"), std::string::npos)
      << r.stderr_text;
  EXPECT_NE(r.stderr_text.find("master 127.0.0.1 (all ranks on this node), port "), std::string::npos) << r.stderr_text;
}
