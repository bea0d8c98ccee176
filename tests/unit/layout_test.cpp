// Layout arithmetic against references: local boxes against torch.chunk's
// pieces (DTensor's rule), nested shards, and resharding a tensor between two
// unrelated layouts by copying box intersections, which must rebuild every
// target piece exactly from the source pieces.
#include "dtrain/dist/layout.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "dtrain/error.h"

using dtrain::dist::Box;
using dtrain::dist::Layout;
using dtrain::dist::MeshDim;
using dtrain::dist::Placement;

namespace {

// Every coordinate vector of `mesh`, row-major.
std::vector<std::vector<int>> all_coordinates(const std::vector<MeshDim>& mesh) {
  std::vector<std::vector<int>> out{{}};
  for (const auto& d : mesh) {
    std::vector<std::vector<int>> next;
    for (const auto& c : out)
      for (int i = 0; i < d.size; ++i) {
        auto e = c;
        e.push_back(i);
        next.push_back(e);
      }
    out = next;
  }
  return out;
}

at::Tensor slice_of(const at::Tensor& global, const Box& box) {
  at::Tensor v = global;
  for (std::size_t i = 0; i < box.offsets.size(); ++i)
    v = v.narrow(static_cast<std::int64_t>(i), box.offsets[i], box.sizes[i]);
  return v;
}

}  // namespace

TEST(Layout, ShardBoxesAreTorchChunksPieces) {
  for (std::int64_t n : {0, 1, 5, 10, 11, 64}) {
    for (int parts : {1, 2, 3, 4, 7}) {
      const Layout l{.mesh = {{"dp_shard", parts}}, .placements = {Placement::shard(0)}, .global_shape = {n, 3}};
      const at::Tensor global = at::arange(n * 3, at::kFloat).reshape({n, 3});
      const auto pieces = n > 0 ? global.chunk(parts, 0) : std::vector<at::Tensor>{};
      std::int64_t covered = 0;
      for (int k = 0; k < parts; ++k) {
        const Box b = l.local_box({k});
        const std::string at = "n " + std::to_string(n) + " parts " + std::to_string(parts) + " k " + std::to_string(k);
        EXPECT_EQ(b.sizes[1], 3) << at;
        if (k < static_cast<int>(pieces.size())) {
          EXPECT_TRUE(slice_of(global, b).equal(pieces[static_cast<std::size_t>(k)])) << at;
        } else {
          EXPECT_TRUE(b.empty()) << at;
        }
        covered += b.sizes[0];
      }
      EXPECT_EQ(covered, n);
    }
  }
}

TEST(Layout, ReplicateAndPartialHoldTheWholeShape) {
  const Layout l{.mesh = {{"dp_replicate", 2}, {"tp", 2}},
                 .placements = {Placement::replicate(), Placement::partial()},
                 .global_shape = {6, 4}};
  EXPECT_TRUE(l.has_partial());
  for (const auto& c : all_coordinates(l.mesh)) EXPECT_EQ(l.local_box(c), (Box{{0, 0}, {6, 4}}));
  EXPECT_EQ(l.to_string(), "[6, 4] on 2 (dp_replicate) x 2 (tp): R, P");
}

// Two mesh dimensions on one tensor dimension nest, outer first.
TEST(Layout, NestedShardsSplitTheOuterPiece) {
  const Layout l{.mesh = {{"dp_shard", 2}, {"tp", 2}},
                 .placements = {Placement::shard(0), Placement::shard(0)},
                 .global_shape = {8, 2}};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) EXPECT_EQ(l.local_box({i, j}), (Box{{i * 4 + j * 2, 0}, {2, 2}}));
}

// A [7, 5] tensor saved under dp_shard 2 x tp 3 (rows, then columns) and
// loaded under dp_shard 3 on columns, and under one process: every target
// piece is rebuilt exactly, each element once.
TEST(Layout, ReshardingByIntersectionsRebuildsEveryPiece) {
  const at::Tensor global = at::randn({7, 5});
  const Layout saved{.mesh = {{"dp_shard", 2}, {"tp", 3}},
                     .placements = {Placement::shard(0), Placement::shard(1)},
                     .global_shape = {7, 5}};
  const std::vector<Layout> targets{
      {.mesh = {{"dp_shard", 3}}, .placements = {Placement::shard(1)}, .global_shape = {7, 5}},
      {.mesh = {{"pp", 2}, {"dp_shard", 2}},
       .placements = {Placement::replicate(), Placement::shard(0)},
       .global_shape = {7, 5}},
      {.mesh = {}, .placements = {}, .global_shape = {7, 5}},
  };
  for (const auto& target : targets) {
    for (const auto& tc : all_coordinates(target.mesh)) {
      const Box tbox = target.local_box(tc);
      at::Tensor piece = at::full(tbox.sizes, NAN);
      std::int64_t copied = 0;
      for (const auto& sc : all_coordinates(saved.mesh)) {
        const Box sbox = saved.local_box(sc);
        copied += dtrain::dist::copy_intersection(slice_of(global, sbox).clone(), sbox, piece, tbox);
      }
      EXPECT_EQ(copied, tbox.numel()) << target.to_string();
      EXPECT_TRUE(piece.equal(slice_of(global, tbox))) << target.to_string();
    }
  }
}

TEST(Layout, BadLayoutsFailWithAClearError) {
  auto error = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const dtrain::ConfigError& e) {
      return e.what();
    }
    return "(no ConfigError)";
  };
  const Layout too_few{.mesh = {{"dp_shard", 2}, {"tp", 2}}, .placements = {Placement::shard(0)}, .global_shape = {4}};
  EXPECT_NE(error([&] { too_few.validate(); }).find("1 placements for a mesh of 2 dimensions"), std::string::npos);
  const Layout bad_dim{.mesh = {{"tp", 2}}, .placements = {Placement::shard(2)}, .global_shape = {4, 4}};
  EXPECT_NE(error([&] { bad_dim.validate(); }).find("shards tensor dimension 2 over tp"), std::string::npos);
  EXPECT_NE(error([&] { (void)bad_dim.local_box({0, 0}); }).find("shards tensor dimension 2"), std::string::npos);
  at::Tensor t = at::zeros({2});
  EXPECT_NE(error([&] {
              dtrain::dist::copy_intersection(at::zeros({3}), Box{{0}, {2}}, t, Box{{0}, {2}});
            }).find("not their boxes' shapes"),
            std::string::npos);
}
