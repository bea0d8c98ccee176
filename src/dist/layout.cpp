// Layout arithmetic: local boxes, intersections, copies (see layout.h).
#include "dtrain/dist/layout.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

#include "dtrain/error.h"

namespace dtrain::dist {

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::kReplicate: return "R";
    case Kind::kShard: return "S(" + std::to_string(dim) + ")";
    case Kind::kPartial: return "P";
  }
  return "?";
}

bool Box::empty() const {
  return std::any_of(sizes.begin(), sizes.end(), [](std::int64_t s) { return s <= 0; });
}

std::int64_t Box::numel() const {
  std::int64_t n = 1;
  for (auto s : sizes) n *= std::max<std::int64_t>(s, 0);
  return n;
}

Layout Layout::replicated(const DeviceMesh& mesh, std::vector<std::int64_t> global_shape) {
  return {.mesh = mesh.dims(),
          .placements = std::vector<Placement>(mesh.dims().size(), Placement::replicate()),
          .global_shape = std::move(global_shape)};
}

void Layout::validate() const {
  DTRAIN_CHECK(placements.size() == mesh.size(), ConfigError,
               "a layout has " << placements.size() << " placements for a mesh of " << mesh.size() << " dimensions.",
               "give one placement per mesh dimension (Replicate where the tensor is not split)");
  for (std::size_t d = 0; d < mesh.size(); ++d) {
    DTRAIN_CHECK(mesh[d].size >= 1, ConfigError, "mesh dimension " << mesh[d].name << " has size " << mesh[d].size,
                 "sizes are at least 1");
    const Placement& p = placements[d];
    DTRAIN_CHECK(p.kind != Placement::Kind::kShard || (p.dim >= 0 && p.dim < static_cast<int>(global_shape.size())),
                 ConfigError,
                 "a layout shards tensor dimension " << p.dim << " over " << mesh[d].name << ", but the tensor has "
                                                     << global_shape.size() << " dimensions.",
                 "shard a dimension in 0.." << static_cast<int>(global_shape.size()) - 1);
  }
  for (auto s : global_shape)
    DTRAIN_CHECK(s >= 0, ConfigError, "a layout's global shape has size " << s, "sizes are at least 0");
}

Box Layout::local_box(const std::vector<int>& coordinates) const {
  validate();
  DTRAIN_CHECK(coordinates.size() == mesh.size(), ConfigError,
               "local_box got " << coordinates.size() << " coordinates for a mesh of " << mesh.size() << " dimensions.",
               "give one coordinate per mesh dimension");
  Box box{.offsets = std::vector<std::int64_t>(global_shape.size(), 0), .sizes = global_shape};
  for (std::size_t d = 0; d < mesh.size(); ++d) {
    if (placements[d].kind != Placement::Kind::kShard) continue;
    const auto t = static_cast<std::size_t>(placements[d].dim);
    const std::int64_t parts = mesh[d].size, n = box.sizes[t];
    const std::int64_t chunk = (n + parts - 1) / parts;  // torch.chunk's piece
    const std::int64_t begin = std::min(n, chunk * coordinates[d]);
    const std::int64_t end = std::min(n, begin + chunk);
    box.offsets[t] += begin;
    box.sizes[t] = end - begin;
  }
  return box;
}

bool Layout::has_partial() const {
  return std::any_of(placements.begin(), placements.end(),
                     [](const Placement& p) { return p.kind == Placement::Kind::kPartial; });
}

Placement Layout::sole_placement_on(const std::string& dim, const std::string& what) const {
  Placement on = Placement::replicate();
  for (std::size_t d = 0; d < mesh.size(); ++d) {
    if (mesh[d].name == dim) {
      on = placements[d];
    } else {
      DTRAIN_INTERNAL_ASSERT(placements[d].kind == Placement::Kind::kReplicate,
                             what << " is laid out " << to_string() << ", split beyond " << dim);
    }
  }
  return on;
}

std::string Layout::to_string() const {
  std::ostringstream s;
  s << "[";
  for (std::size_t i = 0; i < global_shape.size(); ++i) s << (i ? ", " : "") << global_shape[i];
  s << "] on ";
  for (std::size_t d = 0; d < mesh.size(); ++d) s << (d ? " x " : "") << mesh[d].size << " (" << mesh[d].name << ")";
  if (mesh.empty()) s << "no mesh";
  s << ":";
  for (std::size_t d = 0; d < placements.size(); ++d) s << (d ? ", " : " ") << placements[d].to_string();
  return s.str();
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  DTRAIN_CHECK(a.offsets.size() == b.offsets.size(), ConfigError,
               "boxes of " << a.offsets.size() << " and " << b.offsets.size() << " dimensions cannot intersect",
               "intersect boxes of one tensor");
  Box out{.offsets = std::vector<std::int64_t>(a.offsets.size()), .sizes = std::vector<std::int64_t>(a.sizes.size())};
  for (std::size_t i = 0; i < a.offsets.size(); ++i) {
    const std::int64_t begin = std::max(a.offsets[i], b.offsets[i]);
    const std::int64_t end = std::min(a.offsets[i] + a.sizes[i], b.offsets[i] + b.sizes[i]);
    if (end <= begin) return std::nullopt;
    out.offsets[i] = begin;
    out.sizes[i] = end - begin;
  }
  return out;
}

namespace {
// The view of `t` (holding `box`) on `part`, a sub-box of it.
at::Tensor view_of(const at::Tensor& t, const Box& box, const Box& part) {
  at::Tensor v = t;
  for (std::size_t i = 0; i < part.offsets.size(); ++i)
    v = v.narrow(static_cast<std::int64_t>(i), part.offsets[i] - box.offsets[i], part.sizes[i]);
  return v;
}
}  // namespace

std::int64_t copy_intersection(const at::Tensor& source, const Box& source_box, at::Tensor& target,
                               const Box& target_box) {
  DTRAIN_CHECK(source.sizes().vec() == source_box.sizes && target.sizes().vec() == target_box.sizes, ConfigError,
               "copy_intersection got tensors of shapes " << source.sizes() << " and " << target.sizes()
                                                          << " that are not their boxes' shapes",
               "pass each tensor with the box it holds");
  const auto overlap = intersect(source_box, target_box);
  if (!overlap) return 0;
  view_of(target, target_box, *overlap).copy_(view_of(source, source_box, *overlap));
  return overlap->numel();
}

}  // namespace dtrain::dist
