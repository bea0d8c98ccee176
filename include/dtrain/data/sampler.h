// Samplers decide which examples each rank reads, in which order and in which
// batches, epoch by epoch, and remember how far an epoch has got so that a
// resumed, or resized (elastic), run neither repeats nor skips an example.
//
// Positions are global: within an epoch every rank derives the same ordering
// of all examples, and `consumed` counts examples taken by all ranks
// together. A sampler restarted at the same position with a different
// number of ranks shares out the remaining examples among the new ranks.
#pragma once

#include <cstdint>
#include <vector>

namespace dtrain::data {

struct SamplerState {
  std::int64_t epoch = 0;
  std::int64_t consumed = 0;  // examples of this epoch taken so far, all ranks together
  bool operator==(const SamplerState&) const = default;
};

// One step of one rank: its batch, and how far the global position moves
// once every rank has taken its batch of this step.
struct SamplerStep {
  std::vector<std::int64_t> indices;
  std::int64_t global_end = 0;  // `consumed` after this step
};

class Sampler {
 public:
  virtual ~Sampler() = default;
  // Selects the epoch (a new epoch starts at position 0; re-selecting the
  // loaded epoch keeps the loaded position).
  void set_epoch(std::int64_t epoch);
  const SamplerState& state() const { return state_; }
  void load_state(const SamplerState& state) { state_ = state; }
  // Records that the steps up to `global_end` have been taken.
  void advance_to(std::int64_t global_end) { state_.consumed = global_end; }
  // This rank's remaining steps of the current epoch, from the current position.
  std::vector<SamplerStep> steps(std::int64_t batch_size, bool drop_last) const {
    return steps_from(state_, batch_size, drop_last);
  }
  // Examples this rank takes in a whole epoch (from position 0).
  std::int64_t examples_per_epoch(std::int64_t batch_size, bool drop_last) const;

 protected:
  virtual std::vector<SamplerStep> steps_from(const SamplerState& at, std::int64_t batch_size,
                                              bool drop_last) const = 0;
  SamplerState state_;
};

struct DistributedSamplerOptions {
  std::int64_t dataset_size = 0;
  int num_replicas = 1;
  int rank = 0;
  bool shuffle = true;
  std::uint64_t seed = 0;
  // Drop the tail that does not divide evenly among ranks; otherwise pad it
  // by repeating examples from the start of the epoch's order, as torch does.
  bool drop_last = false;
};

// torch's DistributedSampler semantics: every epoch, a permutation of all
// examples (seed + epoch) or the natural order, padded or truncated to a
// multiple of num_replicas, dealt out round-robin. Ranks' sets are disjoint
// (up to padding) and together cover the dataset. With num_replicas = 1
// this is the plain sequential or seeded random sampler.
class DistributedSampler : public Sampler {
 public:
  explicit DistributedSampler(DistributedSamplerOptions options);
  // The indices this rank reads in the current epoch from the current position.
  std::vector<std::int64_t> remaining_indices() const { return remaining_from(state_); }
  const DistributedSamplerOptions& options() const { return options_; }

 protected:
  std::vector<SamplerStep> steps_from(const SamplerState& at, std::int64_t batch_size, bool drop_last) const override;

 private:
  std::vector<std::int64_t> remaining_from(const SamplerState& at) const;
  DistributedSamplerOptions options_;
};

inline DistributedSampler sequential_sampler(std::int64_t size) {
  return DistributedSampler({.dataset_size = size, .shuffle = false});
}
inline DistributedSampler random_sampler(std::int64_t size, std::uint64_t seed) {
  return DistributedSampler({.dataset_size = size, .shuffle = true, .seed = seed});
}

struct BalancedSamplerOptions {
  std::vector<double> costs;  // one per example, e.g. a sequence length
  int num_replicas = 1;
  int rank = 0;
  std::uint64_t seed = 0;
};

// Balances cost per step: each global step takes the next num_replicas x
// batch_size examples of the epoch's permutation and deals them to ranks by
// longest-processing-time-first (largest cost to the rank with the least total
// that still has room), then swaps examples between the heaviest and lightest
// batches while that narrows the gap, so ranks finish their batches at about
// the same time.
// The last, partial step is dropped unless drop_last is false, in which case
// it is dealt the same way (ranks may get different counts).
class BalancedDistributedSampler : public Sampler {
 public:
  explicit BalancedDistributedSampler(BalancedSamplerOptions options);
  // Every rank's batches of the current epoch from the current position
  // (steps x ranks), for inspection and tests.
  std::vector<std::vector<std::vector<std::int64_t>>> all_ranks(std::int64_t batch_size, bool drop_last) const {
    return all_ranks_from(state_, batch_size, drop_last);
  }

 protected:
  std::vector<SamplerStep> steps_from(const SamplerState& at, std::int64_t batch_size, bool drop_last) const override;

 private:
  std::vector<std::vector<std::vector<std::int64_t>>> all_ranks_from(const SamplerState& at, std::int64_t batch_size,
                                                                     bool drop_last) const;
  void refine(std::vector<std::vector<std::int64_t>>& batches, std::vector<double>& totals) const;
  BalancedSamplerOptions options_;
};

}  // namespace dtrain::data
