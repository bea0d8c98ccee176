// DeviceMesh: the data and pipeline subgroups of a 2-D mesh (see mesh.h).
#include "dtrain/comm/mesh.h"

#include <vector>

#include "dtrain/error.h"

namespace dtrain::dist {

DeviceMesh::DeviceMesh(ProcessGroup group, MeshShape shape) : group_(std::move(group)), shape_(shape) {
  DTRAIN_CHECK(
      shape.data >= 1 && shape.pipeline >= 1 && shape.data * shape.pipeline == group_.size(), ConfigError,
      "a " << describe() << " mesh needs " << shape.data * shape.pipeline << " ranks, the group has " << group_.size(),
      "choose data x pipeline equal to the world size");
  // Every rank creates every subgroup, in the same order (new_group is
  // collective over the parent) and keeps its own.
  for (int d = 0; d < shape.data; ++d) {
    std::vector<int> ranks;
    ranks.reserve(shape.pipeline);
    for (int p = 0; p < shape.pipeline; ++p) ranks.push_back(rank_at(d, p));
    auto made = group_.new_group(ranks);
    if (made) pipeline_group_ = std::move(made);
  }
  for (int p = 0; p < shape.pipeline; ++p) {
    std::vector<int> ranks;
    ranks.reserve(shape.data);
    for (int d = 0; d < shape.data; ++d) ranks.push_back(rank_at(d, p));
    auto made = group_.new_group(ranks);
    if (made) data_group_ = std::move(made);
  }
  DTRAIN_INTERNAL_ASSERT(pipeline_group_ && data_group_, "mesh rank " << group_.rank() << " is in no subgroup");
}

std::string DeviceMesh::describe() const {
  return std::to_string(shape_.data) + " (data) x " + std::to_string(shape_.pipeline) + " (pipeline)";
}

}  // namespace dtrain::dist
