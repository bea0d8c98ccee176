// A named N-D device mesh: a group's ranks laid out over up to five named
// dimensions, with a process group along each dimension and along chosen
// joins of them, made once and shared by every parallelism applied on it.
//
//   dtrain::dist::DeviceMesh mesh(world, {{"pp", 2}, {"dp_shard", 2}});
//   Pipeline pipe(stages, mesh["pp"], {.data_parallel_group = mesh.join({"dp_replicate", "dp_shard"}), ...});
//
// Dimensions, outermost first (torchtitan's order): pp, dp_replicate,
// dp_shard, cp, tp. A mesh has any subset of them, listed in that order;
// a dimension it lacks has size 1 and coordinate 0. Ranks are laid out
// row-major, the last dimension fastest: the ranks of one tensor-parallel
// group are consecutive (on one host when a host holds them, where the
// per-layer traffic is heaviest), pipeline stages the furthest apart.
//
// Note [Mesh groups]
// Every group is made in the constructor, collectively over the parent group,
// in one order every rank computes alike (each dimension in mesh order, then
// each join in the order given; within one, the groups by the row-major
// index of the coordinates they do not span), so creation cannot deadlock and
// no group is made lazily by some ranks only. A join of one present dimension
// is that dimension's group; a join of none is a group of this rank alone.
// A group's ranks are numbered row-major over the dimensions it spans, so the
// data-parallel rank of mesh.join({"dp_replicate","dp_shard"}) is
// coordinate(dp_replicate) * size(dp_shard) + coordinate(dp_shard).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/comm/mesh_dims.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::dist {

struct MeshOptions {
  // Joined dimensions to make groups for, besides each dimension's own
  // (names the mesh lacks are left out). The defaults are what the
  // data-parallel appliers reduce over: the data-parallel rank, the
  // sharding group, and gradients of parameters replicated over cp.
  std::vector<std::vector<std::string>> joins = {
      {"dp_replicate", "dp_shard"}, {"dp_shard", "cp"}, {"dp_replicate", "dp_shard", "cp"}};
};

class DeviceMesh {
 public:
  // Collective over `group` (every rank with the same dims and options).
  // ConfigError for an unknown, repeated or out-of-order name, a size below 1,
  // or sizes whose product is not group.size().
  DeviceMesh(ProcessGroup group, std::vector<MeshDim> dims, MeshOptions options = {});

  const std::vector<MeshDim>& dims() const { return dims_; }
  bool has(std::string_view name) const;
  // 1 for a dimension the mesh lacks.
  int size(std::string_view name) const;
  // This rank's index along `name` (0 for a dimension the mesh lacks).
  int coordinate(std::string_view name) const;
  // One index per dimension of dims().
  const std::vector<int>& coordinates() const { return coordinates_; }
  // The group rank at `coordinates` (one per dimension of dims()).
  int rank_at(const std::vector<int>& coordinates) const;

  ProcessGroup& group() { return group_; }
  // The ranks that differ from this one along `name` only. ConfigError for a
  // dimension the mesh lacks.
  ProcessGroup& operator[](std::string_view name);
  // The ranks that differ from this one along the named dimensions only;
  // the join must be one made at construction (MeshOptions::joins), else
  // ConfigError.
  ProcessGroup& join(const std::vector<std::string>& names);
  // "2 (pp) x 2 (dp_shard)".
  std::string describe() const;

 private:
  // The present dimensions of `names` as a bit set over dims_ (validated).
  unsigned span_of(const std::vector<std::string>& names, const char* what) const;
  void make_groups(unsigned span);
  std::optional<std::size_t> index_of(std::string_view name) const;

  ProcessGroup group_;
  std::vector<MeshDim> dims_;
  std::vector<int> coordinates_;
  std::map<unsigned, ProcessGroup> groups_;  // by span (0: this rank alone)
};

}  // namespace dtrain::dist
