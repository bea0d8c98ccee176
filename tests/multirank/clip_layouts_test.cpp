// GradientSet::from_layouts: the global gradient norm, and clipping, of
// gradients laid out over a mesh equal those of the whole gradients in one
// process. Each rank holds its parts of a few "global" gradients (tp-sharded
// on either dimension, replicated, and, on a pp mesh, disjoint per stage), as
// a tensor-parallel model under any plan would after gradient sync.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/dist/clip.h"
#include "dtrain/dist/layout.h"
#include "dtrain/dist/parameter_layouts.h"
#include "dtrain/error.h"
#include "ranks.h"

using dtrain::dist::DeviceMesh;
using dtrain::dist::Layout;
using dtrain::dist::MeshDim;
using dtrain::dist::Placement;

namespace {

constexpr auto kClipLayoutsTimeout = std::chrono::seconds(30);

// One global gradient: its tensor and its placement on tp (the other mesh
// dimensions replicate it); `stage` is the pp stage holding it (-1: every
// stage, on meshes without pp).
struct GlobalGradient {
  at::Tensor value;
  Placement on_tp;
  int stage = -1;
};

// Deterministic gradients with odd sizes, different per stage.
std::vector<GlobalGradient> clip_layouts_gradients(bool with_stages) {
  std::vector<GlobalGradient> all;
  const int stages = with_stages ? 2 : 1;
  for (int s = 0; s < stages; ++s) {
    const float k = static_cast<float>(s + 1);
    all.push_back({at::linspace(-3.0 * k, 2.0, 6 * 5).reshape({6, 5}), Placement::shard(0), with_stages ? s : -1});
    all.push_back({at::linspace(1.0, 4.0 * k, 3 * 8).reshape({3, 8}), Placement::shard(1), with_stages ? s : -1});
    all.push_back({at::linspace(-0.5 * k, 7.0, 5), Placement::replicate(), with_stages ? s : -1});
  }
  return all;
}

// This rank's parameters (with gradients set to its parts) and their layouts.
std::vector<std::pair<at::Tensor, Layout>> clip_layouts_local(const std::vector<GlobalGradient>& all,
                                                              const DeviceMesh& mesh) {
  std::vector<std::pair<at::Tensor, Layout>> local;
  for (const GlobalGradient& g : all) {
    if (g.stage >= 0 && g.stage != mesh.coordinate("pp")) continue;
    Layout layout{.mesh = mesh.dims(), .placements = {}, .global_shape = g.value.sizes().vec()};
    for (const MeshDim& d : mesh.dims()) {
      layout.placements.push_back(d.name == "tp" ? g.on_tp : Placement::replicate());
    }
    at::Tensor part = dtrain::dist::local_part(g.value, layout, mesh.coordinates()).clone();
    at::Tensor parameter = at::zeros_like(part).requires_grad_(true);
    parameter.mutable_grad() = part;
    local.emplace_back(parameter, layout);
  }
  return local;
}

void check_clip_by_layouts(std::vector<MeshDim> dims, bool with_stages) {
  int world = 1;
  for (const MeshDim& d : dims) world *= d.size;
  const std::vector<GlobalGradient> all = clip_layouts_gradients(with_stages);
  for (const double p : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    // The reference: every gradient whole, in one process.
    std::vector<at::Tensor> whole;
    for (const GlobalGradient& g : all) {
      at::Tensor parameter = at::zeros_like(g.value).requires_grad_(true);
      parameter.mutable_grad() = g.value.clone();
      whole.push_back(parameter);
    }
    const double max_norm = 1.5;
    const double expected =
        dtrain::clip_grad_norm_(dtrain::GradientSet::replicated(whole), max_norm, {.norm_type = p}).item<double>();
    dtrain::testing::run_rank_threads(world, [&](int rank, dtrain::dist::Store store) {
      auto group = dtrain::dist::init_process_group(store, rank, world, {.timeout = kClipLayoutsTimeout});
      DeviceMesh mesh(group, dims);
      auto local = clip_layouts_local(all, mesh);
      const std::vector<std::string> partitioned =
          with_stages ? std::vector<std::string>{"pp"} : std::vector<std::string>{};
      const dtrain::GradientSet set = dtrain::GradientSet::from_layouts(local, mesh, partitioned);
      // Every element counted once, so the counted elements sum to the whole's.
      const double norm = dtrain::clip_grad_norm_(set, max_norm, {.norm_type = p}).item<double>();
      EXPECT_NEAR(norm, expected, 1e-5 * expected) << "p " << p << " on " << mesh.describe() << " rank " << rank;
      // Every clipped part equals its part of the clipped whole: replicated
      // copies too, where counted and where counted elsewhere (which must
      // scale by the same factor, or the copies drift apart).
      std::size_t k = 0;
      for (std::size_t i = 0; i < all.size(); ++i) {
        if (all[i].stage >= 0 && all[i].stage != mesh.coordinate("pp")) continue;
        const auto& [parameter, layout] = local[k++];
        const at::Tensor want = dtrain::dist::local_part(whole[i].grad(), layout, mesh.coordinates());
        EXPECT_TRUE(at::allclose(parameter.grad(), want, 1e-6, 1e-6))
            << "gradient " << i << " p " << p << " rank " << rank;
      }
    });
  }
}

}  // namespace

