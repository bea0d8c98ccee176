// `dtrain ckpt` on dtrain's own checkpoint folders (the Checkpointer's:
// step_<N>/ with a MANIFEST), the part that needs LibTorch; the CLI calls this
// entry point in libdtrain through dlopen when the path is such a folder
// (files of other formats go to src/checkpoint/ckpt_command.cpp).
//
//   inspect DIR                   step, ranks, MANIFEST and CRC check, the plan
//                                 (ZeRO units and their cut), every tensor with
//                                 its layout and size, the optimizer state
//   convert --to torch DIR F.pt   the full training state in Python's structure
//                                 (get_state_dict's: {"model", "optim"}), for
//                                 torch.load and python/dtrain_dcp.py to-dcp
//   convert --to hf DIR OUT       a Hugging Face model folder (config.json and
//                                 safetensors) by the name mapping the run
//                                 recorded (checkpoint/hf_mapping.h)
//   convert --to safetensors DIR OUT, consolidate DIR OUT
//                                 the full model's parameters (OUT: a .safetensors
//                                 or .pt file, or a sharded safetensors folder)
// DIR: a checkpoint folder (its newest complete step) or one step_<N> folder.
#include <torch/serialize/archive.h>

#include <algorithm>
#include <filesystem>
#include <iomanip>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/checkpoint/checkpoint_reader.h"
#include "dtrain/checkpoint/hf_mapping.h"
#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/checkpoint/torch_file.h"
#include "dtrain/error.h"
#include "dtrain/parallel/zero/full_state.h"
#include "dtrain/trainer/resharding.h"

namespace fs = std::filesystem;
namespace ck = dtrain::checkpoint;

namespace {

struct FolderContents {
  dtrain::CheckpointFolder folder;
  std::optional<dtrain::ZeroFullState> zero;  // a ZeRO run's shards, whole
  ck::NamedTensors model;                     // the parameters (and buffers of a replicated model.pt)
  bool laid_out = false;                      // a laid-out model state (trainer/resharding.h)
};

// Parameters and buffers of a replicated model (DIR/step_N/model.pt,
// Checkpointer::save(state, model, optimizer)): "parameter/<name>", "buffer/<name>".
ck::NamedTensors read_replicated_model(const fs::path& file) {
  torch::serialize::InputArchive archive;
  archive.load_from(file.string());
  ck::NamedTensors out;
  for (const std::string& key : archive.keys()) {
    for (const std::string prefix : {"parameter/", "buffer/"}) {
      if (key.rfind(prefix, 0) != 0) continue;
      at::Tensor t;
      archive.read(key, t, prefix == "buffer/");
      out.emplace_back(key.substr(prefix.size()), t);
    }
  }
  return out;
}

FolderContents read_folder(const fs::path& path) {
  FolderContents c{.folder = dtrain::open_checkpoint(path)};
  const auto states = c.folder.per_rank_states();
  if (std::find(states.begin(), states.end(), "zero") != states.end()) {
    c.zero = dtrain::read_zero_checkpoint(c.folder, "zero");
    c.model = c.zero->parameters;
  } else if (std::find(states.begin(), states.end(), dtrain::kLaidOutState) != states.end()) {
    // Any laid-out plan's (single, DDP, pipelines): the parameters, whole.
    std::vector<std::unique_ptr<torch::serialize::InputArchive>> parts(static_cast<std::size_t>(c.folder.world_size));
    auto part = [&](int r) -> torch::serialize::InputArchive& {
      auto& slot = parts[static_cast<std::size_t>(r)];
      if (!slot) {
        slot = std::make_unique<torch::serialize::InputArchive>();
        slot->load_from(dtrain::sharded_part(c.folder, dtrain::kLaidOutState, r).string());
      }
      return *slot;
    };
    c.laid_out = true;
    for (auto& [name, t] : dtrain::consolidate_laid_out(part, c.folder.world_size))
      if (name.rfind("model.", 0) == 0) c.model.emplace_back(name.substr(6), t);
  } else if (fs::exists(c.folder.dir / "model.pt")) {
    c.model = read_replicated_model(c.folder.dir / "model.pt");
  } else {
    DTRAIN_CHECK(false, DataError,
                 "checkpoint " << c.folder.dir.string() << " holds neither ZeRO shards (rank_<R>/zero.pt), a laid-out "
                               << "model (rank_<R>/laid_out.pt) nor a model.pt; its states are per-rank (e.g. "
                               << "sharded pipeline stages).",
                 "convert checkpoints of ZeRO runs and of laid-out plans (single process, DDP, pipelines)");
  }
  return c;
}

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

void inspect(const fs::path& path, std::ostream& out) {
  const FolderContents c = read_folder(path);
  std::int64_t bytes = 0;
  for (const auto& f : c.folder.files) bytes += f.bytes;
  out << c.folder.dir.string() << ": dtrain checkpoint, step " << c.folder.step << ", saved by " << c.folder.world_size
      << " ranks\n";
  out << "  MANIFEST: " << c.folder.files.size() << " files, " << bytes << " bytes, every size and CRC32 checked: ok\n";
  out << "  state.json: " << c.folder.state_json << "\n";
  std::string per_rank;
  for (const auto& s : c.folder.per_rank_states()) per_rank += (per_rank.empty() ? "" : ", ") + s;
  out << "  per-rank states: " << per_rank << "\n";
  if (c.zero) {
    const auto& z = *c.zero;
    const int shards = z.placements.empty() ? 0 : z.placements.front().shards;
    out << "  plan: ZeRO (sharded data parallel), " << shards << " shards; every unit flattened and cut in " << shards
        << " equal chunks (Shard(0) of the flat unit), optimizer " << z.optimizer_kind << "\n";
  } else if (c.laid_out) {
    out << "  plan: laid out (rank_<R>/laid_out.pt: each tensor's boxes under its global name, optimizer state "
           "alongside), whole below\n";
  } else {
    out << "  plan: replicated model (model.pt, rank 0's), optimizer in optimizer.pt (LibTorch's format)\n";
  }
  std::int64_t total = 0;
  out << "  tensors:\n";
  for (std::size_t i = 0; i < c.model.size(); ++i) {
    const auto& [name, t] = c.model[i];
    std::string layout = "Replicate";
    if (c.zero) {
      const auto& p = c.zero->placements.at(i);
      const std::int64_t first = p.offset / p.shard, last = (p.offset + t.numel() - 1) / p.shard;
      std::ostringstream l;
      l << "unit " << p.unit << " [" << p.offset << ", " << p.offset + t.numel() << ") of " << p.unit_numel << ", "
        << p.shards << " x " << p.shard << ": ranks " << first << "-" << last
        << (c.zero->trainable.at(i) ? "" : ", frozen");
      layout = l.str();
    }
    out << "    " << std::left << std::setw(32) << name << " " << std::setw(6) << t.scalar_type() << " "
        << std::setw(12) << shape_of(t) << " " << std::setw(10) << t.nbytes() << " " << layout << "\n";
    total += static_cast<std::int64_t>(t.nbytes());
  }
  out << "  parameters: " << c.model.size() << " tensors, " << total << " bytes\n";
  if (c.zero && !c.zero->optimizer_state.empty()) {
    const auto& [name, first] = *c.zero->optimizer_state.begin();
    std::string keys;
    for (const auto& [k, t] : first.state) keys += (keys.empty() ? "" : ", ") + k;
    out << "  optimizer state: " << c.zero->optimizer_state.size() << " parameters (" << keys << "), step "
        << first.step << "\n";
  }
}

}  // namespace

