// What `dtrain run` needs from libdtrain: c10d's TCPStore, for the workers'
// store (include/dtrain/elastic/worker_store.h) and the multi-node rendezvous.
// libdtrain is loaded on first use, so the launcher itself links no LibTorch
// and starts in milliseconds.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/elastic/rendezvous.h"
#include "dtrain/elastic/worker_store.h"

namespace dtrain::tools {

// Connects to (or hosts) the rendezvous store at host:port through libdtrain.
std::shared_ptr<elastic::RendezvousStore> load_tcp_rendezvous_store(
    const std::string& host, int port, std::chrono::milliseconds timeout, const std::string& secret = "",
    elastic::StoreRole role = elastic::StoreRole::kAuto);

// `dtrain ckpt`'s work, done in libdtrain (src/checkpoint/ckpt_command.cpp):
// `args` as that file describes; prints to `out`, throws dtrain::Error.
int run_ckpt_command(const std::vector<std::string>& args, std::ostream& out);
// The same for dtrain's own checkpoint folders (src/trainer/ckpt_folder_command.cpp).
int run_ckpt_folder_command(const std::vector<std::string>& args, std::ostream& out);

// Whether a fault-tolerance lighthouse serves at host:port (src/ft/lighthouse_host.cpp).
bool lighthouse_serves(const std::string& host, int port, std::chrono::milliseconds timeout);

// Hosts the workers' store through libdtrain. serve() finds libdtrain at once
// (ConfigError when there is none, before any worker starts) and then loads
// it and starts the store on a background thread, while the agent starts the
// workers: loading LibTorch takes longer than starting a process.
class BackgroundWorkerStore : public elastic::WorkerStoreHost {
 public:
  BackgroundWorkerStore() = default;
  // The fault-tolerance lighthouse (src/ft/lighthouse_host.cpp) instead of a
  // workers' store; `config` is its settings line.
  struct Lighthouse {
    std::string config;
  };
  explicit BackgroundWorkerStore(Lighthouse lighthouse)
      : lighthouse_config_(std::move(lighthouse.config)), lighthouse_(true) {}
  BackgroundWorkerStore(const BackgroundWorkerStore&) = delete;
  BackgroundWorkerStore& operator=(const BackgroundWorkerStore&) = delete;
  ~BackgroundWorkerStore() override;
  void serve(int listen_fd, int port) override;
  void stop() override;
  void check() override;
  bool serving() override;

 private:
  std::thread starter_;
  std::mutex mutex_;
  std::shared_ptr<void> store_;  // the running server; guarded by mutex_
  std::exception_ptr error_;     // why it is not running; guarded by mutex_
  // The lighthouse's own health (its service thread): throws what stopped it.
  std::function<void()> check_service_;  // guarded by mutex_
  std::function<bool()> serving_;        // guarded by mutex_
  std::string lighthouse_config_;
  bool lighthouse_ = false;
};

}  // namespace dtrain::tools
