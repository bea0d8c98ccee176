// Runs an example program (optionally through a launcher command) and reads
// what it printed: shared by the example system tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dtrain::testing {

struct ExampleResult {
  int exit_code = -1;
  std::string stdout_text;
  std::string stderr_text;
};

// `launcher program args`, stdout through a pipe, stderr through a file.
inline ExampleResult run_example(const std::string& program, const std::string& args,
                                 const std::string& launcher = "") {
  const auto err_file =
      std::filesystem::temp_directory_path() /
      ("dtrain-example-" + std::filesystem::path(program).filename().string() + "-" + std::to_string(::getpid()));
  const std::string cmd = launcher + (launcher.empty() ? "" : " ") + program + " " + args + " 2>" + err_file.string();
  ExampleResult r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.stdout_text.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(err_file);
  r.stderr_text.assign(std::istreambuf_iterator<char>(err), std::istreambuf_iterator<char>());
  std::filesystem::remove(err_file);
  return r;
}

// The last line of `text` that is a JSON object (null when there is none).
inline nlohmann::json last_json_line(const std::string& text) {
  nlohmann::json last;
  size_t start = 0;
  while (start < text.size()) {
    auto end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const auto line = text.substr(start, end - start);
    if (!line.empty() && line.front() == '{') last = nlohmann::json::parse(line);
    start = end + 1;
  }
  return last;
}

// A float32 file written by an example's --save-params (empty when missing).
inline std::vector<float> read_floats(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> v(std::filesystem::exists(path) ? std::filesystem::file_size(path) / sizeof(float) : 0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
  return v;
}

// Whether scripts/setup.sh has built examples/gpt's corpus (the example's
// default --data-dir: $DTRAIN_CACHE, else $XDG_CACHE_HOME/dtrain, else ~/.cache/dtrain).
inline bool have_gpt_corpus() {
  const char* home = std::getenv("HOME");
  const char* cache = std::getenv("DTRAIN_CACHE");
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const std::string dir = cache != nullptr ? std::string(cache)
                          : xdg != nullptr ? std::string(xdg) + "/dtrain"
                                           : std::string(home != nullptr ? home : ".") + "/.cache/dtrain";
  return std::filesystem::exists(dir + "/shakespeare_char/meta.json");
}

// Parameters of a run against a reference run's: the elements differing by
// more than 1e-5 relative (+1e-6 absolute: Adam lifts rounding near zero
// gradients), and the relative L2 norm of the difference.
struct ParamsDiff {
  std::size_t outside = 0;
  double relative_l2 = 0;
};
// `reference_too`, when given, is the reference computed a second valid way
// (another kernel, e.g. DTRAIN_LINEAR_KERNEL's other choice); each element may then also
// differ by twice the two references' spread there, the rounding noise Adam
// lifts for that element whatever the order of summation.
inline ParamsDiff compare_params(const std::vector<float>& params, const std::vector<float>& reference,
                                 const std::vector<float>* reference_too = nullptr) {
  ParamsDiff out;
  double diff2 = 0, ref2 = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {  // callers assert equal sizes first
    const double d = std::abs(static_cast<double>(params[i]) - reference[i]);
    diff2 += d * d;
    ref2 += static_cast<double>(reference[i]) * reference[i];
    const double spread =
        reference_too == nullptr ? 0.0 : std::abs(static_cast<double>((*reference_too)[i]) - reference[i]);
    if (d > 1e-5 * std::abs(reference[i]) + 1e-6 + 2 * spread) ++out.outside;
  }
  out.relative_l2 = std::sqrt(diff2 / ref2);  // NaN for an all-zero reference: fails any bound
  return out;
}

}  // namespace dtrain::testing
