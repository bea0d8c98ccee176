// The lighthouse's candidate addresses (include/dtrain/ft/lighthouse_address.h).
#include "dtrain/ft/lighthouse_address.h"

#include <algorithm>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"

namespace dtrain::ft {

std::vector<LighthouseAddress> parse_lighthouse_addresses(const std::string& what, const std::string& text) {
  std::vector<LighthouseAddress> out;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const std::size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    const auto colon = item.rfind(':');
    DTRAIN_CHECK(colon != std::string::npos && colon > 0, ConfigError,
                 what << "=" << text << ": '" << item << "' is not HOST:PORT.",
                 "e.g. 127.0.0.1:29600, or node0:29400,node1:29401 (node 0's lighthouse, then the standby)");
    out.push_back({.host = item.substr(0, colon),
                   .port = dist::detail::parse_int(what + " port", item.substr(colon + 1), 1, 65535)});
    begin = end + 1;
  }
  return out;
}

}  // namespace dtrain::ft
