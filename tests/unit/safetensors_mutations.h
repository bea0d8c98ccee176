// Seeded mutations of valid safetensors files and the check every mutated
// file must pass: loading succeeds with every byte accounted for (and
// readable) or throws a DataError naming the file, never anything else.
// Shared by the suite's fuzz test (tests/unit/safetensors_fuzz_test.cpp, 3,000
// cases) and bench/safetensors_fuzz (any count, any seed).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/error.h"

namespace dtrain::testing::safetensors_fuzz {

inline std::string read_file_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline void write_file_bytes(const std::filesystem::path& file, const std::string& bytes) {
  std::ofstream(file, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Three valid files to mutate (every dtype family, metadata, an empty
// tensor, a scalar, an empty file), written into `dir`; their bytes.
inline std::vector<std::string> seed_files(const std::filesystem::path& dir) {
  namespace ck = dtrain::checkpoint;
  ck::save_safetensors(dir / "s0", {{"w", at::randn({3, 4})}, {"b", at::arange(5, at::kLong)}},
                       {.metadata = {{"step", "3"}}});
  ck::save_safetensors(dir / "s1", {{"x", at::ones({2, 2}, at::kBFloat16)},
                                    {"m", at::ones({3}, at::kBool)},
                                    {"e", at::empty({0, 3})},
                                    {"s", at::scalar_tensor(2.5, at::kDouble)},
                                    {"q", at::ones({4}, at::kFloat8_e4m3fn)}});
  ck::save_safetensors(dir / "s2", {});
  std::vector<std::string> seeds;
  for (const char* s : {"s0", "s1", "s2"}) seeds.push_back(read_file_bytes(dir / s));
  return seeds;
}

// Case `i`'s mutation of one of `seeds` (by i % 5: a truncation, replaced
// header bytes, a wrong length field, one JSON field edited with the length
// kept right, bytes appended after the data).
inline std::string mutate(const std::vector<std::string>& seeds, int i, std::mt19937_64& rng) {
  auto pick = [&](std::uint64_t n) { return n == 0 ? 0 : rng() % n; };
  std::string bytes = seeds[pick(seeds.size())];
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  switch (i % 5) {
    case 0:  // truncated anywhere
      bytes.resize(pick(bytes.size()));
      break;
    case 1:  // a few bytes of the header (length or JSON) replaced
      for (std::uint64_t k = 0, n = 1 + pick(4); k < n; ++k) bytes[pick(8 + header_bytes)] = static_cast<char>(rng());
      break;
    case 2: {  // the length field off by a little, or anything
      const std::uint64_t n =
          rng() % 2 ? header_bytes + static_cast<std::uint64_t>(static_cast<std::int64_t>(pick(17)) - 8) : rng();
      std::memcpy(bytes.data(), &n, 8);
      break;
    }
    case 3: {  // one field of the JSON edited, the length kept right
      auto json = nlohmann::json::parse(bytes.substr(8, header_bytes));
      std::vector<std::string> names;
      for (const auto& item : json.items())
        if (item.key() != "__metadata__") names.push_back(item.key());
      if (names.empty()) break;
      auto& e = json[names[pick(names.size())]];
      const std::vector<std::string> dtypes = {"F32", "F64", "BF16", "BOOL", "I8", "U64", "F8_E5M2", "X", ""};
      const std::int64_t deltas[] = {-9, -4, -1, 1, 2, 4, 8, 1LL << 40};
      switch (pick(6)) {
        case 0: e["dtype"] = dtypes[pick(dtypes.size())]; break;
        case 1: e["data_offsets"][pick(2)] = e["data_offsets"][0].get<std::int64_t>() + deltas[pick(8)]; break;
        case 2: e["shape"].push_back(static_cast<std::int64_t>(pick(4))); break;
        case 3: e.erase(std::vector<std::string>{"dtype", "shape", "data_offsets"}[pick(3)]); break;
        case 4: e["data_offsets"] = json[names[pick(names.size())]]["data_offsets"]; break;
        default: e = "x"; break;
      }
      const std::string text = json.dump();
      const std::uint64_t n = text.size();
      bytes = std::string(reinterpret_cast<const char*>(&n), 8) + text + bytes.substr(8 + header_bytes);
      break;
    }
    default:  // bytes appended after the data
      bytes.append(1 + pick(9), static_cast<char>(rng()));
      break;
  }
  return bytes;
}

enum class Outcome { kLoaded, kRefused };

// Writes `bytes` to `file` and loads it (copied or memory-mapped). A load
// must account for every byte of the file and read every tensor byte; a
// refusal must be a DataError naming the file. Anything else (another
// exception, a short accounting) is returned in `problem`.
inline Outcome check_case(const std::filesystem::path& file, const std::string& bytes, bool copy,
                          std::string& problem) {
  write_file_bytes(file, bytes);
  try {
    const auto contents = dtrain::checkpoint::load_safetensors(file, {.copy = copy});
    std::uint64_t total = 0;
    for (const auto& [name, t] : contents.tensors) {
      total += t.nbytes();
      volatile std::uint8_t sink = 0;
      const auto* p = static_cast<const std::uint8_t*>(t.data_ptr());
      for (std::size_t k = 0; k < t.nbytes(); ++k) sink = sink ^ p[k];  // every byte readable
    }
    std::uint64_t length = 0;
    std::memcpy(&length, bytes.data(), 8);
    if (8 + length + total != bytes.size()) problem = "loaded with bytes unaccounted for";
    return Outcome::kLoaded;
  } catch (const dtrain::DataError& e) {
    if (std::string(e.what()).find(file.string()) == std::string::npos)
      problem = std::string("a DataError that does not name the file: ") + e.what();
    return Outcome::kRefused;
  }
}

}  // namespace dtrain::testing::safetensors_fuzz
