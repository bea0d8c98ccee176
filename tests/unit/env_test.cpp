// The launcher/worker environment contract: parsing and every kind of bad input.
#include <gtest/gtest.h>

#include <map>

#include "dtrain/comm/env.h"
#include "dtrain/error.h"
#include "fake_env.h"

using dtrain::ConfigError;
using dtrain::dist::EnvLookup;
using dtrain::dist::read_env_contract;
using dtrain::testing::fake_env;

namespace {
using Vars = std::map<std::string, std::string>;

Vars good() {
  return {{"RANK", "2"},
          {"WORLD_SIZE", "4"},
          {"LOCAL_RANK", "0"},
          {"LOCAL_WORLD_SIZE", "2"},
          {"MASTER_ADDR", "node0"},
          {"MASTER_PORT", "29511"}};
}

// Expects read_env_contract to throw a ConfigError whose text contains every `needle`.
void expect_config_error(const Vars& vars, std::initializer_list<std::string> needles) {
  try {
    read_env_contract(fake_env(vars));
    ADD_FAILURE() << "no error thrown";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << "missing '" << n << "' in: " << what;
    EXPECT_FALSE(e.hint().empty()) << what;
  }
}
}  // namespace

TEST(EnvContract, ReadsAllFields) {
  const auto c = read_env_contract(fake_env(good()));
  EXPECT_EQ(c.rank, 2);
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.local_rank, 0);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.master_addr, "node0");
  EXPECT_EQ(c.master_port, 29511);
}

TEST(EnvContract, LocalVariablesDefaultToOneNode) {
  auto v = good();
  v.erase("LOCAL_RANK");
  v.erase("LOCAL_WORLD_SIZE");
  const auto c = read_env_contract(fake_env(v));
  EXPECT_EQ(c.local_rank, 2);
  EXPECT_EQ(c.local_world_size, 4);
}

TEST(EnvContract, MissingRequiredVariableIsNamed) {
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    auto v = good();
    v.erase(name);
    expect_config_error(v, {std::string(name) + " is not set", "dtrain run"});
  }
}

TEST(EnvContract, MalformedNumbersAreNamed) {
  for (const auto& [name, value] : std::map<std::string, std::string>{{"RANK", "one"},
                                                                      {"WORLD_SIZE", "4x"},
                                                                      {"WORLD_SIZE", ""},
                                                                      {"MASTER_PORT", "http"},
                                                                      {"LOCAL_RANK", "-"},
                                                                      {"LOCAL_WORLD_SIZE", "2.5"}}) {
    auto v = good();
    v[name] = value;
    expect_config_error(v, {name + "='" + value + "' is not an integer"});
  }
}

TEST(EnvContract, OutOfRangeValues) {
  auto v = good();
  v["RANK"] = "4";
  expect_config_error(v, {"RANK=4 is not below WORLD_SIZE=4"});
  v = good();
  v["RANK"] = "-1";
  expect_config_error(v, {"RANK=-1 is out of range"});
  v = good();
  v["WORLD_SIZE"] = "0";
  expect_config_error(v, {"WORLD_SIZE=0 is out of range"});
  v = good();
  v["MASTER_PORT"] = "70000";
  expect_config_error(v, {"MASTER_PORT=70000 is out of range 1..65535"});
  v = good();
  v["LOCAL_RANK"] = "2";
  expect_config_error(v, {"LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"});
  v = good();
  v["LOCAL_WORLD_SIZE"] = "5";
  expect_config_error(v, {"LOCAL_WORLD_SIZE=5 must be in 1..WORLD_SIZE=4"});
  v = good();
  v["MASTER_ADDR"] = "";
  expect_config_error(v, {"MASTER_ADDR is empty"});
}

