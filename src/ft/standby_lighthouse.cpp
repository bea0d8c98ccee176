// The standby lighthouse (include/dtrain/ft/standby_lighthouse.h; Note
// [Lighthouse failover] in lighthouse_failover.cpp).
//
// It takes over only after it has seen the primary serve: a standby started
// before node 0 (or on a job whose node 0 never came) waits instead of
// serving a lighthouse of its own. It carries over what a lighthouse cannot
// rebuild from requests: ft/finished (the training reached its last step),
// read from the primary while it lived, so a group that asks the standby
// late is told the training finished instead of waiting.
#include "dtrain/ft/standby_lighthouse.h"

#include "dtrain/comm/store_keys.h"
#include "dtrain/error.h"
#include "dtrain/log.h"

namespace dtrain::ft {

StandbyLighthouse::StandbyLighthouse(StandbyLighthouseOptions options) : options_(std::move(options)) {
  quiet_c10d_warnings();
  thread_ = std::thread([this] {
    try {
      watch();
    } catch (const std::exception& e) {
      DTRAIN_LOG(kError) << "standby lighthouse: stopped: " << e.what();
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
    }
  });
}

StandbyLighthouse::~StandbyLighthouse() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  std::lock_guard lock(mutex_);
  hosted_.reset();
}

void StandbyLighthouse::check() const {
  std::lock_guard lock(mutex_);
  if (error_) std::rethrow_exception(error_);
  if (hosted_) hosted_->lighthouse->check();
}

void StandbyLighthouse::watch() {
  using Clock = std::chrono::steady_clock;
  const std::string primary = options_.primary.to_string();
  std::optional<dist::Store> store;
  std::int64_t alive = -1;
  bool seen = false;
  auto moved_at = Clock::now();
  std::optional<std::string> finished;
  while (!stop_) {
    try {
      if (!store) store = connect_lighthouse(options_.primary.host, options_.primary.port, options_.poll_interval);
      dist::Store ft = store->with_prefix("ft");
      // A primary whose service stopped (ft/failed) is as lost as a dead one.
      if (!ft.check({"failed"})) {
        const std::int64_t now_alive = ft.add("alive", 0);
        if (now_alive != alive) {
          if (!seen) {
            DTRAIN_LOG(kInfo) << "standby lighthouse: watching the lighthouse at " << primary;
          }
          alive = now_alive;
          moved_at = Clock::now();
          seen = true;
        }
        if (const auto done = dist::get_if_present(ft, "finished")) finished = done;
      }
    } catch (const std::exception&) {
      store.reset();  // not answering: connect again next time
    }
    if (seen && Clock::now() - moved_at >= options_.failover_timeout) {
      take_over(finished);
      return;
    }
    const auto until = Clock::now() + options_.poll_interval;
    while (!stop_ && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void StandbyLighthouse::take_over(const std::optional<std::string>& finished) {
  DTRAIN_LOG(kWarning) << "standby lighthouse: the lighthouse at " << options_.primary.to_string()
                       << " has been silent for " << log::format_seconds(options_.failover_timeout)
                       << " (node 0 lost); serving a fresh one on port " << options_.port
                       << " (its ids start above the replicas' last ones)";
  auto hosted = host_lighthouse({.port = options_.port, .lighthouse = options_.lighthouse});
  if (finished) hosted->store.with_prefix("ft").set("finished", *finished);
  std::lock_guard lock(mutex_);
  hosted_ = std::move(hosted);
  serving_ = true;
}

}  // namespace dtrain::ft
