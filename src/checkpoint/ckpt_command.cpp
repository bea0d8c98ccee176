// `dtrain ckpt` (issue 26), the part that needs LibTorch: the CLI parses the
// arguments and calls this entry point in libdtrain through dlopen
// (tools/dtrain/libdtrain_loader.cpp), so `dtrain run` still starts without
// loading LibTorch.
//
//   inspect PATH                   format, tensors (dtype, shape, bytes), metadata
//   convert --to FORMAT IN OUT     safetensors <-> torch (a state dict)
// PATH/IN: a .safetensors file, a folder of them with an index (or one
// model.safetensors), or a torch.save file of a state dict (with --key K: the
// state dict under K of the top-level dict, e.g. "model"). OUT for
// safetensors: a file ending in .safetensors, else a folder written in HF's
// sharded layout (--max-shard-bytes).
#include <filesystem>
#include <iomanip>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/checkpoint/torch_file.h"
#include "dtrain/error.h"

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;

namespace {

struct Loaded {
  std::string format;
  ck::NamedTensors tensors;
  std::map<std::string, std::string> metadata;
};

Loaded load_any(const fs::path& path, const std::string& key) {
  DTRAIN_CHECK(fs::exists(path), ConfigError, path.string() << " does not exist.", "give a checkpoint file or folder");
  if (fs::is_directory(path)) {
    auto c = ck::load_safetensors_dir(path);
    return {"safetensors folder", std::move(c.tensors), std::move(c.metadata)};
  }
  if (path.extension() == ".safetensors") {
    auto c = ck::load_safetensors(path);
    return {"safetensors", std::move(c.tensors), std::move(c.metadata)};
  }
  return {"torch.save (zip + pickle)", ck::load_torch_state_dict(path, key), {}};
}

}  // namespace

// args: the words after `dtrain ckpt`, already checked by the CLI:
//   {"inspect", PATH, KEY} or {"convert", FORMAT, IN, OUT, KEY, MAX_SHARD_BYTES}.
// Prints to `out`; errors are thrown (dtrain::Error).
extern "C" __attribute__((visibility("default"))) int dtrain_ckpt_command(const std::vector<std::string>* args,
                                                                          std::ostream* out) {
  const auto& a = *args;
  if (a.at(0) == "inspect") {
    const auto loaded = load_any(a.at(1), a.at(2));
    std::int64_t total = 0;
    *out << a.at(1) << ": " << loaded.format << ", " << loaded.tensors.size() << " tensors\n";
    for (const auto& [name, t] : loaded.tensors) {
      std::ostringstream shape;
      shape << t.sizes();
      *out << "  " << std::left << std::setw(48) << name << " " << std::setw(14) << t.scalar_type() << " "
           << std::setw(18) << shape.str() << " " << t.nbytes() << " bytes\n";
      total += static_cast<std::int64_t>(t.nbytes());
    }
    for (const auto& [k, v] : loaded.metadata) *out << "  metadata " << k << " = " << v << "\n";
    *out << "  total " << total << " bytes\n";
    return 0;
  }
  const std::string& to = a.at(1);
  const fs::path in = a.at(2), out_path = a.at(3);
  const auto loaded = load_any(in, a.at(4));
  if (to == "torch") {
    ck::save_torch_state_dict(out_path, loaded.tensors);
  } else if (out_path.extension() == ".safetensors") {
    ck::save_safetensors(out_path, loaded.tensors, {.metadata = loaded.metadata});
  } else {
    ck::save_safetensors_sharded(out_path, loaded.tensors,
                                 {.max_shard_bytes = std::stoll(a.at(5)), .metadata = loaded.metadata});
  }
  *out << "wrote " << loaded.tensors.size() << " tensors from " << in.string() << " (" << loaded.format << ") to "
       << out_path.string() << " (" << to << ")\n";
  return 0;
}
