// The workers' store: the agent of node rank 0 hosts c10d's TCPStore on
// each round's MASTER_PORT, and every worker is told so
// (TORCHELASTIC_USE_AGENT_STORE=True), as torchrun does. Workers then only
// connect, so any torch.distributed program (Python or C++ on plain c10d,
// env:// rendezvous) runs unchanged: none of them tries to bind MASTER_PORT.
//
// See Note [Worker store] in src/elastic/agent.cpp for why the store lives
// for one round and how it is started without delaying the workers.
#pragma once

namespace dtrain::elastic {

// Contract: called from the agent's thread only.
class WorkerStoreHost {
 public:
  virtual ~WorkerStoreHost() = default;
  // Takes ownership of `listen_fd`, a socket already listening on `port`
  // (MASTER_PORT), and serves the store on it until stop(). May return before
  // the store accepts: workers' connections queue on the socket meanwhile.
  virtual void serve(int listen_fd, int port) = 0;
  // Stops serving and closes the socket; the round's workers are gone. Does
  // nothing when not serving.
  virtual void stop() = 0;
  // Throws the error that keeps the store from serving (e.g. libdtrain could
  // not be loaded), if any; called every monitor interval while workers run.
  virtual void check() = 0;
  // Whether it serves now (a standby lighthouse: only once it took over;
  // Note [Lighthouse failover] in src/ft/lighthouse_failover.cpp).
  virtual bool serving() { return true; }
};

}  // namespace dtrain::elastic
