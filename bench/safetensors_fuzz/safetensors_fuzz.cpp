// The suite's safetensors fuzz (tests/unit/safetensors_fuzz_test.cpp) at any
// size: `count` seeded mutations of valid files (tests/unit/safetensors_mutations.h),
// each loaded memory-mapped and copied in turn; every one must load with all
// its bytes accounted for or be refused with a DataError naming the file.
//
//   bench_safetensors_fuzz [--seed 26] [--count 200000] [--dir /tmp]
// Prints one JSON line (cases, loaded, refused, failures, seconds); exits 1
// on the first case that fails, naming its seed and index, after writing the
// file to DIR/failing.safetensors.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "safetensors_mutations.h"

int main(int argc, char** argv) {
  namespace fz = dtrain::testing::safetensors_fuzz;
  namespace fs = std::filesystem;
  CLI::App app{"Fuzz dtrain's safetensors reader with seeded mutations of valid files."};
  std::uint64_t seed = 26;
  std::int64_t count = 200000;
  std::string dir_option = fs::temp_directory_path().string();
  app.add_option("--seed", seed, "mutation seed (the suite uses 26)");
  app.add_option("--count", count, "cases (the suite runs 3000)")->check(CLI::PositiveNumber);
  app.add_option("--dir", dir_option, "where the seed files and each case's file are written");
  CLI11_PARSE(app, argc, argv);
  const fs::path dir = fs::path(dir_option) / ("dtrain-safetensors-fuzz-" + std::to_string(seed));
  fs::create_directories(dir);
  const auto seeds = fz::seed_files(dir);
  std::mt19937_64 rng(seed);
  const auto file = dir / "case.safetensors";
  std::int64_t loaded = 0, refused = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < count; ++i) {
    const std::string bytes = fz::mutate(seeds, static_cast<int>(i % 5), rng);
    for (const bool copy : {false, true}) {
      std::string problem;
      fz::Outcome outcome = fz::Outcome::kRefused;
      try {
        outcome = fz::check_case(file, bytes, copy, problem);
      } catch (const std::exception& e) {
        problem = std::string("threw something other than a DataError: ") + e.what();
      }
      if (!problem.empty()) {
        fz::write_file_bytes(dir / "failing.safetensors", bytes);
        std::cerr << "seed " << seed << ", case " << i << (copy ? " (copied)" : " (mapped)") << ": " << problem
                  << "; the file is " << (dir / "failing.safetensors").string() << "\n";
        return 1;
      }
      if (!copy) (outcome == fz::Outcome::kLoaded ? loaded : refused)++;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fs::remove_all(dir);
  std::cout << nlohmann::json{{"bench", "safetensors_fuzz"}, {"seed", seed},  {"cases", count},    {"loaded", loaded},
                              {"refused", refused},          {"failures", 0}, {"seconds", seconds}}
                   .dump()
            << std::endl;
  return 0;
}
