// Private to parallel/zero/: the format of a ZeRO checkpoint part
// (DIR/step_<N>/rank_<R>/zero.pt), shared by the resharding load
// (sharded_checkpoint.cpp) and the full-state conversions (full_state.cpp).
//
// A part (a torch::serialize archive) holds, for every unit u:
//   u<u>.param                 this rank's chunk, fp32, [shard] elements (padded)
//   u<u>.<key>                 the optimizer state laid out like the chunk (exp_avg, momentum_buffer, ...)
//   u<u>.step                  the unit's optimizer step, [1] int64
// and the layout: layout.kind (optimizer kind), layout.names (unit names, one
// a line), layout.numel / layout.shard (per unit), layout.shard_rank /
// shard_world / replica, layout.params (since issue 26: one line per
// parameter, "<unit>\t<name>\t<offset in unit>\t<trainable 0|1>\t<d0>,<d1>,...")
// and optimizer.options (since issue 26: the one param group's options in
// LibTorch's own serialization; absent with several groups).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::detail {

struct SavedParam {
  std::size_t unit = 0;
  std::string name;
  std::int64_t offset = 0;  // in the unit's flat buffer
  std::vector<std::int64_t> shape;
  bool trainable = false;
};

// How the units were cut when a part was saved: enough to reshard.
struct SavedLayout {
  std::string kind;  // optimizer kind
  std::vector<std::string> names;
  std::vector<std::int64_t> numel;
  std::vector<std::int64_t> shard;
  int shard_rank = -1, shard_world = -1, replica = 0;  // -1: not recorded
  std::vector<SavedParam> params;                      // empty: not recorded (before issue 26)
};

SavedLayout read_layout(torch::serialize::InputArchive& archive);
// The per-element optimizer state keys of an optimizer kind.
std::vector<std::string> state_keys(const std::string& kind);
std::string kind_of(const torch::optim::Optimizer& optimizer);
std::string unit_key(std::size_t u, const std::string& what);
std::unique_ptr<torch::optim::OptimizerParamState> make_state(const std::string& kind,
                                                              const std::map<std::string, at::Tensor>& values,
                                                              std::int64_t step);
// Options of the optimizer's one param group (LibTorch's serialization), or
// null when the part has none; a kind without options (other) gives null too.
std::shared_ptr<torch::optim::OptimizerOptions> read_options(torch::serialize::InputArchive& archive,
                                                             const std::string& kind);

}  // namespace dtrain::detail
