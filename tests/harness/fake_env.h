// Environments for tests of code that reads variables through an EnvLookup
// (the env contract, cluster launchers, `dtrain run`'s PET_* variables):
// a fixed map of variables instead of the process's environment.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <map>
#include <optional>
#include <string>

#include "dtrain/comm/env.h"

namespace dtrain::testing {

// Looks names up in `vars`; a name not in it is unset.
inline dist::EnvLookup fake_env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// Expects every one of `needles` in `text` (an error message, usually).
inline void expect_contains(const std::string& text, std::initializer_list<std::string> needles) {
  for (const auto& n : needles) EXPECT_NE(text.find(n), std::string::npos) << "missing '" << n << "' in: " << text;
}

}  // namespace dtrain::testing
