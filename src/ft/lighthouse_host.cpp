// The lighthouse as `dtrain run --ft-replicas` hosts it: a TCPStore server on
// the launcher's pre-bound socket with the quorum service on it, or, on node
// 1 under --ft-lighthouse-standby, the standby that serves one there once
// node 0's is lost. In libdtrain only; the launcher loads it on demand
// (tools/dtrain/libdtrain_loader.cpp).
#include <c10/util/Logging.h>

#include <functional>
#include <memory>
#include <optional>
#include <sstream>

#include "dtrain/error.h"
#include "dtrain/ft/lighthouse.h"
#include "dtrain/ft/standby_lighthouse.h"

namespace {

// "min_replicas=1,startup_replicas=4,heartbeat_timeout_ms=2000,join_timeout_ms=10000" (the
// launcher writes it; keys it leaves out keep their defaults); a standby's
// adds "primary=HOST:PORT,failover_timeout_ms=10000".
struct Config {
  dtrain::ft::LighthouseOptions lighthouse;
  std::optional<dtrain::ft::LighthouseAddress> primary;
  std::chrono::milliseconds failover_timeout{10000};
};

Config parse_config(const std::string& config) {
  Config c;
  auto& o = c.lighthouse;
  std::stringstream items(config);
  std::string item;
  while (std::getline(items, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = item.substr(0, eq);
    if (key == "primary") {
      c.primary = dtrain::ft::parse_lighthouse_addresses("the standby's primary", item.substr(eq + 1)).at(0);
      continue;
    }
    const long long value = std::stoll(item.substr(eq + 1));
    if (key == "min_replicas") {
      o.min_replicas = static_cast<int>(value);
    } else if (key == "startup_replicas") {
      o.startup_replicas = static_cast<int>(value);
    } else if (key == "heartbeat_timeout_ms") {
      o.heartbeat_timeout = std::chrono::milliseconds(value);
    } else if (key == "join_timeout_ms") {
      o.join_timeout = std::chrono::milliseconds(value);
    } else if (key == "failover_timeout_ms") {
      c.failover_timeout = std::chrono::milliseconds(value);
    } else {
      throw dtrain::InternalError("unknown lighthouse setting '" + key + "'");
    }
  }
  return c;
}

}  // namespace

// The entry point `dtrain run` looks up with dlsym (C linkage). Takes over
// `listen_fd` (a standby gets none: it binds `port` when it takes over);
// the service runs until *out is released. *check throws the
// error that stopped the service, if one did, and *serving says whether a
// lighthouse is served (a standby's: only once it took over); both valid
// while *out lives.
extern "C" __attribute__((visibility("default"))) void dtrain_host_lighthouse(int listen_fd, int port,
                                                                              const std::string* config,
                                                                              std::shared_ptr<void>* out,
                                                                              std::function<void()>* check,
                                                                              std::function<bool()>* serving) {
  FLAGS_caffe2_log_level = 3;  // replicas come and go: c10d's dropped-connection warnings are noise
  const Config c = parse_config(config != nullptr ? *config : "");
  if (c.primary) {
    auto standby = std::make_shared<dtrain::ft::StandbyLighthouse>(dtrain::ft::StandbyLighthouseOptions{
        .primary = *c.primary, .port = port, .failover_timeout = c.failover_timeout, .lighthouse = c.lighthouse});
    *check = [s = standby.get()] { s->check(); };
    *serving = [s = standby.get()] { return s->serving(); };
    *out = std::move(standby);
    return;
  }
  auto hosted = std::shared_ptr<dtrain::ft::HostedLighthouse>(
      dtrain::ft::host_lighthouse({.port = port, .listen_fd = listen_fd, .lighthouse = c.lighthouse}));
  *check = [service = hosted->lighthouse.get()] { service->check(); };
  *serving = [] { return true; };
  *out = std::move(hosted);
}

// Whether a lighthouse serves at host:port (ft::lighthouse_serves), for a
// launcher of node 0 started again: it hosts none when the standby serves.
extern "C" __attribute__((visibility("default"))) bool dtrain_lighthouse_serves(const std::string* host, int port,
                                                                                long long timeout_ms) {
  FLAGS_caffe2_log_level = 3;
  return dtrain::ft::lighthouse_serves({.host = *host, .port = port}, std::chrono::milliseconds(timeout_ms));
}
