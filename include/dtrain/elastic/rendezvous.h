// Rendezvous: how the agents of a job's nodes agree on each round's members
// and ranks, and learn that a round has ended.
//
// A round is one start of the worker group. It ends when a worker fails (a
// restart: counts against --max-restarts), or when membership changes (a
// node was lost, or a node is waiting to join and there is room): those
// rounds end without using a restart. See docs/launcher.md and Note
// [Rendezvous protocol] in src/elastic/rendezvous.cpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/elastic/worker_group.h"

namespace dtrain::elastic {

// The key-value operations the rendezvous needs. In `dtrain run`, c10d's
// TCPStore hosted by one of the nodes (libdtrain provides it, loaded on
// demand); in tests, an in-memory store. Every call may throw dtrain::Error
// (e.g. the node hosting the store went away).
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::optional<std::string> try_get(const std::string& key) = 0;
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  // Sets `key` to `desired` if it is absent; returns the value afterwards
  // (`desired` when this call set it).
  virtual std::string create_if_absent(const std::string& key, const std::string& desired) = 0;
  // Whether this process hosts the store (it must outlive the others' use).
  virtual bool hosts_store() const = 0;
};

// What one round gives this node.
struct RoundPlan {
  int round = 0;
  int restart_count = 0;  // rounds started after a failure, so far
  int node_rank = 0;
  int nnodes = 1;
  int rank_base = 0;  // global rank of this node's local rank 0
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
  int master_listen_fd = -1;  // node rank 0: MASTER_PORT, bound and listening, for the workers' store
};

struct RoundEnding {
  enum class Kind { kMembershipChange, kFailure };
  Kind kind = Kind::kFailure;
  std::string reason;    // "node host:pid was lost", or the failure's description
  bool give_up = false;  // a failure with no restarts left: every node stops
  int exit_code = 1;     // the launcher's exit code when giving up
};

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  // Joins the next round and blocks until it has formed.
  virtual RoundPlan next_round() = 0;
  // Called every monitor interval while the workers run: heartbeats, and
  // whether the round has ended elsewhere.
  virtual std::optional<RoundEnding> poll() = 0;
  // This node's workers failed: decides whether the round ends for a failure
  // (a restart, or giving up) or a membership change (a peer node was lost
  // and took the workers down with it).
  virtual RoundEnding report_failure(const WorkerExit& failure) = 0;
  // This node is done with the job (its workers succeeded, or the run gave
  // up). The node hosting the store keeps it up until every other member has
  // finished too (or is lost), so that they can learn how the run ended; so
  // does the last round's node rank 0, for the workers' store its agent hosts.
  virtual void finish() = 0;
};

// One node, no store: the agent binds a fresh MASTER_PORT each round.
class StandaloneRendezvous : public Rendezvous {
 public:
  StandaloneRendezvous(int nproc, int max_restarts, std::string master_addr, int master_port = 0);
  RoundPlan next_round() override;
  std::optional<RoundEnding> poll() override { return std::nullopt; }
  RoundEnding report_failure(const WorkerExit& failure) override;
  void finish() override {}

 private:
  int nproc_;
  int max_restarts_;
  std::string master_addr_;
  int master_port_;
  int round_ = -1;
  int restart_count_ = 0;
};

struct StoreRendezvousOptions {
  std::string run_id = "none";
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc = 1;       // workers on this node
  int node_rank = -1;  // --node-rank: orders nodes when given (ties by arrival)
  int max_restarts = 0;
  std::string local_addr = "127.0.0.1";  // how other nodes reach this one (MASTER_ADDR when node 0)
  std::string endpoint;                  // "host:port", for messages
  // After MIN nodes have joined, wait this long without a new arrival before closing the round.
  std::chrono::milliseconds last_call{2000};
  std::chrono::milliseconds timeout{std::chrono::seconds(900)};  // --rdzv-timeout
  std::chrono::milliseconds heartbeat_interval{500};
  // A node whose heartbeat has not changed for this long is lost.
  std::chrono::milliseconds heartbeat_timeout{3000};

  // Store-host failover (Note [Store-host failover] in rendezvous.cpp): opens
  // the store at host:port as its host (`host_it`; throws when the port cannot
  // be bound) or as a client within `timeout`. Unset: losing the node that
  // hosts the store ends the job, as in torch's c10d rendezvous.
  std::function<std::shared_ptr<RendezvousStore>(const std::string& host, int port, bool host_it,
                                                 std::chrono::milliseconds timeout)>
      reconnect;
  int port = 0;  // the endpoint's port: every generation's host serves on it, at its own address
  // --rdzv-conf failover_quorum=min: after a failover the first round needs
  // only MIN nodes instead of a majority of the last round's members. More
  // available, but the two sides of a partition may then both go on.
  bool failover_quorum_min = false;
};

// Several nodes over a shared store. Construction checks the run id and the
// MIN:MAX configuration against the store's and throws ConfigError on a mismatch.
class StoreRendezvous : public Rendezvous {
 public:
  StoreRendezvous(std::shared_ptr<RendezvousStore> store, StoreRendezvousOptions options);
  ~StoreRendezvous() override;
  RoundPlan next_round() override;
  std::optional<RoundEnding> poll() override;
  RoundEnding report_failure(const WorkerExit& failure) override;
  void finish() override;
  const std::string& node_id() const;

 private:
  // The same against the current store; a lost store host (CommunicationError)
  // makes the public ones fail over (Note [Store-host failover]).
  RoundPlan join_round();
  std::optional<RoundEnding> poll_store();
  RoundEnding report_to_store(const WorkerExit& failure);
  struct State;
  std::unique_ptr<State> state_;
};

// Connects to the rendezvous store at host:port, hosting it when host names
// this machine and the port is free (otherwise a client, as torch's c10d
// rendezvous does). Throws TimeoutError naming the endpoint when it cannot be
// reached within `timeout`. With a `secret`, every connection to the store
// proves it knows the secret first (Note [Rendezvous authentication] in
// src/elastic/rdzv_auth.cpp); ConfigError when this node's secret, or its
// lack of one, does not match the host's. Implemented in libdtrain (it needs c10d).
// `role` kHost: host it or throw ConfigError (a failover's successor);
// kClient: never host (another node's address may also name this machine).
enum class StoreRole { kAuto, kHost, kClient };
std::shared_ptr<RendezvousStore> connect_tcp_rendezvous_store(const std::string& host, int port,
                                                              std::chrono::milliseconds timeout,
                                                              const std::string& secret = "",
                                                              StoreRole role = StoreRole::kAuto);

// An in-memory store for tests (shared by "nodes" that are threads). In libdtrain.
std::shared_ptr<RendezvousStore> make_memory_rendezvous_store();

namespace auth {
// The rendezvous secret from `file` (--rdzv-secret-file) when given, else the
// variable DTRAIN_RDZV_SECRET, else "" (no authentication). Trailing white
// space of a file is dropped. ConfigError when the file cannot be read or the
// secret is shorter than 16 bytes. In dtrain_base.
std::string read_secret(const std::string& file);
}  // namespace auth

}  // namespace dtrain::elastic
