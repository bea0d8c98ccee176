// A 2-D mesh of a group's ranks, data x pipeline, and the subgroups along
// each axis, made once and shared by the strategies that combine them.
//
//   dtrain::dist::DeviceMesh mesh(world, {.data = 2, .pipeline = 2});
//   Pipeline pipe(stages, mesh.pipeline_group(), {.data_parallel_group = mesh.data_group(), ...});
//
// Rank r sits at (data index r / pipeline, pipeline index r % pipeline): the
// ranks of one pipeline are consecutive (on one host when a host holds a
// pipeline, where stage-to-stage traffic is heaviest), and the ranks holding
// the same stage in each replica form a data-parallel group.
#pragma once

#include <optional>
#include <string>

#include "dtrain/comm/process_group.h"

namespace dtrain::dist {

struct MeshShape {
  int data = 1;      // pipeline replicas
  int pipeline = 1;  // stages' ranks per replica
};

class DeviceMesh {
 public:
  // Collective over `group`: creates every subgroup (every rank must call it
  // with the same shape). ConfigError unless data * pipeline == group.size().
  DeviceMesh(ProcessGroup group, MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  int data_index() const { return group_.rank() / shape_.pipeline; }
  int pipeline_index() const { return group_.rank() % shape_.pipeline; }
  // The group's rank at mesh coordinates (data, pipeline).
  int rank_at(int data, int pipeline) const { return data * shape_.pipeline + pipeline; }

  ProcessGroup& group() { return group_; }
  // This rank's pipeline (its replica's ranks, in stage order).
  ProcessGroup& pipeline_group() { return *pipeline_group_; }
  // The ranks at this rank's pipeline index in every replica.
  ProcessGroup& data_group() { return *data_group_; }
  // "2 (data) x 2 (pipeline)".
  std::string describe() const;

 private:
  ProcessGroup group_;
  MeshShape shape_;
  std::optional<ProcessGroup> pipeline_group_, data_group_;
};

}  // namespace dtrain::dist
