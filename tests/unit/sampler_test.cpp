// Samplers: exhaustive partition checks over sizes and world sizes,
// resumption (also with a different world size), and cost balancing.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "dtrain/data/sampler.h"
#include "dtrain/error.h"

using namespace dtrain::data;

namespace {
std::vector<std::vector<std::int64_t>> all_ranks(std::int64_t n, int world, bool shuffle, bool drop_last,
                                                 std::int64_t epoch) {
  std::vector<std::vector<std::int64_t>> out;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(
        {.dataset_size = n, .num_replicas = world, .rank = r, .shuffle = shuffle, .seed = 7, .drop_last = drop_last});
    s.set_epoch(epoch);
    out.push_back(s.remaining_indices());
  }
  return out;
}
}  // namespace

TEST(DistributedSampler, PartitionsEveryEpochForAllSizesAndWorlds) {
  for (std::int64_t n : {0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 100}) {
    for (int world = 1; world <= 8; ++world) {
      for (bool shuffle : {false, true}) {
        for (bool drop_last : {false, true}) {
          for (std::int64_t epoch : {0, 1, 2}) {
            SCOPED_TRACE(::testing::Message() << "n=" << n << " world=" << world << " shuffle=" << shuffle
                                              << " drop_last=" << drop_last << " epoch=" << epoch);
            const auto ranks = all_ranks(n, world, shuffle, drop_last, epoch);
            const std::int64_t per_rank = drop_last ? n / world : (n + world - 1) / world;
            std::multiset<std::int64_t> all;
            for (const auto& r : ranks) {
              ASSERT_EQ(static_cast<std::int64_t>(r.size()), per_rank);
              for (auto i : r) {
                ASSERT_GE(i, 0);
                ASSERT_LT(i, n);
                all.insert(i);
              }
            }
            const std::set<std::int64_t> distinct(all.begin(), all.end());
            if (drop_last) {
              EXPECT_EQ(distinct.size(), all.size()) << "ranks overlap";
            } else {
              EXPECT_EQ(static_cast<std::int64_t>(distinct.size()), n) << "ranks do not cover the dataset";
              EXPECT_EQ(static_cast<std::int64_t>(all.size()), per_rank * world);
            }
          }
        }
      }
    }
  }
}

TEST(DistributedSampler, EpochsShuffleDifferentlyAndSequentialIsOrdered) {
  const auto e0 = all_ranks(50, 1, true, false, 0)[0];
  const auto e1 = all_ranks(50, 1, true, false, 1)[0];
  EXPECT_NE(e0, e1);
  EXPECT_EQ(e0, all_ranks(50, 1, true, false, 0)[0]) << "same seed and epoch must give the same order";
  auto seq = sequential_sampler(5);
  EXPECT_EQ(seq.remaining_indices(), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
}

TEST(DistributedSampler, StepsCarryGlobalPositions) {
  DistributedSampler s({.dataset_size = 10, .num_replicas = 2, .rank = 1, .shuffle = false});
  const auto steps = s.steps(2, /*drop_last=*/false);
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[0].indices, (std::vector<std::int64_t>{1, 3}));
  EXPECT_EQ(steps[0].global_end, 4);
  EXPECT_EQ(steps[2].indices, (std::vector<std::int64_t>{9}));
  EXPECT_EQ(steps[2].global_end, 10);
  EXPECT_EQ(s.steps(2, /*drop_last=*/true).size(), 2u);
  EXPECT_EQ(s.examples_per_epoch(2, false), 5);
}

TEST(DistributedSampler, ResumeWithSameOrDifferentWorldNeitherRepeatsNorSkips) {
  const std::int64_t n = 97;
  for (int before = 1; before <= 4; ++before) {
    for (int after = 1; after <= 4; ++after) {
      SCOPED_TRACE(::testing::Message() << before << " ranks, then " << after);
      std::multiset<std::int64_t> seen;
      SamplerState saved;
      for (int r = 0; r < before; ++r) {
        DistributedSampler s({.dataset_size = n, .num_replicas = before, .rank = r, .seed = 3, .drop_last = true});
        s.set_epoch(4);
        const auto steps = s.steps(5, true);
        for (int k = 0; k < 3; ++k) seen.insert(steps[k].indices.begin(), steps[k].indices.end());
        s.advance_to(steps[2].global_end);
        saved = s.state();
      }
      EXPECT_EQ(saved, (SamplerState{.epoch = 4, .consumed = 15 * before}));
      for (int r = 0; r < after; ++r) {
        DistributedSampler s({.dataset_size = n, .num_replicas = after, .rank = r, .seed = 3, .drop_last = true});
        s.load_state(saved);
        s.set_epoch(4);  // same epoch: keeps the loaded position
        for (auto i : s.remaining_indices()) seen.insert(i);
      }
      const std::set<std::int64_t> distinct(seen.begin(), seen.end());
      EXPECT_EQ(distinct.size(), seen.size()) << "an example was repeated";
      const auto leftover = (n - 15 * before) % after;
      EXPECT_EQ(static_cast<std::int64_t>(seen.size()), n - leftover) << "examples were skipped";
    }
  }
}

