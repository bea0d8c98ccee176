// Distributed and cost-balanced samplers with resumable global positions.
#include "dtrain/data/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "dtrain/error.h"

namespace dtrain::data {
namespace {

std::vector<std::int64_t> epoch_order(std::int64_t n, bool shuffle, std::uint64_t seed, std::int64_t epoch) {
  std::vector<std::int64_t> order(static_cast<size_t>(n));
  if (!shuffle) {
    std::iota(order.begin(), order.end(), 0);
    return order;
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<std::uint64_t>(epoch));
  const at::Tensor perm = at::randperm(n, gen, at::kLong);
  std::copy_n(perm.data_ptr<std::int64_t>(), n, order.begin());
  return order;
}

void check_ranks(int num_replicas, int rank) {
  DTRAIN_CHECK(num_replicas >= 1, ConfigError, "sampler num_replicas=" << num_replicas << " must be at least 1.",
               "pass the world size");
  DTRAIN_CHECK(rank >= 0 && rank < num_replicas, ConfigError,
               "sampler rank=" << rank << " is not below num_replicas=" << num_replicas << ".", "pass this rank");
}

void check_batch(std::int64_t batch_size) {
  DTRAIN_CHECK(batch_size >= 1, ConfigError, "batch_size=" << batch_size << " must be at least 1.",
               "pass a positive batch size");
}

}  // namespace

void Sampler::set_epoch(std::int64_t epoch) {
  if (epoch != state_.epoch) state_ = SamplerState{.epoch = epoch, .consumed = 0};
}

std::int64_t Sampler::examples_per_epoch(std::int64_t batch_size, bool drop_last) const {
  std::int64_t total = 0;
  for (const auto& step : steps_from({.epoch = state_.epoch, .consumed = 0}, batch_size, drop_last)) {
    total += static_cast<std::int64_t>(step.indices.size());
  }
  return total;
}

DistributedSampler::DistributedSampler(DistributedSamplerOptions options) : options_(options) {
  DTRAIN_CHECK(options_.dataset_size >= 0, ConfigError,
               "sampler dataset_size=" << options_.dataset_size << " is negative.", "pass the dataset's size");
  check_ranks(options_.num_replicas, options_.rank);
}

std::vector<std::int64_t> DistributedSampler::remaining_from(const SamplerState& at) const {
  const std::int64_t n = options_.dataset_size;
  const std::int64_t world = options_.num_replicas;
  const auto order = epoch_order(n, options_.shuffle, options_.seed, at.epoch);
  const std::int64_t from = std::min(at.consumed, n);
  std::vector<std::int64_t> remaining(order.begin() + from, order.end());
  if (options_.drop_last) {
    remaining.resize(static_cast<size_t>(static_cast<std::int64_t>(remaining.size()) / world * world));
  } else if (!remaining.empty() && n > 0) {
    // Pad by cycling through the epoch's order from its start.
    for (std::int64_t i = 0; remaining.size() % static_cast<size_t>(world) != 0; ++i) {
      remaining.push_back(order[static_cast<size_t>(i % n)]);
    }
  }
  std::vector<std::int64_t> mine;
  for (size_t i = static_cast<size_t>(options_.rank); i < remaining.size(); i += static_cast<size_t>(world)) {
    mine.push_back(remaining[i]);
  }
  return mine;
}

std::vector<SamplerStep> DistributedSampler::steps_from(const SamplerState& at, std::int64_t batch_size,
                                                        bool drop_last) const {
  check_batch(batch_size);
  const auto mine = remaining_from(at);
  const std::int64_t world = options_.num_replicas;
  std::vector<SamplerStep> out;
  for (size_t start = 0; start < mine.size(); start += static_cast<size_t>(batch_size)) {
    const size_t end = std::min(mine.size(), start + static_cast<size_t>(batch_size));
    if (drop_last && end - start < static_cast<size_t>(batch_size)) break;
    out.push_back(SamplerStep{
        .indices = {mine.begin() + static_cast<std::ptrdiff_t>(start), mine.begin() + static_cast<std::ptrdiff_t>(end)},
        .global_end = at.consumed + world * static_cast<std::int64_t>(end)});
  }
  return out;
}

BalancedDistributedSampler::BalancedDistributedSampler(BalancedSamplerOptions options) : options_(std::move(options)) {
  check_ranks(options_.num_replicas, options_.rank);
  for (size_t i = 0; i < options_.costs.size(); ++i) {
    DTRAIN_CHECK(options_.costs[i] >= 0, ConfigError,
                 "example " << i << " has negative cost " << options_.costs[i] << ".",
                 "costs must be non-negative (e.g. sequence lengths)");
  }
}

// Greedy assignment leaves the heaviest and lightest batches a few percent
// apart on heavy-tailed costs; swapping one example between them, the pair
// whose cost difference is closest to half the gap, narrows it. Repeat while
// a swap helps (bounded).
void BalancedDistributedSampler::refine(std::vector<std::vector<std::int64_t>>& batches,
                                        std::vector<double>& totals) const {
  const auto cost = [&](std::int64_t i) { return options_.costs[static_cast<size_t>(i)]; };
  for (int round = 0; round < 256; ++round) {
    const auto hi = static_cast<size_t>(std::max_element(totals.begin(), totals.end()) - totals.begin());
    const auto lo = static_cast<size_t>(std::min_element(totals.begin(), totals.end()) - totals.begin());
    const double gap = totals[hi] - totals[lo];
    if (gap <= 0) return;
    size_t best_a = 0, best_b = 0;
    double best_after = gap;
    for (size_t a = 0; a < batches[hi].size(); ++a) {
      for (size_t b = 0; b < batches[lo].size(); ++b) {
        const double d = cost(batches[hi][a]) - cost(batches[lo][b]);
        const double after = std::abs(gap - 2 * d);
        if (d > 0 && after < best_after) {
          best_after = after;
          best_a = a;
          best_b = b;
        }
      }
    }
    if (best_after >= gap) return;
    const double d = cost(batches[hi][best_a]) - cost(batches[lo][best_b]);
    std::swap(batches[hi][best_a], batches[lo][best_b]);
    totals[hi] -= d;
    totals[lo] += d;
  }
}

std::vector<std::vector<std::vector<std::int64_t>>> BalancedDistributedSampler::all_ranks_from(const SamplerState& at,
                                                                                               std::int64_t batch_size,
                                                                                               bool drop_last) const {
  check_batch(batch_size);
  const auto n = static_cast<std::int64_t>(options_.costs.size());
  const int world = options_.num_replicas;
  const auto order = epoch_order(n, /*shuffle=*/true, options_.seed, at.epoch);
  const std::int64_t step_size = batch_size * world;
  std::vector<std::vector<std::vector<std::int64_t>>> out;
  for (std::int64_t start = std::min(at.consumed, n); start < n; start += step_size) {
    const std::int64_t end = std::min(n, start + step_size);
    if (drop_last && end - start < step_size) break;
    std::vector<std::int64_t> chunk(order.begin() + start, order.begin() + end);
    std::stable_sort(chunk.begin(), chunk.end(), [&](std::int64_t a, std::int64_t b) {
      return options_.costs[static_cast<size_t>(a)] > options_.costs[static_cast<size_t>(b)];
    });
    const auto capacity = static_cast<size_t>((static_cast<std::int64_t>(chunk.size()) + world - 1) / world);
    std::vector<std::vector<std::int64_t>> batches(static_cast<size_t>(world));
    std::vector<double> totals(static_cast<size_t>(world), 0.0);
    for (auto index : chunk) {
      size_t best = batches.size();
      for (size_t r = 0; r < batches.size(); ++r) {
        if (batches[r].size() >= capacity) continue;
        if (best == batches.size() || totals[r] < totals[best]) best = r;
      }
      batches[best].push_back(index);
      totals[best] += options_.costs[static_cast<size_t>(index)];
    }
    refine(batches, totals);
    out.push_back(std::move(batches));
  }
  return out;
}

std::vector<SamplerStep> BalancedDistributedSampler::steps_from(const SamplerState& at, std::int64_t batch_size,
                                                                bool drop_last) const {
  const auto all = all_ranks_from(at, batch_size, drop_last);
  const auto n = static_cast<std::int64_t>(options_.costs.size());
  const std::int64_t step_size = batch_size * options_.num_replicas;
  std::vector<SamplerStep> out;
  std::int64_t position = std::min(at.consumed, n);
  for (const auto& step : all) {
    position = std::min(n, position + step_size);
    out.push_back(SamplerStep{.indices = step[static_cast<size_t>(options_.rank)], .global_end = position});
  }
  return out;
}

}  // namespace dtrain::data
