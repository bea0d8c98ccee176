// A one-node Slurm cluster on this machine for system tests: munged with a
// fresh key, slurmctld and slurmd with a generated slurm.conf, all in a
// scratch folder on free ports, stopped (by pid) when the object goes.
// Needs Debian's slurm-wlm and munge (scripts/setup.sh) and root; when a
// daemon cannot start, ready() is false and why() says what happened.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ranks.h"

extern char** environ;

namespace dtrain::testing {

class SlurmCluster {
 public:
  explicit SlurmCluster(const std::filesystem::path& dir) : dir_(dir) {
    for (const char* tool : {"munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo"}) {
      if (!on_path(tool)) {
        why_ = std::string(tool) + " is not installed (scripts/setup.sh installs slurm-wlm and munge)";
        return;
      }
    }
    if (::geteuid() != 0) {
      why_ = "the test's slurm.conf runs the daemons as root (SlurmUser=root), but this is not root";
      return;
    }
    namespace fs = std::filesystem;
    for (const char* sub : {"run", "state", "spool"}) fs::create_directories(dir_ / sub);
    fs::permissions(dir_ / "run", fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
    write_key();
    write_conf();
    const std::string d = dir_.string();
    munged_ = spawn({"munged", "-F", "-f", "-S", d + "/run/munge.sock", "--key-file=" + d + "/munge.key",
                     "--log-file=" + d + "/munged.log", "--pid-file=" + d + "/run/munged.pid",
                     "--seed-file=" + d + "/munged.seed", "--num-threads=1"},
                    "munged.out");
    if (!wait_until([&] { return std::filesystem::exists(dir_ / "run/munge.sock"); }, 10)) {
      why_ = "munged did not start: " + tail("munged.log") + tail("munged.out");
      return;
    }
    slurmctld_ = spawn({"slurmctld", "-D", "-i", "-f", conf()}, "slurmctld.out");
    slurmd_ = spawn({"slurmd", "-D", "-f", conf(), "-N", node_}, "slurmd.out");
    const bool idle = wait_until([&] { return command_output(env() + " sinfo -h -o %T 2>/dev/null") == "idle\n"; }, 30);
    if (!idle) {
      why_ = "the Slurm node did not become idle within 30 s; slurmctld: " + tail("slurmctld.log") +
             tail("slurmctld.out") + " slurmd: " + tail("slurmd.log") + tail("slurmd.out");
    }
  }
  ~SlurmCluster() {
    for (pid_t pid : {slurmd_, slurmctld_, munged_}) stop(pid);
  }
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  bool ready() const { return why_.empty(); }
  const std::string& why() const { return why_; }
  std::string conf() const { return (dir_ / "slurm.conf").string(); }
  // Prefix for shell commands that talk to this cluster.
  std::string env() const { return "SLURM_CONF=" + conf(); }

  static std::string command_output(const std::string& cmd) {
    std::string out;
    FILE* p = ::popen(cmd.c_str(), "r");
    if (p == nullptr) return out;
    char buf[512];
    size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    ::pclose(p);
    return out;
  }

 private:
  static bool on_path(const std::string& tool) {
    return std::system(("command -v " + tool + " >/dev/null 2>&1").c_str()) == 0;
  }
  template <typename F>
  static bool wait_until(F ready, int seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      if (ready()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
  void write_key() const {
    std::random_device rd;
    std::ofstream key(dir_ / "munge.key", std::ios::binary);
    for (int i = 0; i < 1024; ++i) key.put(static_cast<char>(rd() & 0xff));
    key.close();
    std::filesystem::permissions(dir_ / "munge.key",
                                 std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  void write_conf() {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    node_ = std::string(host).substr(0, std::string(host).find('.'));
    const std::string d = dir_.string();
    std::ofstream c(dir_ / "slurm.conf");
    // A name of its own: concurrent test clusters number their jobs alike,
    // and the derived port tells them apart by the cluster's name.
    c << "ClusterName=dtrain" << ::getpid() << "\n"
      << "SlurmctldHost=" << node_ << "(127.0.0.1)\n"
      << "SlurmctldPort=" << free_port() << "\nSlurmdPort=" << free_port() << "\n"
      << "AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket=" << d << "/run/munge.sock\n"
      << "SlurmUser=root\nSlurmdUser=root\n"
      << "StateSaveLocation=" << d << "/state\nSlurmdSpoolDir=" << d << "/spool\n"
      << "SlurmctldPidFile=" << d << "/slurmctld.pid\nSlurmdPidFile=" << d << "/slurmd.pid\n"
      << "SlurmctldLogFile=" << d << "/slurmctld.log\nSlurmdLogFile=" << d
      << "/slurmd.log\n"
      // No cgroups in a container: track processes through /proc, bind nothing.
      << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
      << "AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\n"
      << "SchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
      << "MpiDefault=none\nReturnToService=2\nInactiveLimit=0\nKillWait=5\n"
      << "NodeName=" << node_ << " NodeAddr=127.0.0.1 CPUs=" << std::max(2u, std::thread::hardware_concurrency())
      << " State=UNKNOWN\n"
      << "PartitionName=debug Nodes=" << node_ << " Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n";
  }
  pid_t spawn(std::vector<std::string> args, const std::string& out) const {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string path = (dir_ / out).string();
    posix_spawn_file_actions_addopen(&fa, 1, path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    const std::string slurm_conf = "SLURM_CONF=" + conf();
    std::vector<char*> envp;
    for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
    envp.push_back(const_cast<char*>(slurm_conf.c_str()));
    envp.push_back(nullptr);
    if (posix_spawnp(&pid, argv.front(), &fa, nullptr, argv.data(), envp.data()) != 0) pid = -1;
    posix_spawn_file_actions_destroy(&fa);
    return pid;
  }
  static void stop(pid_t pid) {
    if (pid <= 0) return;
    ::kill(pid, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      if (::waitpid(pid, nullptr, WNOHANG) == pid) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  std::string tail(const std::string& file) const {
    std::ifstream in(dir_ / file);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    return text.size() > 600 ? "..." + text.substr(text.size() - 600) : text;
  }

  std::filesystem::path dir_;
  std::string node_;
  std::string why_;
  pid_t munged_ = -1;
  pid_t slurmctld_ = -1;
  pid_t slurmd_ = -1;
};

}  // namespace dtrain::testing