TEST(DistributedSampler, BadOptions) {
  EXPECT_THROW(DistributedSampler({.dataset_size = 5, .num_replicas = 2, .rank = 2}), dtrain::ConfigError);
  EXPECT_THROW(DistributedSampler({.dataset_size = 5, .num_replicas = 0}), dtrain::ConfigError);
  EXPECT_THROW(DistributedSampler({.dataset_size = -1}), dtrain::ConfigError);
  EXPECT_THROW(sequential_sampler(5).steps(0, false), dtrain::ConfigError);
}

namespace {
// Lengths with a heavy tail (log-normal), as in text or speech corpora.
std::vector<double> skewed_costs(std::int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor z = at::randn({n}, gen, at::kDouble);
  std::vector<double> costs(static_cast<size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    costs[static_cast<size_t>(i)] = std::round(100.0 * std::exp(z[i].item<double>()));
  return costs;
}

// Largest (max - min) / max over steps of the ranks' batch costs.
double worst_spread(const std::vector<std::vector<std::vector<std::int64_t>>>& steps, const std::vector<double>& cost) {
  double worst = 0;
  for (const auto& step : steps) {
    std::vector<double> totals;
    for (const auto& batch : step) {
      double t = 0;
      for (auto i : batch) t += cost[static_cast<size_t>(i)];
      totals.push_back(t);
    }
    const auto [lo, hi] = std::minmax_element(totals.begin(), totals.end());
    worst = std::max(worst, (*hi - *lo) / *hi);
  }
  return worst;
}
}  // namespace

TEST(BalancedSampler, BalancesSkewedCostsWhereRoundRobinDoesNot) {
  const std::int64_t n = 4096, batch = 32;
  const int world = 4;
  const auto costs = skewed_costs(n);
  BalancedDistributedSampler balanced({.costs = costs, .num_replicas = world, .rank = 0, .seed = 1});
  const auto steps = balanced.all_ranks(batch, /*drop_last=*/true);
  ASSERT_EQ(static_cast<std::int64_t>(steps.size()), n / (batch * world));
  const double balanced_spread = worst_spread(steps, costs);

  // Round-robin (DistributedSampler) batches of the same steps.
  std::vector<std::vector<std::vector<std::int64_t>>> rr(steps.size());
  for (int r = 0; r < world; ++r) {
    DistributedSampler s({.dataset_size = n, .num_replicas = world, .rank = r, .seed = 1});
    const auto mine = s.steps(batch, true);
    for (size_t k = 0; k < rr.size(); ++k) rr[k].push_back(mine[k].indices);
  }
  const double rr_spread = worst_spread(rr, costs);
  std::printf("worst per-step cost spread: balanced %.2f%%, round-robin %.2f%%\n", 100 * balanced_spread,
              100 * rr_spread);
  EXPECT_LE(balanced_spread, 0.05);
  EXPECT_GE(rr_spread, 0.25);

  // Every example once per epoch, batch sizes equal.
  std::set<std::int64_t> seen;
  for (const auto& step : steps) {
    for (const auto& b : step) {
      EXPECT_EQ(static_cast<std::int64_t>(b.size()), batch);
      for (auto i : b) EXPECT_TRUE(seen.insert(i).second);
    }
  }
  EXPECT_EQ(static_cast<std::int64_t>(seen.size()), n);
}

TEST(BalancedSampler, ResumesAcrossWorldSizes) {
  const auto costs = skewed_costs(1000);
  std::set<std::int64_t> seen;
  SamplerState saved;
  for (int r = 0; r < 4; ++r) {
    BalancedDistributedSampler s({.costs = costs, .num_replicas = 4, .rank = r, .seed = 2});
    const auto steps = s.steps(10, true);
    for (int k = 0; k < 5; ++k) {
      for (auto i : steps[k].indices) EXPECT_TRUE(seen.insert(i).second);
    }
    s.advance_to(steps[4].global_end);
    saved = s.state();
  }
  EXPECT_EQ(saved.consumed, 200);
  for (int r = 0; r < 3; ++r) {
    BalancedDistributedSampler s({.costs = costs, .num_replicas = 3, .rank = r, .seed = 2});
    s.load_state(saved);
    for (const auto& step : s.steps(10, false)) {
      for (auto i : step.indices) EXPECT_TRUE(seen.insert(i).second) << "repeated " << i;
    }
  }
  EXPECT_EQ(seen.size(), 1000u);
}
