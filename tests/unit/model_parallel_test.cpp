// Model parallelism: the placement planner against hand-worked cases and
// budgets, and ModelParallel's output and gradients against the unplaced model.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/named_any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include "dtrain/comm/device.h"
#include "dtrain/error.h"
#include "dtrain/parallel/model_parallel/model_parallel.h"
#include "dtrain/parallel/model_parallel/placement.h"

namespace {

using dtrain::LayerCost;
using dtrain::plan_placement;
using Devices = std::vector<std::size_t>;

std::vector<LayerCost> bytes(std::vector<std::int64_t> sizes) {
  std::vector<LayerCost> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) out.push_back({"l" + std::to_string(i), sizes[i], 0});
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dtrain::ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Placement, BalancesMemoryInContiguousRuns) {
  EXPECT_EQ(plan_placement(bytes({1, 1, 1, 1}), 2).device_of_layer, (Devices{0, 0, 1, 1}));
  EXPECT_EQ(plan_placement(bytes({4, 1, 1, 1, 1}), 2).device_of_layer, (Devices{0, 1, 1, 1, 1}));
  EXPECT_EQ(plan_placement(bytes({1, 2, 3, 4, 5, 6}), 3).device_of_layer, (Devices{0, 0, 0, 1, 1, 2}));  // 6/9/6
  const auto p = plan_placement(bytes({3, 3, 2, 2, 2}), 2);
  EXPECT_EQ(p.device_of_layer, (Devices{0, 0, 1, 1, 1}));
  EXPECT_EQ(p.bytes_per_device, (std::vector<std::int64_t>{6, 6}));
  EXPECT_FALSE(p.balanced_compute);
  // More devices than layers: some devices stay empty.
  EXPECT_EQ(plan_placement(bytes({5, 5}), 4).bytes_per_device, (std::vector<std::int64_t>{5, 5, 0, 0}));
  EXPECT_TRUE(plan_placement({}, 2).device_of_layer.empty());
}

TEST(Placement, BalancesComputeWhenProfiled) {
  std::vector<LayerCost> layers = {{"a", 1, 3.0}, {"b", 1, 1.0}, {"c", 1, 1.0}, {"d", 1, 1.0}};
  const auto p = plan_placement(layers, 2);
  EXPECT_TRUE(p.balanced_compute);
  EXPECT_EQ(p.device_of_layer, (Devices{0, 1, 1, 1}));
  EXPECT_DOUBLE_EQ(p.load_per_device[0], 3.0);
}

TEST(Placement, RespectsBudgets) {
  // Balanced would be 2/2; device 0 holds only one layer.
  EXPECT_EQ(plan_placement(bytes({1, 1, 1, 1}), 2, {1, 10}).device_of_layer, (Devices{0, 1, 1, 1}));
  // The big layer fits only on device 1.
  EXPECT_EQ(plan_placement(bytes({1, 8, 1}), 3, {4, 8, 4}).device_of_layer, (Devices{0, 1, 2}));
  // Exactly full is fine.
  EXPECT_EQ(plan_placement(bytes({2, 2, 2}), 2, {4, 2}).device_of_layer, (Devices{0, 0, 1}));
}

TEST(Placement, SaysHowMuchMemoryIsMissing) {
  // In total: 20 bytes on 16.
  const auto total = error_of([] { plan_placement(bytes({10, 10}), 2, {8, 8}); });
  EXPECT_NE(total.find("needs 20 B but the devices' budgets (8 B, 8 B) hold 16 B; 4 B missing"), std::string::npos)
      << total;
  // Enough in total, but layer l0 (12 bytes) fits no device of 10.
  const auto split = error_of([] { plan_placement(bytes({12, 1}), 2, {10, 10}); });
  EXPECT_NE(split.find("'l0', 12 B); 2 B missing on each device"), std::string::npos) << split;
  // Contiguity: {3,3,3} on budgets {4,4,4} fits; on {5,1,5}... the middle one must go somewhere.
  const auto contiguous = error_of([] { plan_placement(bytes({3, 3, 3}), 2, {5, 5}); });
  EXPECT_NE(contiguous.find("1 B missing on each device"), std::string::npos) << contiguous;
  EXPECT_NE(error_of([] { plan_placement(bytes({1}), 2, {1}); }).find("1 memory budgets were given for 2 devices"),
            std::string::npos);
}

torch::nn::Sequential make_layers() {
  torch::manual_seed(3);
  return torch::nn::Sequential({{"in", torch::nn::Linear(10, 32)},
                                {"act1", torch::nn::Tanh()},
                                {"mid", torch::nn::Linear(32, 32)},
                                {"norm", torch::nn::BatchNorm1d(32)},
                                {"act2", torch::nn::ReLU()},
                                {"out", torch::nn::Linear(32, 4)}});
}

// Output and every parameter gradient of `model` on a fixed batch.
std::vector<at::Tensor> output_and_grads(torch::nn::Module& model, const std::function<at::Tensor(at::Tensor)>& fwd) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x = at::randn({9, 10}, gen);
  const at::Tensor out = fwd(x);
  out.pow(2).mean().backward();
  std::vector<at::Tensor> result = {out.detach()};
  for (auto& p : model.parameters()) result.push_back(p.grad().clone());
  return result;
}

