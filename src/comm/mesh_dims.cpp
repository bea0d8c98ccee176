// The mesh's dimension names (mesh_dims.h); in dtrain_base, so code without
// LibTorch (the CLI, the planner) shares them with DeviceMesh.
#include "dtrain/comm/mesh_dims.h"

namespace dtrain::dist {

const std::vector<std::string>& mesh_dim_names() {
  static const std::vector<std::string> names{"pp", "dp_replicate", "dp_shard", "cp", "tp"};
  return names;
}

}  // namespace dtrain::dist
