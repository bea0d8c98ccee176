// The Trainer's batch sources (include/dtrain/trainer/batch_source.h).
#include "dtrain/trainer/batch_source.h"

#include <numeric>

#include "dtrain/data/loader.h"
#include "dtrain/error.h"

namespace dtrain {

EpochSource::EpochSource(std::shared_ptr<const Dataset> dataset, EpochSourceOptions options)
    : dataset_(std::move(dataset)), options_(options) {
  DTRAIN_CHECK(dataset_ != nullptr, ConfigError, "EpochSource got no dataset.", "pass the training set");
  DTRAIN_CHECK(
      options_.train_limit >= 0 && options_.num_workers >= 0, ConfigError,
      "EpochSourceOptions: train_limit " << options_.train_limit << ", num_workers " << options_.num_workers << ".",
      "both must be at least 0");
}

EpochSource::~EpochSource() = default;

void EpochSource::setup(const Context& context) {
  const std::int64_t n = options_.train_limit > 0 ? std::min(options_.train_limit, dataset_->size()) : dataset_->size();
  DTRAIN_CHECK(n / context.data_world > 0, ConfigError,
               n << " training examples cannot be shared by " << context.data_world << " ranks.",
               "use more examples or fewer ranks");
  examples_ = n;
  accumulate_ = context.accumulate;
  auto sampler =
      std::make_shared<data::DistributedSampler>(data::DistributedSamplerOptions{.dataset_size = n,
                                                                                 .num_replicas = context.data_world,
                                                                                 .rank = context.data_rank,
                                                                                 .seed = options_.seed,
                                                                                 .drop_last = true});
  loader_ = data::make_tensor_loader(
      dataset_, sampler,
      {.batch_size = context.batch_size, .drop_last = context.whole_batches, .num_workers = options_.num_workers});
}

std::optional<std::int64_t> EpochSource::start_epoch(std::int64_t epoch) {
  loader_->start_epoch(epoch);
  planned_ = true;
  return loader_->remaining() / accumulate_;  // a tail short of a whole step is not used
}

data::TensorBatch EpochSource::next(std::int64_t /*step*/, int /*micro*/) {
  auto batch = loader_->next();
  DTRAIN_INTERNAL_ASSERT(batch.has_value(), "the loader ran out inside a planned step");
  return std::move(*batch);
}

std::vector<std::int64_t> EpochSource::last_indices() const {
  return loader_->last_indices();
}

// Note [An epoch's tail]
// The sampler's position counts the examples the steps took. A world of w
// ranks leaves out the tail of an epoch that does not divide among them (up
// to w - 1 examples; the sampler drops it), and the Trainer the micro-batches
// short of a whole step; a run resumed from that position on another world
// size would take that tail as one more step of an epoch that already ended
// (a finished run of 3 ranks over 95 examples, resumed on 2 or 1, trained
// again, and the chaos soak's final checkpoint then differed from the run's).
// So once no whole step of the epoch is left, the position is the epoch's
// end, on every world size. Before the epoch is planned (after load_state)
// the position is reported as it is.
data::SamplerState EpochSource::state() const {
  data::SamplerState state = loader_->state();
  if (planned_ && loader_->remaining() < accumulate_) state.consumed = examples_;
  return state;
}

void EpochSource::load_state(const data::SamplerState& state) {
  loader_->load_state(state);
  planned_ = false;
}

StepStream::StepStream(Fn fn) : fn_(std::move(fn)) {
  DTRAIN_CHECK(fn_ != nullptr, ConfigError, "StepStream got no batch function.",
               "pass a function from StepStream::Request to a TensorBatch");
}

StepStream::~StepStream() = default;

data::TensorBatch StepStream::next(std::int64_t step, int micro) {
  last_first_ = ((step * context_.accumulate + micro) * context_.data_world + context_.data_rank) * context_.batch_size;
  return fn_({.step = step,
              .micro = micro,
              .accumulate = context_.accumulate,
              .data_rank = context_.data_rank,
              .data_world = context_.data_world,
              .batch_size = context_.batch_size});
}

std::vector<std::int64_t> StepStream::last_indices() const {
  if (last_first_ < 0) return {};
  std::vector<std::int64_t> indices(static_cast<std::size_t>(context_.batch_size));
  std::iota(indices.begin(), indices.end(), last_first_);
  return indices;
}

}  // namespace dtrain