void expect_equal_to_unplaced(dtrain::ModelParallel mp) {
  auto plain = make_layers();
  const auto want = output_and_grads(*plain, [&](at::Tensor x) { return plain->forward(x); });
  const auto got = output_and_grads(*mp, [&](at::Tensor x) { return mp(x); });
  ASSERT_EQ(want.size(), got.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::allclose(want[i], got[i], 1e-6, 1e-7)) << "tensor " << i;
  }
  EXPECT_EQ(mp->output_device(), mp->device_of_layer().back());
}

const c10::Device kCpu(c10::kCPU);

TEST(ModelParallel, ExplicitPlacementEqualsTheUnplacedModel) {
  expect_equal_to_unplaced(dtrain::ModelParallel(make_layers(), std::vector<c10::Device>(6, kCpu)));
}

TEST(ModelParallel, PlacementByNameEqualsTheUnplacedModel) {
  std::map<std::string, c10::Device> by_name;
  for (const char* name : {"in", "act1", "mid", "norm", "act2", "out"}) by_name.emplace(name, kCpu);
  expect_equal_to_unplaced(dtrain::ModelParallel(make_layers(), by_name));

  by_name.erase("norm");
  const auto missing = error_of([&] { dtrain::ModelParallel(make_layers(), by_name); });
  EXPECT_NE(missing.find("no device for layer 'norm'"), std::string::npos) << missing;
  EXPECT_NE(missing.find("in, act1, mid, norm, act2, out"), std::string::npos) << missing;
  by_name.emplace("norm", kCpu);
  by_name.emplace("head", kCpu);
  EXPECT_NE(error_of([&] { dtrain::ModelParallel(make_layers(), by_name); }).find("names layer 'head'"),
            std::string::npos);
}

TEST(ModelParallel, PlannedPlacementFollowsBudgets) {
  // Parameter bytes: in 1408, mid 4224, norm 256 (+ 264 buffer bytes), out 528.
  const auto costs = dtrain::layer_costs(make_layers());
  ASSERT_EQ(costs.size(), 6u);
  EXPECT_EQ(costs[0].bytes, (10 * 32 + 32) * 4);
  EXPECT_EQ(costs[1].bytes, 0);
  EXPECT_EQ(costs[3].bytes, (32 + 32) * 4 + (32 + 32) * 4 + 8);  // weight, bias, running mean/var, count

  dtrain::ModelParallel balanced(make_layers(), dtrain::ModelParallelOptions{.devices = {kCpu, kCpu}});
  // mid (4224) dominates: the best split puts it alone or with the small layers after it.
  ASSERT_TRUE(balanced->placement().has_value());
  EXPECT_EQ(balanced->placement()->device_of_layer, (Devices{0, 0, 1, 1, 1, 1}));
  expect_equal_to_unplaced(balanced);

  // Device 1 can hold only 1 KiB: mid and norm must stay on device 0 (the
  // weightless act2 goes to device 0 too: ties fill earlier devices first).
  dtrain::ModelParallel budgeted(make_layers(),
                                 dtrain::ModelParallelOptions{.devices = {kCpu, kCpu}, .memory_budgets = {8000, 1024}});
  EXPECT_EQ(budgeted->placement()->device_of_layer, (Devices{0, 0, 0, 0, 0, 1}));

  const auto too_small = error_of([] {
    dtrain::ModelParallel(
        make_layers(),
        dtrain::ModelParallelOptions{.devices = {kCpu, kCpu}, .memory_budgets = {2048, 2048}, .memory_factor = 2.0});
  });
  EXPECT_NE(too_small.find("does not fit"), std::string::npos) << too_small;
  EXPECT_NE(too_small.find("missing"), std::string::npos) << too_small;
}

TEST(ModelParallel, ProfiledPlacementBalancesCompute) {
  auto layers = make_layers();
  const at::Tensor sample = at::randn({64, 10});
  const at::Tensor mean_before = layers->named_buffers()["norm.running_mean"].clone();
  const auto costs = dtrain::profile_layers(layers, sample);
  for (const auto& c : costs) EXPECT_GT(c.compute, 0.0) << c.name;
  EXPECT_TRUE(at::equal(layers->named_buffers()["norm.running_mean"], mean_before));  // profiling changes nothing
  dtrain::ModelParallel mp(make_layers(),
                           dtrain::ModelParallelOptions{.devices = {kCpu, kCpu}, .profile_input = sample});
  EXPECT_TRUE(mp->placement()->balanced_compute);
  expect_equal_to_unplaced(mp);
}

TEST(ModelParallel, InvalidDevicesAreRejected) {
  if (dtrain::DeviceInventory::current().cuda_count > 0) GTEST_SKIP() << "needs a machine without GPUs";
  std::vector<c10::Device> devices(6, kCpu);
  devices[3] = c10::Device("cuda:0");
  EXPECT_THROW(dtrain::ModelParallel(make_layers(), devices), dtrain::DeviceError);
  EXPECT_THROW(dtrain::ModelParallel(make_layers(), std::vector<c10::Device>(5, kCpu)), dtrain::ConfigError);
}

}  // namespace
