// Whether this process has mapped a library (its path contains `library`),
// read from /proc/self/maps: what tests use to tell which shared objects a
// program loaded (the NCCL module's lazy load, LibTorch's parts).
#pragma once

#include <fstream>
#include <string>

namespace dtrain::testing {

inline bool process_maps_contain(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(library) != std::string::npos) return true;
  }
  return false;
}

}  // namespace dtrain::testing