// args, checked by the CLI: {"inspect", DIR}, {"convert", FORMAT, DIR, OUT,
// MAX_SHARD_BYTES} or {"consolidate", DIR, OUT, MAX_SHARD_BYTES}. Prints to
// `out`; errors are thrown (dtrain::Error).
extern "C" __attribute__((visibility("default"))) int dtrain_ckpt_folder_command(const std::vector<std::string>* args,
                                                                                 std::ostream* out) {
  const auto& a = *args;
  if (a.at(0) == "inspect") {
    inspect(a.at(1), *out);
    return 0;
  }
  const bool consolidate = a.at(0) == "consolidate";
  const std::string to = consolidate ? "model" : a.at(1);
  const fs::path in = a.at(consolidate ? 1 : 2), out_path = a.at(consolidate ? 2 : 3);
  const std::int64_t max_shard_bytes = std::stoll(a.at(consolidate ? 3 : 4));
  const FolderContents c = read_folder(in);
  const std::map<std::string, std::string> metadata = {{"step", std::to_string(c.folder.step)}};
  if (to == "torch") {
    DTRAIN_CHECK(c.zero, ConfigError,
                 "--to torch writes a ZeRO checkpoint's full training state; this one is a "
                 "replicated model.",
                 "use `dtrain ckpt consolidate DIR model.pt` for its parameters");
    ck::save_torch_file(out_path, dtrain::to_fsdp_state_dict(*c.zero));
  } else if (to == "hf") {
    const auto mapping = ck::read_hf_mapping(c.folder);
    DTRAIN_CHECK(mapping, ConfigError,
                 "checkpoint " << c.folder.dir.string() << " records no Hugging Face mapping (" << ck::kHfMappingState
                               << ".pt): only the model knows Hugging Face's names.",
                 "save it from a run that adds checkpoint::hf_mapping_state (examples/gpt does), or convert "
                 "--to safetensors for dtrain's names");
    ck::save_hf_folder(out_path, *mapping, c.model,
                       {.max_shard_bytes = max_shard_bytes, .metadata = {{"format", "pt"}}});
  } else if (out_path.extension() == ".pt") {
    ck::save_torch_state_dict(out_path, c.model);
  } else if (out_path.extension() == ".safetensors") {
    ck::save_safetensors(out_path, c.model, {.metadata = metadata});
  } else {
    ck::save_safetensors_sharded(out_path, c.model, {.max_shard_bytes = max_shard_bytes, .metadata = metadata});
  }
  *out << "wrote " << out_path.string() << ": " << c.model.size() << " parameters"
       << (to == "torch" ? " and the optimizer state"
           : to == "hf"  ? " as a Hugging Face model"
                         : "")
       << " of step " << c.folder.step << " from " << c.folder.dir.string() << " (" << c.folder.world_size
       << " ranks)\n";
  return 0;
}
