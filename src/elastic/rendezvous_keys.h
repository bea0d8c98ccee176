// Private: the rendezvous store's key names and the round-ending record
// (Note [Rendezvous protocol] in rendezvous.cpp), shared by the rendezvous
// and the failover machines (failover.cpp).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "dtrain/elastic/rendezvous.h"

namespace dtrain::elastic::detail {

inline std::string key(const std::string& k) {
  return "dtrain/rdzv/" + k;
}
inline std::string round_key(int r, const std::string& k) {
  return key("r" + std::to_string(r) + "/" + k);
}

inline std::string encode(const RoundEnding& e) {
  return nlohmann::json{{"kind", e.kind == RoundEnding::Kind::kFailure ? "failure" : "membership"},
                        {"reason", e.reason},
                        {"give_up", e.give_up},
                        {"exit_code", e.exit_code}}
      .dump();
}

inline RoundEnding decode(const std::string& text) {
  const auto j = nlohmann::json::parse(text);
  return {.kind = j.at("kind") == "failure" ? RoundEnding::Kind::kFailure : RoundEnding::Kind::kMembershipChange,
          .reason = j.at("reason"),
          .give_up = j.at("give_up"),
          .exit_code = j.at("exit_code")};
}

}  // namespace dtrain::elastic::detail