TEST(GradientSetFromLayouts, TensorParallelEqualsOneProcess) {
  check_clip_by_layouts({{"tp", 4}}, false);
}

TEST(GradientSetFromLayouts, DataReplicatedTimesTensorParallelEqualsOneProcess) {
  check_clip_by_layouts({{"dp_replicate", 2}, {"tp", 2}}, false);
}

TEST(GradientSetFromLayouts, PipelineTimesTensorParallelEqualsOneProcess) {
  check_clip_by_layouts({{"pp", 2}, {"tp", 2}}, true);
}

TEST(GradientSetFromLayouts, PartialGradientsAndForeignMeshesAreRefused) {
  dtrain::testing::run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = kClipLayoutsTimeout});
    DeviceMesh mesh(group, {{"tp", 2}});
    at::Tensor parameter = at::zeros({2});
    Layout partial{.mesh = mesh.dims(), .placements = {Placement::partial()}, .global_shape = {2}};
    EXPECT_THROW(dtrain::GradientSet::from_layouts({{parameter, partial}}, mesh), dtrain::ConfigError);
    Layout other{.mesh = {{"dp_shard", 2}}, .placements = {Placement::replicate()}, .global_shape = {2}};
    EXPECT_THROW(dtrain::GradientSet::from_layouts({{parameter, other}}, mesh), dtrain::ConfigError);
    EXPECT_THROW(dtrain::GradientSet::from_layouts({}, mesh, {"pp"}), dtrain::ConfigError);
  });
}

// fp64 parameters sharded over 2 ranks, one of which got no gradient this
// step: both ranks must combine their partial norms in the same dtype (the
// parameters', not the gradients' they happen to hold), and the norm is the
// other rank's gradient's.
TEST(GradientSetSharded, RankWithoutGradientsCombinesInTheParametersDtype) {
  dtrain::testing::run_rank_threads(2, [](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = kClipLayoutsTimeout});
    at::Tensor param = at::zeros({4}, at::kDouble).requires_grad_(true);
    if (rank == 0) param.mutable_grad() = at::tensor({3.0, 0.0, 4.0, 0.0}, at::kDouble);
    const at::Tensor norm = dtrain::grad_norm(dtrain::GradientSet::sharded({param}, group));
    EXPECT_EQ(norm.scalar_type(), at::kDouble) << "rank " << rank;
    EXPECT_DOUBLE_EQ(norm.item<double>(), 5.0) << "rank " << rank;
  });
}

// A rank that holds no parameters at all (e.g. a pipeline rank whose stage
// owns none of a set) beside a peer with fp64 ones: the partials are combined
// in fp64 on both, so the all-reduce matches and both see the peer's norm.
TEST(GradientSetSharded, RankWithNoParametersCombinesWithFp64Peers) {
  dtrain::testing::run_rank_threads(2, [](int rank, dtrain::dist::Store store) {
    auto group = dtrain::dist::init_process_group(store, rank, 2, {.timeout = kClipLayoutsTimeout});
    std::vector<at::Tensor> params;
    if (rank == 0) {
      params.push_back(at::zeros({2}, at::kDouble).requires_grad_(true));
      params.back().mutable_grad() = at::tensor({1.0 / 3.0, 1e-9}, at::kDouble);
    }
    const at::Tensor norm = dtrain::grad_norm(dtrain::GradientSet::sharded(params, group));
    const double expected = std::sqrt(1.0 / 9.0 + 1e-18);
    // fp64 on the rank with fp64 parameters (to the last bit), fp32 on the other.
    if (rank == 0) {
      EXPECT_DOUBLE_EQ(norm.item<double>(), expected);
    } else {
      EXPECT_FLOAT_EQ(norm.item<float>(), static_cast<float>(expected));
    }
  });
}
