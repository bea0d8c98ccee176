// Slurm's, Open MPI's and MPICH/PMI's environments (include/dtrain/comm/cluster_env.h).
#include "dtrain/comm/cluster_env.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <sstream>

#include "dtrain/error.h"

namespace dtrain::dist {
namespace {
constexpr int kMaxRanks = 1 << 20;
constexpr int kTorchDefaultPort = 29500;

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// All of `names` or none: a launcher that set some of them and not the
// others is misconfigured (or the variables were copied by hand).
void require_all(const EnvLookup& env, const std::string& launcher, const std::vector<std::string>& names,
                 const std::string& hint) {
  std::vector<std::string> set;
  std::vector<std::string> missing;
  for (const auto& n : names) (env(n) ? set : missing).push_back(n);
  DTRAIN_CHECK(missing.empty(), ConfigError,
               launcher << "'s environment is incomplete: " << join(set) << (set.size() == 1 ? " is" : " are")
                        << " set but " << join(missing) << (missing.size() == 1 ? " is" : " are") << " not.",
               hint);
}

int read_int(const EnvLookup& env, const std::string& name, int min) {
  return detail::parse_int(name, *env(name), min, kMaxRanks);
}

std::optional<std::string> first_of(const EnvLookup& env, std::initializer_list<const char*> names,
                                    std::string* which = nullptr) {
  for (const char* n : names) {
    if (auto v = env(n)) {
      if (which != nullptr) *which = n;
      return v;
    }
  }
  return std::nullopt;
}

// MASTER_PORT if given, else one derived from the job id, else torch's default.
void choose_port(const EnvLookup& env, ClusterTask& t, int step, std::string& origin) {
  if (const auto port = env("MASTER_PORT")) {
    t.master_port = detail::parse_int("MASTER_PORT", *port, 1, 65535);
    origin += ", port from MASTER_PORT";
  } else if (!t.job_id.empty()) {
    // Job ids are unique within a cluster: a host shared by two clusters
    // (Slurm's, here in the tests) tells them apart by the cluster's name.
    const auto cluster = t.source == EnvSource::kSlurm ? env("SLURM_CLUSTER_NAME") : std::nullopt;
    t.master_port = detail::port_from_job_id(cluster ? *cluster + "/" + t.job_id : t.job_id, step);
    origin += ", port " + std::to_string(t.master_port) + " from job " + t.job_id;
    if (const auto cluster = t.source == EnvSource::kSlurm ? env("SLURM_CLUSTER_NAME") : std::nullopt) {
      origin += " of cluster " + *cluster;
    }
    if (step != 0) origin += " step " + std::to_string(step);
  } else {
    t.master_port = kTorchDefaultPort;
    origin += ", port " + std::to_string(kTorchDefaultPort) + " (no job id; set MASTER_PORT to choose)";
  }
}

ClusterTask read_slurm(const EnvLookup& env) {
  const std::string hint =
      "start tasks with srun (which sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_NODEID), or unset "
      "the SLURM_* variables left over from another job";
  require_all(env, "Slurm", {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID"}, hint);
  ClusterTask t{.source = EnvSource::kSlurm};
  t.rank = read_int(env, "SLURM_PROCID", 0);
  t.world_size = read_int(env, "SLURM_NTASKS", 1);
  t.local_rank = read_int(env, "SLURM_LOCALID", 0);
  t.node_rank = read_int(env, "SLURM_NODEID", 0);
  t.job_id = first_of(env, {"SLURM_JOB_ID", "SLURM_JOBID"}).value_or("");
  int step = 0;
  if (const auto s = first_of(env, {"SLURM_STEP_ID", "SLURM_STEPID"})) {
    // Numeric for srun's steps; the batch and extern steps have names.
    if (all_digits(*s) && s->size() < 9) step = std::stoi(*s);
  }

  std::string nodelist_name;
  const auto nodelist = first_of(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}, &nodelist_name);
  std::vector<std::string> hosts;
  if (nodelist) hosts = detail::expand_nodelist(nodelist_name, *nodelist);
  std::string nnodes_name;
  if (const auto n = first_of(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"}, &nnodes_name)) {
    t.nnodes = detail::parse_int(nnodes_name, *n, 1, kMaxRanks);
  } else if (!hosts.empty()) {
    t.nnodes = static_cast<int>(hosts.size());
  }

  std::string per_node_name;
  if (const auto per_node = first_of(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}, &per_node_name)) {
    const auto counts = detail::expand_tasks_per_node(per_node_name, *per_node);
    DTRAIN_CHECK(static_cast<std::size_t>(t.node_rank) < counts.size(), ConfigError,
                 "SLURM_NODEID=" << t.node_rank << " has no entry in " << per_node_name << "=" << *per_node << ".",
                 hint);
    t.local_world_size = counts[static_cast<std::size_t>(t.node_rank)];
  } else {
    DTRAIN_CHECK(t.nnodes == 1, ConfigError,
                 "Slurm's environment does not say how many tasks run on this node: SLURM_STEP_TASKS_PER_NODE "
                 "(or SLURM_TASKS_PER_NODE) is not set.",
                 hint);
    t.local_world_size = t.world_size;
  }

  std::string origin = "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID";
  if (const auto addr = env("MASTER_ADDR")) {
    t.master_addr = *addr;
    origin += "; master from MASTER_ADDR";
  } else {
    DTRAIN_CHECK(nodelist.has_value(), ConfigError,
                 "Slurm's environment names no hosts: SLURM_JOB_NODELIST (or SLURM_STEP_NODELIST) is not set, and "
                 "MASTER_ADDR is not either.",
                 "run the tasks with srun inside an allocation, or set MASTER_ADDR to the host of task 0");
    t.master_addr = hosts.front();
    origin += "; master " + t.master_addr + " = first host of " + nodelist_name;
  }
  choose_port(env, t, step, origin);
  t.origin = origin;
  return t;
}

ClusterTask read_open_mpi(const EnvLookup& env) {
  const std::vector<std::string> names = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                          "OMPI_COMM_WORLD_LOCAL_SIZE"};
  require_all(env, "Open MPI", names,
              "start the program with Open MPI's mpirun, or unset the OMPI_COMM_WORLD_* variables");
  ClusterTask t{.source = EnvSource::kOpenMpi};
  t.rank = read_int(env, names[0], 0);
  t.world_size = read_int(env, names[1], 1);
  t.local_rank = read_int(env, names[2], 0);
  t.local_world_size = read_int(env, names[3], 1);
  if (const auto n = env("OMPI_MCA_orte_num_nodes"))
    t.nnodes = detail::parse_int("OMPI_MCA_orte_num_nodes", *n, 1, kMaxRanks);
  t.job_id = first_of(env, {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"}).value_or("");
  return t;
}

ClusterTask read_pmi(const EnvLookup& env) {
  const std::string hint = "start the program with mpiexec (MPICH, Intel MPI), or unset the PMI_* variables";
  require_all(env, "PMI", {"PMI_RANK", "PMI_SIZE"}, hint);
  ClusterTask t{.source = EnvSource::kPmi};
  t.rank = read_int(env, "PMI_RANK", 0);
  t.world_size = read_int(env, "PMI_SIZE", 1);
  t.local_rank = t.rank;
  t.local_world_size = t.world_size;
  if (env("MPI_LOCALRANKID") || env("MPI_LOCALNRANKS")) {
    require_all(env, "MPICH's Hydra", {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"}, hint);
    t.local_rank = read_int(env, "MPI_LOCALRANKID", 0);
    t.local_world_size = read_int(env, "MPI_LOCALNRANKS", 1);
  } else if (!env("MASTER_ADDR")) {
    throw ConfigError("PMI_RANK is set but neither MPI_LOCALNRANKS (ranks on this node) nor MASTER_ADDR is.",
                      "set MASTER_ADDR to the host of rank 0 (mpiexec -genv MASTER_ADDR HOST)");
  }
  return t;
}

// MPI launchers do not publish rank 0's host: one node means loopback.
void choose_mpi_master(const EnvLookup& env, ClusterTask& t) {
  const std::string launcher = to_string(t.source);
  std::string origin =
      t.source == EnvSource::kOpenMpi ? "OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}" : "PMI_RANK, PMI_SIZE";
  if (const auto addr = env("MASTER_ADDR")) {
    t.master_addr = *addr;
    origin += "; master from MASTER_ADDR";
  } else {
    DTRAIN_CHECK(t.local_world_size == t.world_size, ConfigError,
                 launcher << " does not say which host rank 0 runs on, and the " << t.world_size
                          << " ranks span several nodes; MASTER_ADDR is not set.",
                 "pass it to every rank: mpirun -x MASTER_ADDR=<rank 0's host> (Open MPI) or mpiexec -genv "
                 "MASTER_ADDR <host> (MPICH)");
    t.master_addr = "127.0.0.1";
    origin += "; master 127.0.0.1 (all ranks on this node)";
  }
  if (t.local_world_size == t.world_size) {
    t.nnodes = 1;
    t.node_rank = 0;
  }
  choose_port(env, t, 0, origin);
  t.origin = origin;
}

std::optional<ClusterTask> read_mpi(const EnvLookup& env) {
  std::optional<ClusterTask> t;
  if (first_of(env, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"})) {
    t = read_open_mpi(env);
  } else if (first_of(env, {"PMI_RANK", "PMI_SIZE"})) {
    t = read_pmi(env);
  }
  if (t) choose_mpi_master(env, *t);
  return t;
}

// A task of an srun step (the batch script's shell has SLURM_PROCID but no step).
bool slurm_task(const EnvLookup& env) {
  return env("SLURM_PROCID") && first_of(env, {"SLURM_STEP_ID", "SLURM_STEPID"});
}

std::uint64_t fnv1a(const std::string& text) {
  std::uint64_t h = 1469598103934665603ull;
  for (const unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Digits of a range bound; ConfigError otherwise.
unsigned long long range_bound(const std::string& what, const std::string& text, const std::string& bound) {
  const bool digits = bound.size() <= 12 && all_digits(bound);
  DTRAIN_CHECK(digits, ConfigError, what << "='" << text << "': '" << bound << "' in a [...] range is not a number.",
               "write ranges like node[01-03,7]");
  return std::stoull(bound);
}

// One bracket's contents, "01-03,7" -> 01 02 03 7.
std::vector<std::string> expand_ranges(const std::string& what, const std::string& text, const std::string& ranges) {
  std::vector<std::string> out;
  std::stringstream in(ranges);
  std::string item;
  DTRAIN_CHECK(!ranges.empty() && ranges.back() != ',', ConfigError,
               what << "='" << text << "' has an empty range in [" << ranges << "].",
               "write ranges like node[01-03,7]");
  while (std::getline(in, item, ',')) {
    const auto dash = item.find('-');
    const std::string lo = item.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    const auto a = range_bound(what, text, lo);
    const auto b = range_bound(what, text, hi);
    DTRAIN_CHECK(a <= b, ConfigError, what << "='" << text << "': range " << item << " runs backwards.",
                 "write the lower bound first, e.g. [3-5]");
    DTRAIN_CHECK(b - a < (1u << 20), ConfigError, what << "='" << text << "': range " << item << " is too large.",
                 "a job has at most 1048576 nodes");
    for (auto v = a; v <= b; ++v) {
      std::string s = std::to_string(v);
      if (s.size() < lo.size()) s.insert(0, lo.size() - s.size(), '0');  // Slurm pads to the lower bound's width
      out.push_back(std::move(s));
    }
  }
  return out;
}
}  // namespace

namespace detail {

bool cluster_launcher_present(const EnvLookup& env) {
  return slurm_task(env) || first_of(env, {"OMPI_COMM_WORLD_RANK", "PMI_RANK"}).has_value();
}

std::vector<std::string> expand_nodelist(const std::string& what, const std::string& text, std::size_t limit) {
  const std::string hint = "Slurm writes host lists like node[01-03,7],gpu-a[1-2]";
  DTRAIN_CHECK(!text.empty(), ConfigError, what << " is empty.", hint);
  // Split at commas outside brackets.
  std::vector<std::string> items(1);
  int depth = 0;
  for (const char c : text) {
    DTRAIN_CHECK(!std::isspace(static_cast<unsigned char>(c)), ConfigError,
                 what << "='" << text << "' contains white space.", hint);
    if (c == '[') {
      DTRAIN_CHECK(depth == 0, ConfigError, what << "='" << text << "' has a '[' inside another.", hint);
      ++depth;
    } else if (c == ']') {
      DTRAIN_CHECK(depth == 1, ConfigError, what << "='" << text << "' has a ']' without its '['.", hint);
      --depth;
    }
    if (c == ',' && depth == 0) {
      items.emplace_back();
    } else {
      items.back() += c;
    }
  }
  DTRAIN_CHECK(depth == 0, ConfigError, what << "='" << text << "' has a '[' without its ']'.", hint);
  std::vector<std::string> hosts;
  for (const auto& item : items) {
    DTRAIN_CHECK(!item.empty(), ConfigError, what << "='" << text << "' has an empty host name.", hint);
    DTRAIN_CHECK(item.front() != '[', ConfigError,
                 what << "='" << text << "': '" << item << "' has no name before '['.", hint);
    // Each [..] group multiplies the names built so far.
    std::vector<std::string> names{""};
    std::size_t pos = 0;
    while (pos < item.size()) {
      const auto open = item.find('[', pos);
      const std::string literal = item.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
      for (auto& n : names) n += literal;
      if (open == std::string::npos) break;
      const auto close = item.find(']', open);
      std::vector<std::string> next;
      for (const auto& n : names) {
        for (const auto& r : expand_ranges(what, text, item.substr(open + 1, close - open - 1))) {
          if (next.size() >= limit) break;
          next.push_back(n + r);
        }
      }
      names = std::move(next);
      pos = close + 1;
    }
    for (auto& n : names) {
      if (hosts.size() >= limit) return hosts;
      hosts.push_back(std::move(n));
    }
  }
  return hosts;
}

std::vector<int> expand_tasks_per_node(const std::string& what, const std::string& text) {
  const std::string hint = "Slurm writes tasks per node like 2(x3),1";
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    int repeat = 1;
    std::string count = item;
    if (const auto paren = item.find('('); paren != std::string::npos) {
      DTRAIN_CHECK(item.size() > paren + 3 && item[paren + 1] == 'x' && item.back() == ')', ConfigError,
                   what << "='" << text << "': '" << item << "' is not N or N(xM).", hint);
      repeat = parse_int(what + " repeat", item.substr(paren + 2, item.size() - paren - 3), 1, kMaxRanks);
      count = item.substr(0, paren);
    }
    const int n = parse_int(what, count, 1, kMaxRanks);
    DTRAIN_CHECK(out.size() + static_cast<std::size_t>(repeat) <= static_cast<std::size_t>(kMaxRanks), ConfigError,
                 what << "='" << text << "' lists too many nodes.", hint);
    out.insert(out.end(), static_cast<std::size_t>(repeat), n);
  }
  DTRAIN_CHECK(!out.empty(), ConfigError, what << " is empty.", hint);
  return out;
}

int port_from_job_id(const std::string& job_id, int step) {
  return 15000 + static_cast<int>(fnv1a(job_id + "." + std::to_string(step)) % 17000);
}

}  // namespace detail

std::optional<ClusterTask> read_cluster_task(const EnvLookup& env) {
  if (slurm_task(env)) {
    // mpirun inside an allocation: its ranks inherit the SLURM_* variables of
    // the step that runs mpirun's daemons, which are not the ranks' own. (srun
    // --mpi=pmi2 sets both, and they agree.)
    const auto mpi_rank = first_of(env, {"OMPI_COMM_WORLD_RANK", "PMI_RANK"});
    const auto mpi_size = first_of(env, {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"});
    const bool agrees =
        (!mpi_rank || mpi_rank == env("SLURM_PROCID")) && (!mpi_size || mpi_size == env("SLURM_NTASKS"));
    if (agrees) return read_slurm(env);
    auto mpi = read_mpi(env);
    mpi->origin += "; SLURM_* ignored (they describe mpirun's daemons, not its ranks)";
    return mpi;
  }
  auto mpi = read_mpi(env);
  // An sbatch script's own shell has SLURM_PROCID=0 and SLURM_NTASKS=N too,
  // but it is no task of a parallel step: taking it for rank 0 of N would
  // wait for N-1 ranks that never start.
  DTRAIN_CHECK(mpi || !env("SLURM_PROCID"), ConfigError,
               "this process runs in Slurm job "
                   << env("SLURM_JOB_ID").value_or("?")
                   << "'s batch script, not as a task of srun (SLURM_STEP_ID is not set).",
               "start the ranks with srun (srun ./program), or start one `dtrain run` per node with srun "
               "--ntasks-per-node=1");
  return mpi;
}

EnvContract to_contract(const ClusterTask& t) {
  EnvContract c;
  c.rank = t.rank;
  c.world_size = t.world_size;
  c.local_rank = t.local_rank;
  c.local_world_size = t.local_world_size;
  c.master_addr = t.master_addr;
  c.master_port = t.master_port;
  c.group_rank = std::max(0, t.node_rank);
  c.run_id = t.job_id;
  c.source = t.source;
  return c;
}

}  // namespace dtrain::dist
