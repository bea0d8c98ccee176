// The names and sizes of a DeviceMesh's dimensions, without the mesh itself:
// plans, layouts and the planner describe meshes with these and need no
// process group (nor LibTorch's headers).
#pragma once

#include <string>
#include <vector>

namespace dtrain::dist {

// The dimension names a mesh may have, outermost first (torchtitan's order).
const std::vector<std::string>& mesh_dim_names();

struct MeshDim {
  std::string name;
  int size = 1;
  bool operator==(const MeshDim&) const = default;
};

}  // namespace dtrain::dist
