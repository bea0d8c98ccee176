// Save and load throughput of a safetensors file (default 1 GiB of float32
// tensors, 64 x 16 MiB), dtrain's writer and mmap'd reader. Prints one JSON
// line per case: {"impl", "case", "seconds", "gb_per_s"}. Loads are timed
// until every byte has been read (a sum over each tensor), since a mmap'd
// view costs nothing until touched; the file is in the page cache (it was
// just written), as it is for the Python peer run beside it.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "../common/timing.h"
#include "dtrain/checkpoint/safetensors.h"

namespace ck = dtrain::checkpoint;

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/tmp";
  const std::int64_t tensors = argc > 2 ? std::atoll(argv[2]) : 64;
  const std::int64_t floats = 4 * 1024 * 1024;  // 16 MiB each
  ck::NamedTensors named;
  for (std::int64_t i = 0; i < tensors; ++i) named.emplace_back("layer." + std::to_string(i), at::randn({floats}));
  const double gb = static_cast<double>(tensors * floats * 4) / 1e9;
  const auto file = std::filesystem::path(dir) / "dtrain_bench.safetensors";
  auto report = [&](const char* name, double seconds) {
    std::printf("{\"impl\": \"dtrain\", \"case\": \"%s\", \"seconds\": %.4f, \"gb_per_s\": %.3f}\n", name, seconds,
                gb / seconds);
    std::fflush(stdout);
  };
  for (const bool durable : {false, true}) {
    const auto t = dtrain::bench::Clock::now();
    ck::save_safetensors(file, named, {.durable = durable});
    report(durable ? "save_fsync" : "save", dtrain::bench::ms_since(t) / 1e3);
  }
  for (const bool copy : {false, true}) {
    const auto t = dtrain::bench::Clock::now();
    double total = 0;
    {
      const auto contents = ck::load_safetensors(file, {.copy = copy});
      for (const auto& [name, tensor] : contents.tensors) total += tensor.sum().item<double>();
    }
    report(copy ? "load_copy_and_read" : "load_and_read", dtrain::bench::ms_since(t) / 1e3);
    if (total == 0.123) std::printf("\n");  // keep the sums
  }
  std::filesystem::remove(file);
}
