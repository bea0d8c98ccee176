// Named dropout streams for tensor parallelism (see rng_tracker.h).
#include "dtrain/nn/rng_tracker.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <sstream>

#include "dtrain/error.h"

namespace dtrain::nn {

RngTracker RngTracker::for_tp(std::uint64_t seed, int tp_rank) {
  RngTracker tracker;
  tracker.add(kReplicated, seed);
  tracker.add(kTensorParallel, seed + kTensorParallelOffset + static_cast<std::uint64_t>(tp_rank));
  return tracker;
}

void RngTracker::add(const std::string& name, std::uint64_t seed) {
  DTRAIN_CHECK(!has(name), ConfigError, "RngTracker: the stream " << name << " exists already.",
               "give each stream its own name");
  streams_.emplace(name, at::make_generator<at::CPUGeneratorImpl>(seed));
}

at::Generator& RngTracker::generator(const std::string& name) {
  auto it = streams_.find(name);
  if (it == streams_.end()) {
    std::ostringstream known;
    for (const auto& [n, g] : streams_) known << " " << n;
    DTRAIN_CHECK(false, ConfigError, "RngTracker: no stream " << name << " (streams:" << known.str() << ").",
                 "add it with add(name, seed) or RngTracker::for_tp");
  }
  return it->second;
}

at::Tensor RngTracker::draw_mask(const std::string& stream, at::IntArrayRef shape, double p,
                                 const at::TensorOptions& options) {
  DTRAIN_CHECK(p >= 0 && p < 1, ConfigError, "dropout probability " << p << " is outside [0, 1).",
               "pass a probability in [0, 1)");
  at::Generator& gen = generator(stream);
  // (bernoulli_ takes the generator's mutex itself.)
  at::Tensor mask = at::empty(shape, at::TensorOptions().dtype(at::kFloat)).bernoulli_(1 - p, gen).to(at::kBool);
  mask = mask.to(options.device());
  if (observer_) observer_(stream, mask);
  return mask;
}

at::Tensor RngTracker::dropout(const at::Tensor& x, double p, const std::string& stream) {
  if (p == 0) return x;
  return apply_dropout_mask(x, draw_mask(stream, x.sizes(), p, x.options()), p);
}

std::map<std::string, at::Tensor> RngTracker::state() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, gen] : streams_) out[name] = gen.get_state();
  return out;
}

void RngTracker::set_state(const std::map<std::string, at::Tensor>& states) {
  for (const auto& [name, state] : states) generator(name).set_state(state);
}

at::Tensor apply_dropout_mask(const at::Tensor& x, const at::Tensor& mask, double p) {
  return x * mask.to(x.scalar_type()).div(1 - p);
}

}  // namespace dtrain::nn