TEST(EnvContract, TorchElasticVariables) {
  auto v = good();
  EXPECT_FALSE(read_env_contract(fake_env(v)).agent_store);
  v["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  v["TORCHELASTIC_RESTART_COUNT"] = "3";
  const auto c = read_env_contract(fake_env(v));
  EXPECT_TRUE(c.agent_store);
  EXPECT_EQ(c.restart_count, 3);
  v["TORCHELASTIC_RESTART_COUNT"] = "-1";
  expect_config_error(v, {"TORCHELASTIC_RESTART_COUNT=-1 is out of range"});
}

TEST(EnvContract, LaunchedByLauncher) {
  EXPECT_TRUE(dtrain::dist::launched_by_launcher(fake_env(good())));
  EXPECT_FALSE(dtrain::dist::launched_by_launcher(fake_env({{"RANK", "0"}})));
}

TEST(DefaultTimeout, FallbackAndOverride) {
  using namespace std::chrono;
  EXPECT_EQ(dtrain::dist::default_timeout(seconds(7), fake_env({})), milliseconds(7000));
  EXPECT_EQ(dtrain::dist::default_timeout(seconds(7), fake_env({{"DTRAIN_TIMEOUT_SECONDS", "2.5"}})),
            milliseconds(2500));
  EXPECT_EQ(dtrain::dist::default_timeout(seconds(7), fake_env({{"DTRAIN_TIMEOUT_SECONDS", "120"}})),
            milliseconds(120000));
  for (const char* bad : {"", "soon", "-3", "0", "1e400", "5s"}) {
    EXPECT_THROW(dtrain::dist::default_timeout(seconds(7), fake_env({{"DTRAIN_TIMEOUT_SECONDS", bad}})), ConfigError)
        << bad;
  }
}

TEST(LinearKernel, AutoByDefaultAtenOrOneDnnOnRequestAndMalformedRefused) {
  using dtrain::dist::LinearKernel;
  EXPECT_EQ(dtrain::dist::linear_kernel(fake_env({})), LinearKernel::kAuto);
  EXPECT_EQ(dtrain::dist::linear_kernel(fake_env({{"DTRAIN_LINEAR_KERNEL", ""}})), LinearKernel::kAuto);
  EXPECT_EQ(dtrain::dist::linear_kernel(fake_env({{"DTRAIN_LINEAR_KERNEL", "auto"}})), LinearKernel::kAuto);
  EXPECT_EQ(dtrain::dist::linear_kernel(fake_env({{"DTRAIN_LINEAR_KERNEL", "aten"}})), LinearKernel::kAten);
  EXPECT_EQ(dtrain::dist::linear_kernel(fake_env({{"DTRAIN_LINEAR_KERNEL", "onednn"}})), LinearKernel::kOneDnn);
  for (const char* bad : {"ATen", "oneDNN", "mkl", " aten"}) {
    try {
      dtrain::dist::linear_kernel(fake_env({{"DTRAIN_LINEAR_KERNEL", bad}}));
      ADD_FAILURE() << "no error for " << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("DTRAIN_LINEAR_KERNEL"), std::string::npos) << e.what();
      EXPECT_FALSE(e.hint().empty());
    }
  }
}

TEST(EnvContract, WhatALauncherWritesReadsBackTheSame) {
  const dtrain::dist::EnvContract written{.rank = 5,
                                          .world_size = 8,
                                          .local_rank = 1,
                                          .local_world_size = 4,
                                          .master_addr = "10.1.2.3",
                                          .master_port = 29777,
                                          .agent_store = true,
                                          .restart_count = 2,
                                          .group_rank = 1,
                                          .max_restarts = 3,
                                          .run_id = "job-7"};
  const auto vars = dtrain::dist::to_environment(written);
  EXPECT_EQ(vars.at("ROLE_RANK"), "5");
  EXPECT_EQ(vars.at("ROLE_WORLD_SIZE"), "8");
  const auto c = read_env_contract(fake_env(Vars(vars.begin(), vars.end())));
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.master_addr, "10.1.2.3");
  EXPECT_EQ(c.master_port, 29777);
  EXPECT_TRUE(c.agent_store);
  EXPECT_EQ(c.restart_count, 2);
  EXPECT_EQ(c.group_rank, 1);
  EXPECT_EQ(c.max_restarts, 3);
  EXPECT_EQ(c.run_id, "job-7");
}
