// The lighthouse as `dtrain run --ft-replicas` hosts it: a TCPStore server on
// the launcher's pre-bound socket with the quorum service on it. In libdtrain
// only; the launcher loads it on demand (tools/dtrain/libdtrain_loader.cpp).
#include <c10/util/Logging.h>

#include <functional>
#include <memory>
#include <sstream>

#include "dtrain/error.h"
#include "dtrain/ft/lighthouse.h"

namespace {

// "min_replicas=1,startup_replicas=4,heartbeat_timeout_ms=2000,join_timeout_ms=10000" (the
// launcher writes it; keys it leaves out keep their defaults).
dtrain::ft::LighthouseOptions parse_config(const std::string& config) {
  dtrain::ft::LighthouseOptions o;
  std::stringstream items(config);
  std::string item;
  while (std::getline(items, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = item.substr(0, eq);
    const long long value = std::stoll(item.substr(eq + 1));
    if (key == "min_replicas") {
      o.min_replicas = static_cast<int>(value);
    } else if (key == "startup_replicas") {
      o.startup_replicas = static_cast<int>(value);
    } else if (key == "heartbeat_timeout_ms") {
      o.heartbeat_timeout = std::chrono::milliseconds(value);
    } else if (key == "join_timeout_ms") {
      o.join_timeout = std::chrono::milliseconds(value);
    } else {
      throw dtrain::InternalError("unknown lighthouse setting '" + key + "'");
    }
  }
  return o;
}

}  // namespace

// The entry point `dtrain run` looks up with dlsym (C linkage). Takes over
// `listen_fd`; the service runs until *out is released. *check throws the
// error that stopped the service, if one did (valid while *out lives).
extern "C" __attribute__((visibility("default"))) void dtrain_host_lighthouse(int listen_fd, int port,
                                                                              const std::string* config,
                                                                              std::shared_ptr<void>* out,
                                                                              std::function<void()>* check) {
  FLAGS_caffe2_log_level = 3;  // replicas come and go: c10d's dropped-connection warnings are noise
  auto hosted = std::shared_ptr<dtrain::ft::HostedLighthouse>(dtrain::ft::host_lighthouse(
      {.port = port, .listen_fd = listen_fd, .lighthouse = parse_config(config != nullptr ? *config : "")}));
  *check = [service = hosted->lighthouse.get()] { service->check(); };
  *out = std::move(hosted);
}
