// Reading a committed checkpoint outside a run: `dtrain ckpt`, converters to
// other formats. The folder is the Checkpointer's (checkpoint/checkpointer.h):
// state.json (step, world size), the MANIFEST (every file's size and CRC32),
// rank 0's replicated states, and each rank's rank_<R>/ part.
//
//   auto folder = dtrain::open_checkpoint("ckpt");       // newest complete step, verified
//   auto full = dtrain::read_zero_checkpoint(folder);    // ZeRO's shards, whole (parallel/zero/full_state.h)
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dtrain {

struct CheckpointFile {
  std::string path;  // relative to the step folder
  std::int64_t bytes = 0;
  std::uint32_t crc32 = 0;
};

struct CheckpointFolder {
  std::filesystem::path dir;  // .../step_<N>
  std::int64_t step = 0;
  int world_size = 1;                 // ranks that saved it
  std::vector<CheckpointFile> files;  // as the MANIFEST lists them, all verified
  std::string state_json;             // state.json as written (step, sampler, world size)
  // Names of the states with a part per rank (rank_0/<name>.pt), e.g. "zero", "rng".
  std::vector<std::string> per_rank_states() const;
};

// Empty when the step folder is complete and intact (MANIFEST present, every
// file it lists of the listed size and CRC32); else why not.
std::string checkpoint_problem(const std::filesystem::path& step_dir);

// `dir` is a checkpoint root (its newest complete step_<N> is taken) or one
// step_<N> folder. A folder that is neither, has no complete checkpoint, or
// fails its MANIFEST is a DataError saying which file fails and how.
CheckpointFolder open_checkpoint(const std::filesystem::path& dir);

// The part of rank `rank` of the sharded state `name` (rank_<R>/<name>.pt);
// what a part holds is its owner's format (ZeRO's: parallel/zero/full_state.h,
// read_zero_checkpoint).
std::filesystem::path sharded_part(const CheckpointFolder& folder, const std::string& name, int rank);

}  // namespace dtrain
