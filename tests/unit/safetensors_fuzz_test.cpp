// Malformed safetensors files: each kind of damage by hand (a DataError that
// names the file and the problem), then a few thousand seeded mutations of
// valid files (truncations, byte flips, header lengths, edited JSON fields)
// where loading either succeeds with every byte accounted for or throws a
// DataError, never anything else. Run under -fsanitize=address to check that
// nothing reads out of bounds (docs/checkpoints.md).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint_files.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/error.h"
#include "safetensors_mutations.h"

namespace {

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;
using dtrain::testing::ckfiles::temp_dir;

using dtrain::testing::safetensors_fuzz::read_file_bytes;
using dtrain::testing::safetensors_fuzz::write_file_bytes;

// A file with this header text and `data_bytes` bytes of data (0x01 each);
// the length field is the header's unless `length` is given.
std::string file_with(const std::string& header, std::size_t data_bytes, std::optional<std::uint64_t> length = {}) {
  const std::uint64_t n = length.value_or(header.size());
  std::string bytes(reinterpret_cast<const char*>(&n), 8);
  return bytes + header + std::string(data_bytes, '\x01');
}

// Expects loading `bytes` to throw a DataError whose message names the file
// and contains `problem`.
void expect_refused(const fs::path& file, const std::string& bytes, const std::string& problem) {
  write_file_bytes(file, bytes);
  try {
    ck::load_safetensors(file);
    ADD_FAILURE() << "loaded a file that should fail with '" << problem << "'";
  } catch (const dtrain::DataError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(file.string()), std::string::npos) << what;
    EXPECT_NE(what.find(problem), std::string::npos) << "expected '" << problem << "' in: " << what;
  }
}

std::string entry(const std::string& dtype, const std::string& shape, std::uint64_t b, std::uint64_t e) {
  return "{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" + std::to_string(b) + "," +
         std::to_string(e) + "]}";
}

}  // namespace

TEST(SafetensorsMalformed, EachProblemNamed) {
  const auto dir = temp_dir("safetensors-fuzz", "malformed");
  const auto f = dir / "bad.safetensors";
  const auto a8 = "\"a\":" + entry("F32", "[2]", 0, 8);
  expect_refused(f, "\x05\x00\x00", "shorter than the 8-byte header length");
  expect_refused(f, file_with("{}", 0, std::uint64_t{1} << 40), "exceeds the format's limit");
  expect_refused(f, file_with("{}", 0, 1000), "runs past the end of the file");
  expect_refused(f, file_with("{\"a\": ", 0), "not valid JSON");
  expect_refused(f, file_with("[1, 2]", 0), "not an object");
  expect_refused(f, file_with("{" + a8 + "}", 4), "run past the data area");  // truncated data
  expect_refused(f, file_with("{" + a8 + ",\"b\":" + entry("F32", "[2]", 4, 12) + "}", 12), "overlaps tensor 'a'");
  expect_refused(f, file_with("{\"a\":" + entry("F32", "[1]", 0, 4) + ",\"b\":" + entry("F32", "[1]", 8, 12) + "}", 12),
                 "belong to no tensor");
  expect_refused(f, file_with("{" + a8 + "}", 12), "after the last tensor");
  expect_refused(f, file_with("{\"a\":" + entry("F32", "[3]", 0, 8) + "}", 8), "is 12 bytes, but data_offsets [0, 8]");
  expect_refused(f, file_with("{\"a\":" + entry("F7", "[2]", 0, 8) + "}", 8), "unknown dtype 'F7'");
  expect_refused(f, file_with("{" + a8 + "," + a8 + "}", 8), "names tensor 'a' twice");
  expect_refused(f, file_with("{\"a\":" + entry("F32", "[-2]", 0, 8) + "}", 8), "not a size");
  expect_refused(f, file_with("{\"a\":" + entry("F32", "[4611686018427387904,8]", 0, 8) + "}", 8), "too many");
  expect_refused(f, file_with("{\"a\":" + entry("F32", "[0]", 8, 0) + "}", 8), "end before they begin");
  expect_refused(f, file_with("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8), "has no \"data_offsets\"");
  expect_refused(f, file_with("{\"__metadata__\":{\"k\":1}}", 0), "is not a string");
  expect_refused(f, file_with("{\"a\":" + entry("BOOL", "[2]", 0, 2) + "}", 0) + std::string("\x00\x02", 2),
                 "BOOL bytes are 0 or 1");
  EXPECT_THROW(ck::load_safetensors(dir / "missing.safetensors"), dtrain::DataError);
  EXPECT_THROW(ck::load_safetensors(dir), dtrain::DataError);  // a folder

  // An index may not point outside its folder, nor disagree with its shards.
  const auto sharded = dir / "sharded";
  ck::save_safetensors_sharded(sharded, {{"a", at::ones(4)}, {"b", at::ones(4)}}, {.max_shard_bytes = 16});
  const auto index_file = sharded / "model.safetensors.index.json";
  const auto index = nlohmann::json::parse(read_file_bytes(index_file));
  auto escaped = index;
  escaped["weight_map"]["a"] = "../bad.safetensors";
  write_file_bytes(index_file, escaped.dump());
  EXPECT_THROW(ck::load_safetensors_dir(sharded), dtrain::DataError);
  auto moved = index;
  moved["weight_map"]["a"] = index["weight_map"]["b"];
  write_file_bytes(index_file, moved.dump());
  EXPECT_THROW(ck::load_safetensors_dir(sharded), dtrain::DataError);
  write_file_bytes(index_file, "{\"weight_map\": 3}");
  EXPECT_THROW(ck::load_safetensors_dir(sharded), dtrain::DataError);
}

// Seeded mutations of valid files. Loading succeeds (then the tensors'
// bytes and the header fill the file exactly, and every byte is readable)
// or throws DataError.
TEST(SafetensorsMalformed, FuzzedFilesGiveOnlyDataErrors) {
  namespace fz = dtrain::testing::safetensors_fuzz;
  const auto dir = temp_dir("safetensors-fuzz", "fuzz");
  const auto seeds = fz::seed_files(dir);
  std::mt19937_64 rng(26);
  const auto file = dir / "case.safetensors";
  int loaded = 0, refused = 0;
  constexpr int kCases = 3000;  // bench/safetensors_fuzz runs many more
  for (int i = 0; i < kCases; ++i) {
    std::string problem;
    const auto outcome = fz::check_case(file, fz::mutate(seeds, i, rng), i % 2 == 1, problem);
    EXPECT_TRUE(problem.empty()) << "case " << i << ": " << problem;
    (outcome == fz::Outcome::kLoaded ? loaded : refused)++;
  }
  std::printf("%d cases: %d loaded, %d refused with a DataError\n", kCases, loaded, refused);
  EXPECT_EQ(loaded + refused, kCases);
  EXPECT_GT(refused, kCases / 2);  // the mutations mostly break files ...
  EXPECT_GT(loaded, 50);           // ... and some leave them valid (flipped data-free JSON spaces, same-size dtypes)
}
