// Helpers shared by the checkpoint-format tests (safetensors, torch files,
// the fuzzers, `dtrain ckpt`): one binary, compiled in unity batches, so each
// helper is defined once, here (Note [Test unity builds]).
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include "test_paths.h"

namespace dtrain::testing::ckfiles {

// An empty folder DIR/dtrain-<prefix>-<name>-<pid> under the temp directory.
inline std::filesystem::path temp_dir(const std::string& prefix, const std::string& name) {
  auto dir =
      std::filesystem::temp_directory_path() / ("dtrain-" + prefix + "-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Runs tests/data/checkpoint/<script> with `args` in the project's Python;
// fails the test if it exits non-zero.
inline void run_peer(const std::string& script, const std::string& args) {
  const std::string cmd = std::string(DTRAIN_PYTHON) + " " + dtrain::testing::source_dir() + "/tests/data/checkpoint/" +
                          script + " " + args;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

inline nlohmann::json read_json(const std::filesystem::path& file) {
  std::ifstream in(file);
  return nlohmann::json::parse(in);
}

// CRC32 of a tensor's bytes (its contiguous copy), as Python's zlib.crc32.
inline std::uint32_t crc_of(const at::Tensor& t) {
  const auto c = t.contiguous();
  return static_cast<std::uint32_t>(
      ::crc32(0L, static_cast<const Bytef*>(c.data_ptr()), static_cast<uInt>(c.nbytes())));
}

}  // namespace dtrain::testing::ckfiles
