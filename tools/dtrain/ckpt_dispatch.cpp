// `dtrain ckpt` dispatch and the DCP converter (tools/dtrain/ckpt_dispatch.h).
#include "ckpt_dispatch.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "dtrain/error.h"
#include "libdtrain_loader.h"

namespace dtrain::tools {
namespace {

namespace fs = std::filesystem;

// A Checkpointer folder: a step_<N> with a MANIFEST, or a folder holding step_<N>s.
bool is_dtrain_checkpoint(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return false;
  if (fs::exists(path / "MANIFEST") && fs::exists(path / "state.json")) return true;
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    if (entry.path().filename().string().rfind("step_", 0) == 0 && fs::exists(entry.path() / "MANIFEST")) return true;
  }
  return false;
}

bool is_dcp(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(path / ".metadata");
}

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// python/dtrain_dcp.py: $DTRAIN_DCP_CONVERTER, else share/dtrain/ beside this
// binary's folder (bin/dtrain installed; tools/dtrain in the build tree, where
// tools/CMakeLists.txt copies it).
std::string converter_path() {
  if (const char* env = std::getenv("DTRAIN_DCP_CONVERTER")) return env;
  std::error_code ec;
  const fs::path found =
      fs::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "share" / "dtrain" / "dtrain_dcp.py";
  DTRAIN_CHECK(!ec && fs::exists(found), ConfigError,
               "the DCP converter dtrain_dcp.py was not found at " << found.string() << ".",
               "set DTRAIN_DCP_CONVERTER to the path of python/dtrain_dcp.py (or reinstall dtrain)");
  return found.string();
}

void run_converter(const std::string& mode, const fs::path& src, const fs::path& dst, std::ostream& out) {
  const char* python = std::getenv("DTRAIN_PYTHON");
  const std::string cmd = quoted(python ? python : "python3") + " " + quoted(converter_path()) + " " + mode + " " +
                          quoted(src.string()) + " " + quoted(dst.string());
  out << "running " << cmd << "\n" << std::flush;
  const int status = std::system(cmd.c_str());
  DTRAIN_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, ConfigError,
               "the DCP converter failed (" << cmd << ", status " << status << ").",
               "it needs a Python with torch: set DTRAIN_PYTHON (e.g. ~/.cache/dtrain/venv/bin/python)");
}

// A temporary .pt removed when it goes out of scope.
struct TempFile {
  fs::path path;
  explicit TempFile(const std::string& what)
      : path(fs::temp_directory_path() / ("dtrain-ckpt-" + std::to_string(::getpid()) + "-" + what + ".pt")) {}
  ~TempFile() {
    std::error_code ec;
    fs::remove(path, ec);
  }
};

}  // namespace

int ckpt_command(const CkptRequest& r, std::ostream& out) {
  fs::path input = r.input;
  std::string key = r.key;
  TempFile from_dcp("from-dcp");
  if (is_dcp(input)) {  // DCP in: whole into a torch.save file first
    run_converter("from-dcp", input, from_dcp.path, out);
    input = from_dcp.path;
    if (key.empty() && r.to != "torch" && r.to != "dcp") key = "model";
  }
  const std::string max = std::to_string(r.max_shard_bytes);
  const bool dtrain_folder = is_dtrain_checkpoint(input);
  if (r.command == "inspect") {
    return dtrain_folder ? run_ckpt_folder_command({"inspect", input.string()}, out)
                         : run_ckpt_command({"inspect", input.string(), key}, out);
  }
  if (r.command == "consolidate") {
    if (dtrain_folder) return run_ckpt_folder_command({"consolidate", input.string(), r.output, max}, out);
    DTRAIN_CHECK(input == from_dcp.path, ConfigError,
                 r.input << " is neither a dtrain checkpoint folder nor a DCP folder (.metadata).",
                 "consolidate a checkpoint of sharded state; convert single files with `dtrain ckpt convert`");
    const std::string to = fs::path(r.output).extension() == ".pt" ? "torch" : "safetensors";
    return run_ckpt_command({"convert", to, input.string(), r.output, "model", max}, out);
  }
  if (r.to == "dcp") {  // DCP out: through a torch.save file of the full state
    TempFile full("full");
    if (dtrain_folder) {
      run_ckpt_folder_command({"convert", "torch", input.string(), full.path.string(), max}, out);
      run_converter("to-dcp", full.path, r.output, out);
    } else {
      run_converter("to-dcp", input, r.output, out);
    }
    return 0;
  }
  if (dtrain_folder) return run_ckpt_folder_command({"convert", r.to, input.string(), r.output, max}, out);
  DTRAIN_CHECK(r.to != "hf", ConfigError,
               "--to hf converts dtrain checkpoint folders (it maps names by the mapping the run recorded); "
                   << r.input << " is not one.",
               "convert a folder of a run that records its Hugging Face mapping (examples/gpt does)");
  if (input == from_dcp.path && r.to == "torch") {  // the whole state, as it came
    std::error_code ec;
    fs::copy_file(input, r.output, fs::copy_options::overwrite_existing, ec);
    DTRAIN_CHECK(!ec, ConfigError, "cannot write " << r.output << ": " << ec.message() << ".", "");
    out << "wrote " << r.output << " (the DCP checkpoint's whole state)\n";
    return 0;
  }
  return run_ckpt_command({"convert", r.to, input.string(), r.output, key, max}, out);
}

}  // namespace dtrain::tools
