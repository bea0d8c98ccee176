// Where the Trainer's training batches come from.
//
// Two kinds, one interface:
// - EpochSource: epochs over a Dataset, shuffled by a DistributedSampler and
//   loaded ahead by worker threads (what Trainer(strategy, opt, dataset, ...)
//   builds from TrainerOptions' seed, num_workers and train_limit);
// - StepStream: an endless stream indexed by the optimizer step, e.g. a
//   language model's random windows of a token file. The batch of a step is a
//   function of the global step only, so every parallelism plan trains on
//   the same examples and a run can resume under another plan:
//
//     auto source = std::make_shared<dtrain::StepStream>(
//         [&](const dtrain::StepStream::Request& r) {   // r.step, r.micro, r.data_rank, r.data_world
//           return my_batch(r.step, r.micro, r.data_rank, r.data_world);
//         });
//     dtrain::Trainer trainer(strategy, opt, source, {.max_steps = 2000});
//
// Contract: the Trainer calls setup() once with this rank's data-parallel
// position (from its strategy), then load_state() when it resumes, then for
// each epoch start_epoch() and, for each optimizer step, next() once per
// micro-batch in step order. state() is the position after the last batch
// returned (an epoch with no whole step left is at its end); checkpoints save it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/data/dataset.h"
#include "dtrain/data/sampler.h"

namespace dtrain {

namespace data {
struct TensorBatch;
template <typename Example, typename Batch>
class DataLoader;
}  // namespace data

class BatchSource {
 public:
  struct Context {
    int data_rank = 0;   // this rank's data-parallel index
    int data_world = 1;  // data-parallel ranks (replicas of a pipeline count once)
    std::int64_t batch_size = 1;
    int accumulate = 1;          // micro-batches per optimizer step
    bool whole_batches = false;  // the strategy needs every batch full (drop a partial last one)
  };

  virtual ~BatchSource() = default;
  virtual void setup(const Context& context) = 0;
  // Optimizer steps left in `epoch` from the current position (0: this epoch
  // is done, e.g. resumed at its end); nullopt: endless, the Trainer stops at
  // TrainerOptions::max_steps.
  virtual std::optional<std::int64_t> start_epoch(std::int64_t epoch) = 0;
  // Micro-batch `micro` of optimizer step `step` (0-based, counted over the
  // whole run) for this rank.
  virtual data::TensorBatch next(std::int64_t step, int micro) = 0;
  // The dataset indices of the last batch (the Trainer's sample log); empty
  // where examples have no indices.
  virtual std::vector<std::int64_t> last_indices() const { return {}; }
  virtual data::SamplerState state() const { return {}; }
  virtual void load_state(const data::SamplerState& /*state*/) {}
  // Examples per epoch, for logs (0: endless).
  virtual std::int64_t epoch_examples() const { return 0; }
};

struct EpochSourceOptions {
  std::uint64_t seed = 0;        // shuffling (seed + epoch)
  int num_workers = 0;           // loader threads
  std::int64_t train_limit = 0;  // the first N examples only (0: all)
};

// Epochs over a dataset: rank r of w reads its DistributedSampler share.
class EpochSource : public BatchSource {
 public:
  using Dataset = data::Dataset<data::TensorExample>;
  EpochSource(std::shared_ptr<const Dataset> dataset, EpochSourceOptions options);
  ~EpochSource() override;

  void setup(const Context& context) override;
  std::optional<std::int64_t> start_epoch(std::int64_t epoch) override;
  data::TensorBatch next(std::int64_t step, int micro) override;
  std::vector<std::int64_t> last_indices() const override;
  data::SamplerState state() const override;
  void load_state(const data::SamplerState& state) override;
  std::int64_t epoch_examples() const override { return examples_; }

 private:
  std::shared_ptr<const Dataset> dataset_;
  EpochSourceOptions options_;
  int accumulate_ = 1;
  std::int64_t examples_ = 0;
  bool planned_ = false;  // start_epoch() has planned the loader's epoch (Note [An epoch's tail])
  std::unique_ptr<data::DataLoader<data::TensorExample, data::TensorBatch>> loader_;
};

// An endless stream: the batch of (step, micro-batch, data rank) from a function.
// Its examples are numbered by their place in the stream (last_indices, for
// the Trainer's sample log): example i of micro-batch m of data rank r at
// step s is ((s * accumulate + m) * data_world + r) * batch_size + i, so
// every (step, micro-batch, data rank) has its own numbers.
class StepStream : public BatchSource {
 public:
  struct Request {
    std::int64_t step = 0;  // the optimizer step, 0-based over the whole run
    int micro = 0;          // the micro-batch of that step, 0-based
    int accumulate = 1;     // micro-batches per step
    int data_rank = 0;
    int data_world = 1;
    std::int64_t batch_size = 1;  // examples per micro-batch per data rank
  };
  using Fn = std::function<data::TensorBatch(const Request&)>;
  explicit StepStream(Fn fn);
  ~StepStream() override;

  void setup(const Context& context) override { context_ = context; }
  std::optional<std::int64_t> start_epoch(std::int64_t /*epoch*/) override { return std::nullopt; }
  data::TensorBatch next(std::int64_t step, int micro) override;
  std::vector<std::int64_t> last_indices() const override;

 private:
  Fn fn_;
  Context context_;
  std::int64_t last_first_ = -1;  // the stream position of the last batch's first example
};

}  // namespace dtrain
