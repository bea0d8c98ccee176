// How one tensor (a parameter, its gradient, its optimizer state) is spread
// over a DeviceMesh: one placement per mesh dimension, and the global shape.
//
//   Layout w{.mesh = {{"dp_shard", 2}, {"tp", 2}},
//            .placements = {Placement::shard(0), Placement::shard(1)},
//            .global_shape = {384, 128}};
//   Box mine = w.local_box({1, 0});   // rows 192..383, columns 0..63
//
// Placements, as DTensor's:
//  - Replicate: every rank along the dimension holds the same values;
//  - Shard(d): the ranks split tensor dimension d in order (torch.chunk's
//    rule: pieces of ceil(n / ranks), the last ones shorter or empty);
//  - Partial: every rank holds a summand; the tensor is their sum (an
//    unreduced gradient, a row-parallel layer's output before its all-reduce).
// Several mesh dimensions sharding one tensor dimension nest, outer mesh
// dimension first: dp_shard 2 x tp 2 both on dim 0 gives rank (i, j) the
// j-th half of the i-th half.
//
// Everything here is index arithmetic, no communication: resharding
// (checkpoints loaded under another plan) copies the intersection of the
// saved boxes with the boxes a rank needs (copy_intersection).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/mesh.h"

namespace dtrain::dist {

struct Placement {
  enum class Kind { kReplicate, kShard, kPartial };
  Kind kind = Kind::kReplicate;
  int dim = 0;  // the tensor dimension, for kShard

  static Placement replicate() { return {}; }
  static Placement shard(int dim) { return {.kind = Kind::kShard, .dim = dim}; }
  static Placement partial() { return {.kind = Kind::kPartial}; }
  bool operator==(const Placement&) const = default;
  // "R", "S(0)", "P".
  std::string to_string() const;
};

// A box of a tensor: per dimension an offset and a size (size 0: empty).
struct Box {
  std::vector<std::int64_t> offsets, sizes;
  bool empty() const;
  std::int64_t numel() const;
  bool operator==(const Box&) const = default;
};

struct Layout {
  std::vector<MeshDim> mesh;          // the mesh's dimensions, in its order
  std::vector<Placement> placements;  // one per mesh dimension
  std::vector<std::int64_t> global_shape;

  // A layout replicated over every dimension of `mesh`.
  static Layout replicated(const DeviceMesh& mesh, std::vector<std::int64_t> global_shape);
  // ConfigError unless there is one placement per mesh dimension, every
  // shard dimension is one of the tensor's, and sizes are positive.
  void validate() const;
  // The part of the global tensor held at mesh `coordinates`.
  Box local_box(const std::vector<int>& coordinates) const;
  std::vector<std::int64_t> local_shape(const std::vector<int>& coordinates) const {
    return local_box(coordinates).sizes;
  }
  // Whether the tensor is a sum over some mesh dimension (not yet reduced).
  bool has_partial() const;
  // "[384, 128] on 2 (dp_shard) x 2 (tp): S(0), S(1)".
  std::string to_string() const;
  // The placement on mesh dimension `dim` (Replicate where the mesh has no
  // such dimension) of a tensor replicated on every other one; an internal
  // error naming `what` (e.g. "a ZeRO parameter wte.weight") otherwise.
  Placement sole_placement_on(const std::string& dim, const std::string& what) const;
};

// The overlap of two boxes of one tensor (nullopt when they do not meet).
std::optional<Box> intersect(const Box& a, const Box& b);

// Copies the part of `source` (holding `source_box` of the global tensor)
// that overlaps `target_box` into `target` (holding `target_box`); returns
// the number of elements copied. Tensors are laid out as their boxes.
std::int64_t copy_intersection(const at::Tensor& source, const Box& source_box, at::Tensor& target,
                               const Box& target_box);

}  // namespace dtrain::dist
