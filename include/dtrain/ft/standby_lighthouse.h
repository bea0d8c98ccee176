// The standby lighthouse (Note [Lighthouse failover] in
// src/ft/lighthouse_failover.cpp): node 1's launcher keeps one under
// `dtrain run --ft-lighthouse-standby HOST:PORT`. It watches the primary's
// liveness counter (ft/alive, at node 0) and, once the primary has been seen
// and then not moved (or not answered) for failover_timeout, hosts a fresh
// lighthouse on its own port, which the clients find as their next candidate.
//
//   ft::StandbyLighthouse standby({.primary = {"node0", 29400}, .port = 29401});
//   ... standby.serving() turns true after node 0's loss
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "dtrain/ft/lighthouse.h"

namespace dtrain::ft {

struct StandbyLighthouseOptions {
  LighthouseAddress primary;  // node 0's lighthouse
  // Where to serve on taking over; bound only then: a socket bound before
  // but not answering holds a c10d client's connect past its timeout (its
  // handshake waits), where a closed port refuses at once.
  int port = 0;
  // The primary silent this long (its counter still, or its store gone)
  // after it was first seen: it is lost, and the standby serves.
  std::chrono::milliseconds failover_timeout{std::chrono::seconds(10)};
  std::chrono::milliseconds poll_interval{std::chrono::milliseconds(200)};
  // The lighthouse it serves (its startup_replicas: the groups that outlive node 0).
  LighthouseOptions lighthouse;
};

class StandbyLighthouse {
 public:
  explicit StandbyLighthouse(StandbyLighthouseOptions options);
  ~StandbyLighthouse();
  StandbyLighthouse(const StandbyLighthouse&) = delete;
  StandbyLighthouse& operator=(const StandbyLighthouse&) = delete;
  // Whether it took over (serves a lighthouse now).
  bool serving() const { return serving_; }
  // Throws what stopped the watcher or, once serving, the lighthouse's check().
  void check() const;

 private:
  void watch();
  void take_over(const std::optional<std::string>& finished);

  StandbyLighthouseOptions options_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> serving_{false};
  mutable std::mutex mutex_;  // guards hosted_ and error_
  std::unique_ptr<HostedLighthouse> hosted_;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace dtrain::ft
