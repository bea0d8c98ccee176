// Named random streams for dropout under tensor parallelism, as Megatron-LM's
// RNG tracker (tensor_parallel/random.py): a dropout in a region that every
// tp rank holds alike must draw the same mask on every rank, and one in a
// region split over tp (attention probabilities of this rank's heads,
// activations of this rank's part of the sequence) must draw independent
// masks per rank, reproducibly.
//
//   auto rng = std::make_shared<RngTracker>(RngTracker::for_tp(seed, mesh.coordinate("tp")));
//   at::Tensor y = rng->dropout(x, 0.1, RngTracker::kTensorParallel);
//
// Streams (for_tp): kReplicated, seeded `seed` on every tp rank; kTensorParallel,
// seeded seed + 2718 + tp_rank (Megatron's offset). Every draw passes its
// generator explicitly: unlike Megatron, which swaps the process's default
// generator in and out (fork()), nothing global changes, so ranks that are
// threads of one process (the tests) and code drawing from the default
// generator meanwhile do not disturb the streams.
//
// Contracts: every tp rank draws from kReplicated in the same order with the
// same shapes (true of a model whose ranks run the same layers); a tracker is
// used by one thread at a time; state()/set_state() save and restore its
// streams, but nothing puts them into checkpoints yet: a resumed tp run with
// dropout restarts its streams from their seeds (issue 25, left).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

namespace dtrain::nn {

class RngTracker {
 public:
  static constexpr const char* kReplicated = "replicated";
  static constexpr const char* kTensorParallel = "tensor_parallel";
  static constexpr std::uint64_t kTensorParallelOffset = 2718;

  // The two streams above for tp rank `tp_rank`.
  static RngTracker for_tp(std::uint64_t seed, int tp_rank);

  // A new stream; ConfigError if `name` exists.
  void add(const std::string& name, std::uint64_t seed);
  bool has(const std::string& name) const { return streams_.count(name) != 0; }
  // The stream's generator (CPU); ConfigError naming the streams if unknown.
  at::Generator& generator(const std::string& name);

  // A keep-mask of `shape` (bool, true with probability 1 - p) drawn from
  // `stream` on the CPU (at::dropout's Bernoulli draw, with this generator),
  // on `options`' device.
  at::Tensor draw_mask(const std::string& stream, at::IntArrayRef shape, double p, const at::TensorOptions& options);
  // x * mask / (1 - p) with a mask from draw_mask; x itself when p is 0.
  at::Tensor dropout(const at::Tensor& x, double p, const std::string& stream);

  // Called with each mask drawn (tests record them to build a reference).
  void set_observer(std::function<void(const std::string& stream, const at::Tensor& mask)> observer) {
    observer_ = std::move(observer);
  }

  // Every stream's generator state (a uint8 tensor each), for checkpoints.
  std::map<std::string, at::Tensor> state() const;
  // Restores states saved by state(); ConfigError for a stream this tracker lacks.
  void set_state(const std::map<std::string, at::Tensor>& states);

 private:
  std::map<std::string, at::Generator> streams_;
  std::function<void(const std::string&, const at::Tensor&)> observer_;
};

// x * mask / (1 - p): dropout with a given keep-mask (bool, x's shape or
// broadcastable to it).
at::Tensor apply_dropout_mask(const at::Tensor& x, const at::Tensor& mask, double p);

}  // namespace dtrain::nn
