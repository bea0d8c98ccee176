// The launcher's agent for fault-tolerant replica groups (`dtrain run
// --ft-replicas N`, docs/fault_tolerance.md): the node's workers split into
// N replica groups, each a job of its own (its own WORLD_SIZE, ranks and
// workers' store), and the lighthouse that forms their quorums hosted for
// the whole run. A failed or hung worker stops and restarts its replica
// group only; the other groups never stop, and the restarted one recovers
// its state from them live (ft::FaultTolerantReplicas).
//
// Per replica group:  running -> (a worker failed, restarts left) stop the
// group, fresh store on a new port, start it again (its restart count + 1)
//                     running -> (a worker failed, none left) the run fails
//                     running -> (all exited 0) done; the run succeeds when
//                     every group is done.
// The whole job: the lighthouse reports every up-to-date group gone -> every
// group restarted with a fresh lighthouse, from its checkpoint (a restart of
// each; the run fails when one has none left). Note [Whole-job restart of
// replica groups] in src/elastic/replica_agent.cpp.
// On several nodes, each node's launcher runs its share of the groups, and
// node 0 hosts the lighthouse: a node that dies takes only its groups down;
// with a standby (node 1), node 0's loss stops nothing but node 0's groups.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "dtrain/elastic/agent.h"
#include "dtrain/replica_errors.h"

namespace dtrain::elastic {

struct ReplicaAgentOptions {
  // nproc_per_node: all workers of the node, replicas * ranks per replica;
  // max_restarts: how often each replica group may be restarted.
  AgentOptions agent;
  // The replica groups of the whole job (of all nodes).
  int replicas = 2;
  // The lighthouse's port (0: a free one); workers get it as DTRAIN_FT_LIGHTHOUSE.
  int lighthouse_port = 0;
  // Several nodes (Note [Replica groups on several nodes]): node node_rank of
  // `nodes` runs replica groups node_rank * L .. node_rank * L + L - 1, L =
  // replicas / nodes, of nproc_per_node / L ranks each. Node 0 hosts the
  // lighthouse; the others give their workers lighthouse_host:lighthouse_port.
  int nodes = 1;
  int node_rank = 0;
  std::string lighthouse_host;
  // Node 0, once its own groups are done, serves the lighthouse this much
  // longer, so the other nodes' groups finish their last step with it.
  std::chrono::milliseconds linger{0};
  // The standby lighthouse (Note [Lighthouse failover] in
  // src/ft/lighthouse_failover.cpp; empty host: none): node 1 keeps it
  // (`lighthouse` then serves as the standby, on standby_port), and every
  // worker gets it as its second candidate. Node 0, started again after its
  // loss, finds it serving (lighthouse_serves) and hosts none.
  std::string standby_host;
  int standby_port = 0;
  std::function<bool(const std::string& host, int port)> lighthouse_serves;
};

class ReplicaAgent {
 public:
  using MakeWorkers = std::function<std::unique_ptr<WorkerGroup>(int replica)>;
  using MakeStoreHost = std::function<std::unique_ptr<WorkerStoreHost>()>;
  // `lighthouse` serves the lighthouse on the socket it is given (not owned).
  ReplicaAgent(ReplicaAgentOptions options, MakeWorkers make_workers, MakeStoreHost make_store,
               WorkerStoreHost& lighthouse);
  AgentResult run(const std::atomic<int>& interrupt);
  // The environment of worker `local_rank` of replica group `replica`.
  std::map<std::string, std::string> worker_env(int replica, int local_rank, int port, int restarts) const;
  // Where a group's ranks dump their flight recorders (with the recorder on):
  // AgentOptions::flight_dump_dir/replica_<r>/attempt_<restarts>.
  std::string flight_dump_dir(int replica, int restarts) const;

 private:
  struct Replica;
  void start(Replica& replica);
  // (Re)starts the lighthouse on a fresh socket (its port when one was given).
  void serve_lighthouse();
  // Every group again, with a fresh lighthouse, when the newest state is
  // lost; false (result filled) when a group has no restart left.
  bool restart_whole_job(std::vector<Replica>& replicas, const Error& lost, AgentResult& result);
  int local_replicas() const { return options_.replicas / options_.nodes; }
  int ranks_per_replica() const { return options_.agent.nproc_per_node / local_replicas(); }
  bool hosts_lighthouse() const { return options_.node_rank == 0; }
  bool keeps_standby() const { return options_.node_rank == 1 && !options_.standby_host.empty(); }
  // This node's lighthouse, hosted or standby: its check() and linger apply.
  bool has_lighthouse() const { return (hosts_lighthouse() && !standby_serves_) || keeps_standby(); }
  // Whether this node's lighthouse serves the other nodes' groups now.
  bool serves_lighthouse() { return hosts_lighthouse() ? !standby_serves_ : keeps_standby() && lighthouse_.serving(); }

  ReplicaAgentOptions options_;
  MakeWorkers make_workers_;
  MakeStoreHost make_store_;
  WorkerStoreHost& lighthouse_;
  int lighthouse_port_ = 0;
  bool standby_serves_ = false;  // node 0 started again after the standby took over
};

}  // namespace dtrain::elastic
