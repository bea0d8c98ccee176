// Where a lighthouse may be served, and the one reader of the candidates'
// text form (DTRAIN_FT_LIGHTHOUSE, `dtrain run --ft-lighthouse-standby`).
// Free of LibTorch: the launcher (tools/dtrain) reads it too.
#pragma once

#include <string>
#include <vector>

namespace dtrain::ft {

// One place a lighthouse may be served: node 0's launcher, or the standby on
// node 1 that takes over when node 0 is lost (Note [Lighthouse failover] in
// src/ft/lighthouse_failover.cpp).
struct LighthouseAddress {
  std::string host;
  int port = 0;
  std::string to_string() const { return host + ":" + std::to_string(port); }
  friend bool operator==(const LighthouseAddress&, const LighthouseAddress&) = default;
};

// "HOST:PORT[,HOST:PORT...]": the candidates in order (node 0's, then the
// standby's). ConfigError naming `what` on a malformed or empty item.
std::vector<LighthouseAddress> parse_lighthouse_addresses(const std::string& what, const std::string& text);

}  // namespace dtrain::ft
