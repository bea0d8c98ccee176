// The named N-D DeviceMesh: coordinates are row-major with the last dimension
// fastest; every dimension's and join's group holds exactly the ranks that
// differ along it (checked against the members computed here and by an
// all-reduce over the group); joined groups number their ranks row-major;
// bad meshes fail with a ConfigError naming the problem.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "dtrain/comm/mesh.h"
#include "dtrain/error.h"
#include "ranks.h"

using dtrain::dist::DeviceMesh;
using dtrain::dist::MeshDim;
using dtrain::testing::run_rank_threads;

namespace {

constexpr auto kMeshTimeout = std::chrono::seconds(30);

// The world ranks that share every coordinate of `rank` outside `span`
// (dimension indices), given the mesh's sizes, in row-major order.
std::vector<int> expected_members(const std::vector<int>& sizes, int rank, const std::vector<std::size_t>& span) {
  std::vector<int> coords(sizes.size());
  for (std::size_t d = sizes.size(), rest = static_cast<std::size_t>(rank); d-- > 0;) {
    coords[d] = static_cast<int>(rest % static_cast<std::size_t>(sizes[d]));
    rest /= static_cast<std::size_t>(sizes[d]);
  }
  std::vector<int> members;
  int world = 1;
  for (int s : sizes) world *= s;
  for (int r = 0; r < world; ++r) {
    bool same = true;
    for (std::size_t d = sizes.size(), rest = static_cast<std::size_t>(r); d-- > 0;) {
      const int c = static_cast<int>(rest % static_cast<std::size_t>(sizes[d]));
      rest /= static_cast<std::size_t>(sizes[d]);
      const bool spanned = std::find(span.begin(), span.end(), d) != span.end();
      if (!spanned && c != coords[d]) same = false;
    }
    if (same) members.push_back(r);
  }
  return members;
}

void expect_group(dtrain::dist::ProcessGroup& group, const std::vector<int>& members, int world_rank,
                  const std::string& what) {
  EXPECT_EQ(group.world_ranks(), members) << what;
  EXPECT_EQ(group.world_ranks().at(static_cast<std::size_t>(group.rank())), world_rank) << what;
  at::Tensor t = at::full({1}, static_cast<double>(world_rank), at::kDouble);
  group.all_reduce(t).wait();
  double sum = 0;
  for (int m : members) sum += m;
  EXPECT_EQ(t.item<double>(), sum) << what;
}

std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const dtrain::ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

}  // namespace

// pp 2 x dp_shard 2 x tp 2 on 8 ranks, with the default joins and one more.
TEST(DeviceMesh, ThreeDimensionsOnEightRanks) {
  constexpr int kWorld = 8;
  run_rank_threads(kWorld, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, kWorld, {.timeout = kMeshTimeout});
    DeviceMesh mesh(world, {{"pp", 2}, {"dp_shard", 2}, {"tp", 2}},
                    {.joins = {{"dp_replicate", "dp_shard"}, {"dp_shard", "tp"}, {"pp", "tp"}}});
    const std::vector<int> sizes{2, 2, 2};
    EXPECT_EQ(mesh.coordinates(), (std::vector<int>{rank / 4, (rank / 2) % 2, rank % 2}));
    EXPECT_EQ(mesh.coordinate("tp"), rank % 2);
    EXPECT_EQ(mesh.coordinate("cp"), 0);
    EXPECT_EQ(mesh.size("cp"), 1);
    EXPECT_FALSE(mesh.has("dp_replicate"));
    EXPECT_EQ(mesh.rank_at(mesh.coordinates()), rank);
    EXPECT_EQ(mesh.describe(), "2 (pp) x 2 (dp_shard) x 2 (tp)");
    const std::string at = " rank " + std::to_string(rank);
    expect_group(mesh["pp"], expected_members(sizes, rank, {0}), rank, "pp" + at);
    expect_group(mesh["dp_shard"], expected_members(sizes, rank, {1}), rank, "dp_shard" + at);
    expect_group(mesh["tp"], expected_members(sizes, rank, {2}), rank, "tp" + at);
    // A join of one present dimension is that dimension's group.
    EXPECT_EQ(mesh.join({"dp_replicate", "dp_shard"}).world_ranks(), mesh["dp_shard"].world_ranks());
    auto& shard_tp = mesh.join({"dp_shard", "tp"});
    expect_group(shard_tp, expected_members(sizes, rank, {1, 2}), rank, "dp_shard+tp" + at);
    EXPECT_EQ(shard_tp.rank(), mesh.coordinate("dp_shard") * 2 + mesh.coordinate("tp")) << at;
    expect_group(mesh.join({"pp", "tp"}), expected_members(sizes, rank, {0, 2}), rank, "pp+tp" + at);
    EXPECT_NE(config_error([&] { mesh.join({"pp", "dp_shard"}); }).find("made no group"), std::string::npos);
    EXPECT_NE(config_error([&] { mesh["cp"]; }).find("has no dimension 'cp'"), std::string::npos);
  });
}

// HSDP's shape: dp_replicate 2 x dp_shard 2; the data-parallel rank of the
// joined group is row-major over the two.
TEST(DeviceMesh, ReplicateTimesShardJoinNumbersRanksRowMajor) {
  constexpr int kWorld = 4;
  run_rank_threads(kWorld, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, kWorld, {.timeout = kMeshTimeout});
    DeviceMesh mesh(world, {{"dp_replicate", 2}, {"dp_shard", 2}});
    auto& data = mesh.join({"dp_replicate", "dp_shard"});
    EXPECT_EQ(data.size(), 4);
    EXPECT_EQ(data.rank(), mesh.coordinate("dp_replicate") * 2 + mesh.coordinate("dp_shard"));
    EXPECT_EQ(mesh.join({"dp_shard", "cp"}).world_ranks(), mesh["dp_shard"].world_ranks());
    expect_group(mesh["dp_replicate"], expected_members({2, 2}, rank, {0}), rank, "dp_replicate");
    // A join of dimensions the mesh lacks: this rank alone.
    DeviceMesh flat(world, {{"dp_shard", 4}}, {.joins = {{"cp", "tp"}}});
    EXPECT_EQ(flat.join({"cp", "tp"}).size(), 1);
    EXPECT_EQ(flat.join({"cp", "tp"}).world_ranks(), std::vector<int>{rank});
  });
}

TEST(DeviceMesh, BadMeshesFailWithAClearError) {
  run_rank_threads(2, [&](int rank, dtrain::dist::Store store) {
    auto world = dtrain::dist::init_process_group(store, rank, 2, {.timeout = kMeshTimeout});
    auto make = [&](std::vector<MeshDim> dims) { return config_error([&] { DeviceMesh unused(world, dims); }); };
    EXPECT_NE(make({{"dp", 2}}).find("'dp' is not one dtrain knows"), std::string::npos);
    EXPECT_NE(make({{"tp", 1}, {"tp", 2}}).find("listed twice"), std::string::npos);
    EXPECT_NE(make({{"tp", 2}, {"pp", 1}}).find("outermost first: pp, dp_replicate, dp_shard, cp, tp"),
              std::string::npos);
    EXPECT_NE(make({{"pp", 0}, {"tp", 2}}).find("'pp' has size 0"), std::string::npos);
    const std::string product = make({{"pp", 2}, {"tp", 2}});
    EXPECT_NE(product.find("holds 4 ranks, but its group has 2"), std::string::npos) << product;
    EXPECT_NE(config_error([&] {
                DeviceMesh unused(world, {{"tp", 2}}, {.joins = {{"tp", "ep"}}});
              }).find("'ep', which dtrain does not know"),
              std::string::npos);
  });
}
